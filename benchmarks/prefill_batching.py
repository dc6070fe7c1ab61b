"""One prefill step of R requests x T tokens through the executor's prefill paths, side by side: ``tiled``
(request by request: each layer's ring writes, compression, indexer top-k and attention once per request)
against ``varlen`` (every request of the step at once: a number of ops per layer that does not grow with R).

Per (config, shape, path), one JSON line each:

- ``prefill_torch_ops``: aten ops the step runs (torch.profiler; ops with no aten op below them, views
  excluded), and ``prefill_layer_attention_ops``: those inside the layers' attention (the executor's
  ``prefill.layer_attention`` range: the attention's projections, ring writes, compression, indexer and
  attention; outside it the MoE, norms, mHC, embeddings, LM head); on CUDA ``prefill_kernel_launches`` too;
- ``prefill_cpu_s`` (CPU: CPU seconds of this process, median of interleaved rounds) or ``prefill_ms``
  (CUDA: synchronised wall clock), and the ratios tiled / varlen of each (``*_ratio_tiled_vs_varlen``);
- ``prefill_varlen_vs_tiled_logits_rel_err``;
- CUDA only: ``prefill_pct_of_matmul_rate`` (weight-product FLOPs over the wall time, a share of the bf16
  matmul rate measured in the run), ``prefill_gemm_part_pct_of_matmul_rate`` (over the weight-GEMM
  kernels' own time) and ``prefill_gpu_split_*_pct`` (benchmarks/model_cuda.py's split);
- ``--ttft L1,L2,..``: one request of L tokens, ``ttft_ms`` = the prefill step + the first token's argmax
  read back, per path; ``--plot`` draws TTFT against the prompt length (benchmarks/out/prefill_ttft_*.png).

Configs: ``tiny`` (the test config, float32 on the CPU) and ``wide`` (the released V4.1-Flash widths cut to 6
layers, benchmarks/model.py; bf16 on CUDA). On the CPU ``wide`` also cuts the experts' width to 256 and the
vocabulary to 8,192 and drops the drafter (identical work on both paths; the full model does not fit a 24 GiB shared host)
and its default shapes are 1 x 1024 and 16 x 64 (the attention widths of 1 x 8192 cost minutes a step
on 2 cores); the CUDA run uses the full wide config at 1 x 8192 and 16 x 512.

    python benchmarks/prefill_batching.py [--configs tiny,wide] [--shapes 1x8192,16x512] [--paths tiled,varlen]
                                          [--device cpu|cuda] [--threads 1] [--rounds 3] [--ttft 512,...,16384]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from _common import emit, log, out_path, parser
from deepinfer_core.model import DeepSeekV41, ForwardBatch, ModelConfig, ModelExecutor, tiny_config
from deepinfer_core.model.prefill import LAYER_RANGE
from model import wide_config

BENCH = "prefill_batching"
BLOCK = 64
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
VIEWS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::slice", "aten::select",
    "aten::t", "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::alias",
    "aten::detach", "aten::permute", "aten::unflatten", "aten::split", "aten::split_with_sizes",
    "aten::narrow", "aten::unbind", "aten::lift_fresh", "aten::_reshape_alias", "aten::view_as",
}  # fmt: skip


def make_config(name: str, dev: torch.device) -> ModelConfig:
    if name == "tiny":
        return tiny_config()
    cfg = wide_config()
    if dev.type == "cpu":  # see the module docstring: only the MoE and the vocabulary are cut
        import attrs

        cfg = attrs.evolve(
            cfg,
            moe_intermediate_size=256,
            vocab_size=8192,
            dspark_noise_token_id=8191,
            num_nextn_predict_layers=0,
        )
    return cfg


def batch_of(cfg: ModelConfig, reqs: int, tokens: int) -> tuple[ForwardBatch, int]:
    """``reqs`` fresh requests of ``tokens`` tokens each (one logits row each) and the blocks they need."""
    per = -(-tokens // BLOCK)
    toks = np.random.default_rng(tokens).integers(0, cfg.vocab_size, reqs * tokens)
    b = ForwardBatch(
        token_ids=toks,
        query_lens=[tokens] * reqs,
        start_pos=[0] * reqs,
        block_tables=np.arange(1, 1 + reqs * per, dtype=np.int64).reshape(reqs, per),
        state_slots=list(range(reqs)),
        num_logits=[1] * reqs,
    )
    return b, reqs * per + 1


def count_ops(events: list) -> tuple[int, int]:
    """(aten ops with no aten op below them, views excluded; of those, the ones under the layer attention:
    inside the prefill ranges or an ``attend`` of the step)."""
    total = attn = 0
    stack = [(e, False) for e in events if e.cpu_parent is None and str(e.device_type).endswith("CPU")]
    while stack:
        e, inside = stack.pop()
        inside = inside or e.name == LAYER_RANGE
        kids = [c for c in e.cpu_children if c.name.startswith("aten::")]
        if e.name.startswith("aten::") and not kids and e.name not in VIEWS:
            total += 1
            attn += inside
        stack.extend((c, inside) for c in e.cpu_children)
    return total, attn


def profile_step(run: Callable[[], object], cuda: bool) -> dict[str, float]:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    ops, attn = count_ops(events)
    out = {"prefill_torch_ops": float(ops), "prefill_layer_attention_ops": float(attn)}
    if cuda:
        out["prefill_kernel_launches"] = float(sum(1 for e in events if e.name in LAUNCH))
        from model_cuda import gpu_time_split

        split = gpu_time_split(events)
        dev_us = max(sum(split.values()), 1e-9)
        out.update({f"prefill_gpu_split_{k}_pct": 100 * v / dev_us for k, v in split.items()})
        out["weight_gemm_us"] = split["weight_gemm"]
    return out


def timed(run: Callable[[], object], cuda: bool) -> float:
    """Seconds of one call: synchronised wall clock on CUDA, CPU seconds of this process on the CPU."""
    if cuda:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    t0 = time.process_time()
    run()
    return time.process_time() - t0


def bench_shape(
    model: DeepSeekV41,
    name: str,
    reqs: int,
    tokens: int,
    paths: list[str],
    rounds: int,
    rate: float | None,
    budget: int = 0,
) -> None:
    """One step of ``reqs`` x ``tokens`` per path: ops, time (interleaved rounds), ratios, agreement."""
    cfg, dev = model.cfg, next(model.parameters()).device
    cuda = dev.type == "cuda"
    backend = None
    if cuda:
        from deepinfer_kernels import get_backend

        backend = get_backend("cuda")
    b, blocks = batch_of(cfg, reqs, tokens)
    runs, logits, stats = {}, {}, {}
    for path in paths:
        ex = ModelExecutor(model, blocks, BLOCK, reqs, quantize=True, backend=backend, draft_context=False)
        ex.prefill_path = path
        ex.prefill_budget = budget or ex.prefill_budget
        runs[path] = lambda ex=ex: ex.execute(b).logits
        logits[path] = runs[path]().float()  # warm-up
        stats[path] = profile_step(runs[path], cuda)
    secs: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(rounds):
        for p in paths:
            secs[p].append(timed(runs[p], cuda))
    base = {"config": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "requests": reqs}
    base = {
        **base,
        "tokens_each": tokens,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "budget_mib": ex.prefill_budget >> 20,
    }
    med = {p: statistics.median(v) for p, v in secs.items()}
    for p in paths:
        q = {**base, "path": p}
        for k, v in stats[p].items():
            if k != "weight_gemm_us":
                emit(BENCH, q, k, v, "%" if k.endswith("_pct") else "ops")
        if cuda:
            emit(BENCH, q, "prefill_ms", med[p] * 1e3, "ms")
            if rate:
                from model_cuda import prefill_flops

                flops = (
                    prefill_flops(model, reqs * tokens) + 2 * (reqs - 1) * cfg.vocab_size * cfg.hidden_size
                )
                emit(BENCH, q, "prefill_pct_of_matmul_rate", 100 * flops / med[p] / rate, "%")
                gemm_s = max(stats[p]["weight_gemm_us"], 1e-9) / 1e6
                emit(BENCH, q, "prefill_gemm_part_pct_of_matmul_rate", 100 * flops / gemm_s / rate, "%")
        else:
            emit(BENCH, q, "prefill_cpu_s", med[p], "s")
        emit(
            BENCH,
            q,
            "prefill_tokens_per_s" if cuda else "prefill_tokens_per_cpu_s",
            reqs * tokens / med[p],
            "tok/s",
        )
    if "tiled" in paths and "varlen" in paths:
        for k in ("prefill_torch_ops", "prefill_layer_attention_ops", "prefill_kernel_launches"):
            if k in stats["varlen"]:
                r = stats["tiled"][k] / max(stats["varlen"][k], 1)
                emit(BENCH, base, f"{k}_ratio_tiled_vs_varlen", r, "x")
        emit(BENCH, base, "prefill_time_ratio_tiled_vs_varlen", med["tiled"] / med["varlen"], "x")
        d, g = logits["tiled"], logits["varlen"]
        emit(
            BENCH, base, "prefill_varlen_vs_tiled_logits_rel_err", ((g - d).norm() / d.norm()).item(), "ratio"
        )


def bench_ttft(model: DeepSeekV41, lengths: list[int], paths: list[str], plot: bool) -> None:
    """One request of L tokens: the prefill step and the first token read back, per path (CUDA)."""
    from deepinfer_kernels import get_backend

    res: dict[str, list[float]] = {p: [] for p in paths}
    for t in lengths:
        b, blocks = batch_of(model.cfg, 1, t)
        for p in paths:
            ex = ModelExecutor(
                model, blocks, BLOCK, 1, quantize=True, backend=get_backend("cuda"), draft_context=False
            )
            ex.prefill_path = p

            def first(ex: ModelExecutor = ex, b: ForwardBatch = b) -> int:
                return int(ex.execute(b).logits[-1].argmax())

            first()
            ms = statistics.median(timed(first, True) for _ in range(3)) * 1e3
            res[p].append(ms)
            emit(
                BENCH,
                {"config": "wide", "device": torch.cuda.get_device_name(), "tokens": t, "path": p},
                "ttft_ms",
                ms,
                "ms",
            )
            del ex
            torch.cuda.empty_cache()
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for p in paths:
            ax.plot(lengths, res[p], marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (one request)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"wide config prefill, {torch.cuda.get_device_name()}")
        ax.legend()
        fig.tight_layout()
        f = out_path("prefill_ttft_wide_cuda.png")
        fig.savefig(f, dpi=120)
        log(f"wrote {f}")


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--configs", default="tiny,wide")
    ap.add_argument(
        "--shapes", default="", help="RxT,... (default 1x8192,16x512; wide on the CPU 1x1024,16x64)"
    )
    ap.add_argument("--paths", default="tiled,varlen")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: shared machine)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--budget-mib", type=int, default=0, help="prefill_budget in MiB (default: the executor's, by device)"
    )
    ap.add_argument("--ttft", default="", help="CUDA: prompt lengths for the TTFT sweep, e.g. 512,2048,8192")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    paths = [p for p in args.paths.split(",") if p]
    rate = None
    if cuda:
        from model_cuda import matmul_rate

        rate = matmul_rate()
        emit(BENCH, {"device": torch.cuda.get_device_name()}, "bf16_matmul_rate", rate / 1e12, "TFLOP/s")
    names = [c for c in args.configs.split(",") if c]
    if args.quick and not cuda:  # the CI smoke run: the wide widths' 5 GB model is no smoke test
        names = [c for c in names if c != "wide"]
    for name in names:
        cfg = make_config(name, dev)
        dtype = torch.bfloat16 if (cuda and name == "wide") else torch.float32
        model = DeepSeekV41.from_config(cfg, seed=0, dtype=dtype, device=dev, init_on_device=cuda)
        shapes = args.shapes or ("1x1024,16x64" if (name == "wide" and not cuda) else "1x8192,16x512")
        if args.quick:
            shapes = "1x256,4x64"
        for shape in shapes.split(","):
            r, t = (int(x) for x in shape.split("x"))
            bench_shape(
                model, name, r, t, paths, 1 if args.quick else args.rounds, rate, args.budget_mib << 20
            )
        if cuda and args.ttft and name == "wide":
            bench_ttft(model, [int(x) for x in args.ttft.split(",")], paths, args.plot)
        del model


if __name__ == "__main__":
    main()
