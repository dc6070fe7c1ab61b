"""Top-k / top-p sampling without the full-vocabulary sort: the sort-free survivor finder against the sort.

Both paths apply the same rule (``ops/sampling_filter.py``) and give the same tokens; the sort path is the
oracle (``survivors_sorted`` / ``sample_sorted``), the new one ``survivor_threshold`` / ``sample``. Per
(batch, top-k / top-p config, logits kind): the survivor boundary alone and the whole ``sample`` op.

    python benchmarks/sampling.py [--quick] [--threads 1]            # CPU: both paths side by side, ratios
    python benchmarks/sampling.py --device cuda [--quick]             # GPU: absolute ms (CUDA events)

CPU: the paths alternate call by call (median of ``--repeat``), one thread by default so a shared
machine's load hits them alike; quote the ratios. The sort-free path is timed as the CPU runs it (eager:
a ``topk`` of 256 candidates first, the radix select for the rows it does not settle) and graph-safe
(the radix select alone, what CUDA runs). GPU: CUDA events around each call (median after
warm-up), plus the TileLang ``sample`` op eager and replayed from a CUDA graph (the finder has no host
synchronisation, so the whole op captures).

Logits: ``gauss`` (N(0, 2^2): flat, top-p 0.9 at T = 0.8 keeps about 11 % of the vocabulary, ~14k
tokens) and ``peaked`` (one dominant head over a long tail, as a language model's next-token logits:
top-p 0.9 keeps a few dozen).
"""

# ruff: noqa: B023  (the timing lambdas capture loop variables on purpose: each is used in its iteration)

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_time, emit, log, parser
from deepinfer_kernels.ops.sampling import sample, sample_sorted
from deepinfer_kernels.ops.sampling_filter import survivor_threshold, survivors_sorted

VOCAB = 129_280
CONFIGS = {"top_p_0.9": (0, 0.9), "top_k_50": (50, 1.0), "both": (50, 0.9)}


def make_logits(kind: str, b: int, vocab: int, device: str, g: torch.Generator) -> torch.Tensor:
    if kind == "gauss":
        x = torch.randn(b, vocab, generator=g) * 2
    else:  # a Zipf-like head: logit ~ -1.5 log(rank), shuffled over the vocabulary, plus noise
        rank = torch.arange(1, vocab + 1, dtype=torch.float32)
        x = -1.5 * torch.log(rank)[None, :] + 0.3 * torch.randn(b, vocab, generator=g)
        x = x.gather(1, torch.argsort(torch.rand(b, vocab, generator=g), dim=1))
    return x.to(device)


def sorted_threshold(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sort path's boundary: the last survivor of the full stable sort (the old way to the kernel's
    threshold)."""
    _, _, vals, idx, keep = survivors_sorted(*args)
    last = (keep.sum(dim=1) - 1).clamp(min=0)[:, None]
    return vals.gather(1, last), idx.gather(1, last)


def side_by_side(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Median seconds of each of ``fns``, called in turn (one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def cuda_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    return 1e3 * cuda_time(fn, reps=reps, warmup=warmup)


def graph_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """``fn`` captured once in a CUDA graph, then the median replay (CUDA events)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps=reps)


def run(device: str, batches: list[int], kinds: list[str], repeat: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    cuda_op = None
    if device == "cuda":
        from deepinfer_kernels import get_op

        cuda_op = get_op("sample", "cuda")
    for kind in kinds:
        for b in batches:
            logits = make_logits(kind, b, vocab, device, g)
            for name, (k, p) in CONFIGS.items():
                args = (
                    logits,
                    torch.full((b,), 0.8, device=device),
                    torch.full((b,), k, device=device),
                    torch.full((b,), p, device=device),
                )
                rng = (torch.arange(b, device=device), torch.arange(b, device=device))
                # the same tokens, or the numbers mean nothing
                assert torch.equal(sample(*args, *rng), sample_sorted(*args, *rng)), (kind, b, name)
                prm = {"device": device, "batch": b, "vocab": vocab, "config": name, "logits": kind}
                if device == "cpu":
                    prm["threads"] = torch.get_num_threads()
                    parts = {
                        "threshold": [
                            lambda: sorted_threshold(*args),
                            lambda: survivor_threshold(*args),
                            lambda: survivor_threshold(*args, graph_safe=True),
                        ],
                        "sample": [
                            lambda: sample_sorted(*args, *rng),
                            lambda: sample(*args, *rng),
                            lambda: sample(*args, *rng, graph_safe=True),
                        ],
                    }
                    for what, fns in parts.items():
                        t_sort, t_eager, t_safe = side_by_side(fns, repeat)
                        p2 = {**prm, "part": what}
                        emit("sampling", p2, "sort_ms", t_sort * 1e3, "ms")
                        emit("sampling", p2, "sort_free_ms", t_eager * 1e3, "ms")
                        emit("sampling", p2, "sort_free_graph_safe_ms", t_safe * 1e3, "ms")
                        emit("sampling", p2, "speedup_vs_sort", t_sort / t_eager, "x")
                        emit("sampling", p2, "speedup_vs_sort_graph_safe", t_sort / t_safe, "x")
                    continue
                assert cuda_op is not None
                rows = {
                    "threshold_sort_ms": lambda: sorted_threshold(*args),
                    "threshold_sort_free_ms": lambda: survivor_threshold(*args),
                    "sample_torch_sort_ms": lambda: sample_sorted(*args, *rng),
                    "sample_torch_sort_free_ms": lambda: sample(*args, *rng),
                    "sample_tilelang_ms": lambda: cuda_op(*args, *rng),
                }
                for metric, fn in rows.items():
                    emit("sampling", prm, metric, cuda_ms(fn), "ms")
                emit(
                    "sampling", prm, "sample_tilelang_graph_ms", graph_ms(lambda: cuda_op(*args, *rng)), "ms"
                )
                emit(
                    "sampling",
                    prm,
                    "threshold_sort_free_graph_ms",
                    graph_ms(lambda: survivor_threshold(*args)),
                    "ms",
                )
            log(f"sampling: {kind} B={b} done")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1: stable side-by-side ratios)"
    )
    ap.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    ap.add_argument("--logits", default="gauss,peaked", help="comma-separated logits kinds: gauss, peaked")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per path (CPU; median)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    batches = [1, 4] if args.quick else [int(x) for x in args.batches.split(",")]
    vocab = 4096 if args.quick else VOCAB
    run(args.device, batches, args.logits.split(","), 1 if args.quick else args.repeat, vocab)


if __name__ == "__main__":
    main()
