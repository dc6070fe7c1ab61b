"""GPU benchmark of the cuda ops (TileLang) against the ceilings measured in the same run.

Ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate (8192^3 on random
data). Each kernel reports achieved GB/s (memory-bound ops: the fewest bytes it must move) or TFLOP/s
(indexer) and the fraction of the ceiling; the bitmask apply is compared with xgrammar's own CUDA kernel
and the torch reference on the same inputs. Timing: CUDA events around each call, median of many calls
after warm-up, inputs rotated among several copies so the L2 (60 MB) is not what is measured.

    python benchmarks/kernels.py [--quick] [--plot] [--json-out FILE] [--only kv,small,...] [--no-reference]
    python benchmarks/kernels.py --plot-from FILE   # the plot of a saved --json-out run, no GPU needed

Kernel variants (``cuda/kv_store.VARIANTS``, ``cuda/engram.GATHER_VARIANTS``) are timed side by side;
rows of the non-default variant carry its name as a suffix.
"""

# The timing lambdas capture loop variables on purpose: each is called only within its own iteration.
# ruff: noqa: B023

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_time, emit, log, out_path, parser
from deepinfer_kernels import get_op

ROWS: list[dict[str, Any]] = []
SKIP_REFERENCE = False  # --no-reference: skip the (slow, already recorded) torch reference timings


def graph_time(fn: Callable[[], Any], calls: int = 20, reps: int = 20) -> float:
    """Median seconds per call when ``calls`` calls are replayed from one CUDA graph (no host overhead)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, reps=reps) / calls


def rotating(make: Callable[[], Any], n: int) -> Callable[[], Any]:
    """A getter cycling over ``n`` independently made inputs (defeats the L2 cache for big inputs)."""
    items = [make() for _ in range(n)]
    state = {"i": 0}

    def get() -> Any:
        state["i"] = (state["i"] + 1) % n
        return items[state["i"]]

    return get


def record_ref(
    bench: str,
    params: dict[str, Any],
    fn: Callable[[], Any],
    reps: int,
    nbytes: float = 0.0,
    flops: float = 0.0,
    ceil: dict[str, float] | None = None,
) -> None:
    """Time a torch-reference baseline unless --no-reference."""
    if not SKIP_REFERENCE:
        record(bench, params, cuda_time(fn, reps=reps), nbytes, flops, ceil)


def record(
    bench: str,
    params: dict[str, Any],
    seconds: float,
    nbytes: float = 0.0,
    flops: float = 0.0,
    ceil: dict[str, float] | None = None,
) -> None:
    emit(bench, params, "time_us", seconds * 1e6, "us")
    row = {"bench": bench, "params": params, "us": seconds * 1e6}
    if nbytes:
        gbs = nbytes / seconds / 1e9
        emit(bench, params, "bandwidth", gbs, "GB/s")
        row["GB/s"] = gbs
        if ceil:
            row["%copy"] = 100 * gbs / ceil["copy_GBs"]
            emit(bench, params, "fraction_of_copy", row["%copy"], "%")
    if flops:
        tf = flops / seconds / 1e12
        emit(bench, params, "rate", tf, "TFLOP/s")
        row["TFLOP/s"] = tf
        if ceil:
            row["%mm"] = 100 * tf / ceil["bf16_TFLOPs"]
            emit(bench, params, "fraction_of_bf16_matmul", row["%mm"], "%")
    ROWS.append(row)


def ceilings(quick: bool) -> dict[str, float]:
    n = (1 << 28) if not quick else (1 << 26)  # bytes per buffer: 256 MiB (full) / 64 MiB (quick)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = min(
        cuda_time(lambda: dst.copy_(src), reps=30 if not quick else 5),
        graph_time(lambda: dst.copy_(src), calls=5, reps=10),
    )
    copy = 2 * n / t / 1e9  # the faster of per-call events and graph replay: the higher, stricter ceiling
    m = 8192 if not quick else 4096
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    tm = cuda_time(lambda: a @ b, reps=20 if not quick else 5)
    mm = 2 * m**3 / tm / 1e12
    emit("ceiling", {"bytes": n}, "d2d_copy", copy, "GB/s")
    emit("ceiling", {"m": m}, "bf16_matmul", mm, "TFLOP/s")
    ROWS.append({"bench": "ceiling d2d copy", "params": {"bytes": n}, "GB/s": copy})
    ROWS.append({"bench": "ceiling bf16 matmul", "params": {"m": m}, "TFLOP/s": mm})
    return {"copy_GBs": copy, "bf16_TFLOPs": mm}


def bench_bitmask(ceil: dict[str, float], quick: bool) -> None:
    cuda, ref = get_op("apply_token_bitmask", "cuda"), get_op("apply_token_bitmask", "reference")
    try:
        import xgrammar

        def xg(lg: torch.Tensor, m: torch.Tensor) -> None:
            xgrammar.apply_token_bitmask_inplace(lg, m, backend="cuda")
    except Exception as e:
        log(f"xgrammar not usable: {e}")
        xg = None
    vocab = 129_280
    words = (vocab + 31) // 32
    for rows in [1, 64] if quick else [1, 16, 64, 256, 512]:
        g = rotating(
            lambda: (
                torch.randn(rows, vocab, device="cuda"),
                torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, device="cuda"),
            ),
            8,
        )
        _, m = g()
        masked = int(
            (~get_op("apply_token_bitmask")(torch.zeros(rows, vocab, device="cuda"), m).isfinite()).sum()
        )
        nbytes = rows * vocab * 4 + rows * words * 4 + masked * 4 * 1.0  # read logits + mask, write masked
        p = {"rows": rows, "vocab": vocab, "dtype": "float32"}
        record("bitmask_tilelang", p, cuda_time(lambda: cuda(*g())), nbytes, ceil=ceil)
        if xg is not None:
            record("bitmask_xgrammar_cuda", p, cuda_time(lambda: xg(*g())), nbytes, ceil=ceil)
        record_ref("bitmask_torch_reference", p, lambda: ref(*g()), 10, nbytes, ceil=ceil)
        if rows <= 64:  # latency without host overhead: the same calls replayed from a CUDA graph
            lg1, m1 = g()
            for name, fn in (
                ("bitmask_tilelang_graph", lambda: cuda(lg1, m1)),
                ("bitmask_xgrammar_cuda_graph", lambda: xg(lg1, m1)),
            ):
                if xg is None and "xgrammar" in name:
                    continue
                try:
                    record(name, p, graph_time(fn), nbytes, ceil=ceil)
                except Exception as e:
                    log(f"{name}: graph capture failed: {e}")
    # spec rows: 64 requests x (1 + 5 drafts), every other request constrained
    rows, idx = 384, torch.cat([torch.arange(i * 6, i * 6 + 6) for i in range(0, 64, 2)]).cuda()
    g = rotating(
        lambda: (
            torch.randn(rows, vocab, device="cuda"),
            torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, device="cuda"),
        ),
        4,
    )
    nbytes = idx.numel() * (vocab * 4 + words * 4 + vocab * 2)
    p = {"rows": rows, "constrained_rows": idx.numel(), "vocab": vocab}
    record("bitmask_tilelang_spec_rows", p, cuda_time(lambda: cuda(*g(), idx)), nbytes, ceil=ceil)
    if xg is not None:
        record(
            "bitmask_xgrammar_cuda_spec_rows",
            p,
            cuda_time(
                lambda: xgrammar.apply_token_bitmask_inplace(
                    *g(), indices=idx.to(torch.int32), backend="cuda"
                )
            ),
            nbytes,
            ceil=ceil,
        )


# (variant, e2m1 codec switch) per format, timed side by side: the layouts with the default codecs, and
# the previous codec at one group a thread (division / select-chain e2m1).
STORE_CONFIGS = {
    "fp8": [("group", None), ("group2", None)],
    "fp4": [("group", False), ("group", None), ("group4", None), ("bf16x2i4", None)],
}
LOAD_CONFIGS = {
    "fp8": [("group", None), ("lanes", None)],
    "fp4": [("group", False), ("group", None), ("lanes", None), ("group2", None)],
}


def _cfg_suffix(var: str, fast: bool | None, old: str) -> str:
    return ("" if var == "group" else f"_{var}") + (f"_{old}" if fast is False else "")


def bench_kv(ceil: dict[str, float], quick: bool) -> None:
    """KV store / load: the ops end to end (with and without input checks), then each kernel configuration
    alone, replayed from a CUDA graph (no Python or launch gaps: what an engine's captured step sees)."""
    from deepinfer_kernels.cuda import kv_store as ck

    store, store_ref = get_op("kv_store", "cuda"), get_op("kv_store", "reference")
    load = get_op("kv_load", "cuda")
    sizes = [4096] if quick else [65_536, 262_144]
    for fmt, bpt in (("fp8", 528), ("fp4", 288)):
        for n in sizes:
            pool = torch.zeros(n // 64 + 1, 64, bpt, dtype=torch.uint8, device="cuda")
            flat = pool.view(-1, bpt)
            slots = torch.randperm(n, device="cuda")
            g = rotating(lambda: torch.randn(n, 512, device="cuda", dtype=torch.bfloat16), 4)
            nbytes = n * (512 * 2 + bpt)
            p = {"tokens": n, "fmt": fmt, "in": "bf16"}
            if (
                fmt == "fp8"
            ):  # the copy ceiling at this size (bytes read + written as the store's), graph replay
                half = nbytes // 2
                src, dst = (
                    torch.empty(half, dtype=torch.uint8, device="cuda"),
                    torch.empty(half, dtype=torch.uint8, device="cuda"),
                )
                record(
                    "d2d_copy_same_bytes",
                    {"bytes": 2 * half},
                    graph_time(lambda: dst.copy_(src)),
                    2 * half,
                    ceil=ceil,
                )
                del src, dst
            if n == sizes[0]:
                record(
                    f"kv_store_{fmt}", p, cuda_time(lambda: store(pool, g(), slots, fmt)), nbytes, ceil=ceil
                )
                record(
                    f"kv_store_{fmt}_unchecked",
                    p,
                    cuda_time(lambda: store(pool, g(), slots, fmt, check=False)),
                    nbytes,
                    ceil=ceil,
                )
                record_ref(
                    f"kv_store_{fmt}_torch_reference",
                    p,
                    lambda: store_ref(pool, g(), slots, fmt),
                    5,
                    nbytes,
                    ceil=ceil,
                )
            for var, fast in STORE_CONFIGS[fmt]:
                sfx = _cfg_suffix(var, fast, "division_codec")
                try:  # one failing configuration must not end the run
                    t = graph_time(lambda: ck.store_slots(flat, g(), slots, fmt, variant=var, fast_e2m1=fast))
                except Exception as e:
                    log(f"kv_store_{fmt}{sfx}: failed: {e!r}")
                    continue
                record(f"kv_store_{fmt}_kernel_graph{sfx}", p, t, nbytes, ceil=ceil)
            # prefill-like: the tokens go to consecutive slots (rows above are decode-like, a random slot each)
            seq = torch.arange(n, device="cuda")
            for var, fast in STORE_CONFIGS[fmt][-2:]:
                sfx = _cfg_suffix(var, fast, "division_codec")
                t = graph_time(lambda: ck.store_slots(flat, g(), seq, fmt, variant=var, fast_e2m1=fast))
                record(f"kv_store_{fmt}_kernel_graph_consecutive_slots{sfx}", p, t, nbytes, ceil=ceil)
            m = n // (64 * 64)  # 64 sequences of m blocks of 64 tokens: n tokens in all
            table = torch.randint(1, pool.shape[0], (64, m), dtype=torch.int32, device="cuda")
            lens = torch.full((64,), m * 64, device="cuda")
            nbytes = n * (bpt + 512 * 2)
            pl = {"seqs": 64, "tokens_each": m * 64, "fmt": fmt, "out": "bf16"}
            if n == sizes[0]:
                record(
                    f"kv_load_{fmt}",
                    pl,
                    cuda_time(lambda: load(pool, table, lens, fmt, 512, torch.bfloat16)),
                    nbytes,
                    ceil=ceil,
                )
                record(
                    f"kv_load_{fmt}_unchecked",
                    pl,
                    cuda_time(lambda: load(pool, table, lens, fmt, 512, torch.bfloat16, check=False)),
                    nbytes,
                    ceil=ceil,
                )
            # the slots kv_load derives from the block table (random blocks, 64 consecutive tokens each)
            tk = torch.arange(m * 64, device="cuda")
            sl = (table.long()[:, tk // 64] * 64 + tk % 64).reshape(-1)
            for var, fast in LOAD_CONFIGS[fmt]:
                sfx = _cfg_suffix(var, fast, "select_codec")
                t = graph_time(
                    lambda: ck.gather_slots(flat, sl, fmt, 512, torch.bfloat16, variant=var, fast_e2m1=fast)
                )
                record(f"kv_load_{fmt}_kernel_graph{sfx}", pl, t, nbytes, ceil=ceil)


def bench_sampling(ceil: dict[str, float], quick: bool) -> None:
    from deepinfer_kernels.cuda import sampling as cs

    cuda, ref = get_op("sample", "cuda"), get_op("sample", "reference")
    vocab = 129_280
    for b in [8] if quick else [1, 64, 256]:
        args = [
            torch.randn(b, vocab, device="cuda"),
            torch.full((b,), 0.8, device="cuda"),
            torch.full((b,), 50, device="cuda"),
            torch.full((b,), 0.9, device="cuda"),
            torch.arange(b, device="cuda"),
            torch.arange(b, device="cuda"),
        ]
        p = {"batch": b, "vocab": vocab}
        record(
            "sample_end_to_end_tilelang", p, cuda_time(lambda: cuda(*args), reps=20), b * vocab * 4, ceil=ceil
        )
        record_ref("sample_torch_reference", p, lambda: ref(*args), 10, b * vocab * 4, ceil=ceil)
        # the fused kernel alone (RNG + Gumbel + filter + argmax), given the threshold
        t, tv, ti, mode = cs.survivor_threshold(args[0], args[1], args[2], args[3])
        keys = cs.row_keys(args[4], args[5])
        kern = cs.compile_kernel(("sample", vocab, "float32"), lambda: cs._build(vocab, "float32"))
        out = torch.empty(b, dtype=torch.int64, device="cuda")
        record(
            "sample_fused_kernel_only",
            p,
            cuda_time(lambda: kern(args[0], t, keys, tv, ti, mode, out)),
            b * vocab * 4,
            ceil=ceil,
        )


def bench_small(ceil: dict[str, float], quick: bool) -> None:
    red, red_ref = get_op("mtp_redistribute", "cuda"), get_op("mtp_redistribute", "reference")
    for r in [64] if quick else [64, 256, 1024]:
        conf = torch.rand(r, 5, device="cuda")
        total = torch.tensor(r * 2, device="cuda")
        record("mtp_redistribute_tilelang", {"requests": r, "drafts": 5}, cuda_time(lambda: red(total, conf)))
        record_ref(
            "mtp_redistribute_torch_reference", {"requests": r, "drafts": 5}, lambda: red_ref(total, conf), 10
        )
    h_ref = get_op("engram_hash", "reference")
    from deepinfer_kernels.cuda import engram as ce

    t = 8192 if quick else 262_144
    ids = torch.randint(0, 129_280, (t, 4), device="cuda", dtype=torch.int32)
    mult = torch.randint(1, 2**62, (2, 4), device="cuda") | 1
    sizes = torch.randint(1_000_000, 50_000_000, (2, 3, 8), device="cuda", dtype=torch.int32)
    offs = torch.zeros(2, 24, dtype=torch.int32, device="cuda")
    nbytes = t * 4 * 4 + 2 * t * 24 * 4
    record(
        "engram_hash_tilelang",
        {"tokens": t, "layers": 2, "orders": "2-4", "heads": 8},
        cuda_time(lambda: ce.engram_hash_tilelang(ids, mult, sizes, offs)),
        nbytes,
        ceil=ceil,
    )
    if ce._HAVE_TILE_KERNELS:
        record(
            "engram_hash_tile_kernels",
            {"tokens": t, "layers": 2, "orders": "2-4", "heads": 8},
            cuda_time(lambda: ce.engram_hash_tile_kernels(ids, mult, sizes, offs)),
            nbytes,
            ceil=ceil,
        )
    record_ref(
        "engram_hash_torch_reference",
        {"tokens": t},
        lambda: h_ref(ids, mult, sizes, offs),
        10,
        nbytes,
        ceil=ceil,
    )
    gat = get_op("engram_gather", "cuda")
    rows = 1 << 20 if quick else 1 << 23
    table = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    n = 16384 if quick else 262_144
    g = rotating(lambda: torch.randint(0, rows, (n,), device="cuda"), 4)
    pg = {"rows": n, "dim": 256, "table_rows": rows}
    record("engram_gather_bf16", pg, cuda_time(lambda: gat(table, g())), n * 256 * 2 * 2, ceil=ceil)
    out = torch.empty(n, 256, device="cuda", dtype=torch.bfloat16)
    no_sc = torch.empty(rows, 1, dtype=torch.uint8, device="cuda")
    for var in ce.GATHER_VARIANTS:  # kernel only (no id range check, which costs a host sync)
        record(
            f"engram_gather_bf16_kernel_only_{var}",
            pg,
            cuda_time(lambda: ce.gather_rows(table, no_sc, g(), out, 0, var)),
            n * 256 * 2 * 2,
            ceil=ceil,
        )
    # indexer: T queries x S keys, 32 heads x 128 dims (V4.1), full (non-causal) range
    sc = get_op("indexer_scores", "cuda")
    tq, s = (256, 4096) if quick else (2048, 16384)
    q = torch.randn(tq, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(s, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tq, 32, device="cuda")
    ks, ke = (
        torch.zeros(tq, dtype=torch.int32, device="cuda"),
        torch.full((tq,), s, dtype=torch.int32, device="cuda"),
    )
    record(
        "indexer_scores_tilelang",
        {"queries": tq, "keys": s, "heads": 32, "dim": 128},
        cuda_time(lambda: sc(q, w, k, ks, ke), reps=20),
        flops=2 * tq * s * 32 * 128,
        ceil=ceil,
    )
    record_ref(
        "indexer_scores_torch_reference",
        {"queries": tq, "keys": s, "heads": 32, "dim": 128},
        lambda: get_op("indexer_scores")(q, w, k, ks, ke),
        5,
        flops=2 * tq * s * 32 * 128,
        ceil=ceil,
    )


def bench_spec(ceil: dict[str, float], quick: bool) -> None:
    """Counter-mode acceptance step: the kernel against the torch reference on the same inputs."""
    cuda, ref = get_op("spec_verify", "cuda"), get_op("spec_verify", "reference")
    vocab, d = 129_280, 5
    for r in [16] if quick else [1, 64, 256]:
        p = torch.softmax(torch.randn(r, d + 1, vocab, device="cuda"), -1)
        q = torch.softmax(torch.randn(r, d, vocab, device="cuda"), -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1).view(r, d)
        lens = torch.full((r,), d, device="cuda")
        seeds, pos = torch.arange(r, device="cuda"), torch.full((r,), 100, device="cuda")
        prm = {"requests": r, "drafts": d, "vocab": vocab}
        nbytes = r * vocab * 4 * 2  # at least p and q at the emitted position
        record(
            "spec_verify_tilelang",
            prm,
            cuda_time(lambda: cuda(drafts, q, p, lens, seeds=seeds, positions=pos), reps=20),
            nbytes,
            ceil=ceil,
        )
        record_ref(
            "spec_verify_torch_reference",
            prm,
            lambda: ref(drafts, q, p, lens, seeds=seeds, positions=pos),
            10,
            nbytes,
            ceil=ceil,
        )
        g = torch.rand(r, device="cuda") < 2  # all greedy: an argmax per draft position
        record(
            "spec_verify_tilelang_greedy",
            prm,
            cuda_time(lambda: cuda(drafts, q, p, lens, None, g, seeds=seeds, positions=pos), reps=20),
            r * vocab * 4 * (d + 1),
            ceil=ceil,
        )


def table() -> str:
    lines = ["| bench | params | us | GB/s | % copy | TFLOP/s | % bf16 mm |", "|---|---|---|---|---|---|---|"]
    for r in ROWS:

        def f(k: str, r: dict[str, Any] = r) -> str:
            return f"{r[k]:.1f}" if k in r else ""

        lines.append(
            f"| {r['bench']} | {json.dumps(r['params'])} | {f('us')} | {f('GB/s')} | {f('%copy')} | {f('TFLOP/s')} | {f('%mm')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--json-out", help="also write every row as JSON to this file")
    ap.add_argument("--only", default="", help="comma-separated groups: bitmask,kv,sampling,small,spec")
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference timings (slow)")
    ap.add_argument("--plot-from", help="plot the rows of a saved --json-out file and exit (no GPU needed)")
    args = ap.parse_args()
    if args.plot_from:
        ROWS.extend(json.loads(Path(args.plot_from).read_text()))
        log(f"wrote {plot()}")
        return
    global SKIP_REFERENCE
    SKIP_REFERENCE = args.no_reference
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        log("benchmarks/kernels.py: no CUDA device; nothing to measure")
        return
    log(f"device: {torch.cuda.get_device_name()}")
    ceil = ceilings(args.quick)
    groups = {
        "bitmask": bench_bitmask,
        "kv": bench_kv,
        "sampling": bench_sampling,
        "small": bench_small,
        "spec": bench_spec,
    }
    for name, fn in groups.items():
        if args.only and name not in args.only.split(","):
            continue
        try:
            fn(ceil, args.quick)
        except Exception as e:
            logging.exception("bench group %s failed: %s", name, e)
    print(table(), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(ROWS, indent=1))
    if args.plot:
        log(f"wrote {plot()}")


def plot() -> Path:
    """Bars of % of copy bandwidth for every row that has one (kernel rows in blue, ops end to end and
    torch references in grey), with the 70 % target; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = [r for r in ROWS if "%copy" in r]
    labels = [
        f"{r['bench']} "
        + ",".join(f"{k}={v}" for k, v in r["params"].items() if k not in ("fmt", "in", "out"))
        for r in bw
    ]
    colors = ["tab:blue" if ("kernel" in r["bench"] or "copy" in r["bench"]) else "0.6" for r in bw]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(bw) + 1.2))
    ax.barh(labels, [r["%copy"] for r in bw], color=colors)
    ax.invert_yaxis()
    ax.axvline(70, color="r", ls="--", label="70 % target")
    ax.set_xlabel("% of device-to-device copy bandwidth (ceiling measured in the same run)")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(out_path("kernels.png"))
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
