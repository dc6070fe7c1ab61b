"""GPU sweep of the TileLang grouped expert GEMM (``moe_grouped_gemm``) over its launch configurations, at
the wide config's B = 64 decode shapes, against ``torch._grouped_mm`` and the copy bandwidth of the same run.

Shapes (``SWEEP_SHAPES``; 13 calls a wide decode step): gate / up packed (E = 9, N = 4608, K = 5120) x 6,
down (9, 5120, 2304) x 6, each over 448 rows (64 tokens x top-6 of the 8 routed experts, a token's experts
distinct: at most 64 rows an expert, then the shared expert's group of the 64 tokens: ``moe.FUSE_SHARED``),
and the LM head (1, 129280, 5120) x 1 over 64 rows. ``--shapes`` E:N:K with E > 1 is likewise E - 1 routed
experts and the shared group (``--no-shared``: E routed experts, the layout before 2026-12-04).

Phases: (1) every candidate config (``ops/grouped_gemm.CANDIDATES``) of every shape compiled, ``--workers``
at a time, before anything is timed; (2) the ceilings (copy bandwidth, bytes read + written, and a read
stream); (3) per shape and config: the output against ``torch._grouped_mm`` (relative error; 16 extra rows
past the last expert's end must come back 0), then the time a call when ``--calls`` calls (weights
alternating between two copies: the weights, > 180 MB a copy, are not what the 60 MB L2 holds) are
replayed from one CUDA graph, median of ``--reps`` replays; GB/s of weight bytes and % of the copy
bandwidth. The torch baseline, and the output fill the kernel no longer needs, are timed the same way.

    python benchmarks/grouped_gemm.py [--quick] [--configs NAME,...] [--budget-s 220]

Last line: ``grouped_gemm_table``, the best config per shape as the literal ``ops/grouped_gemm.CONFIGS``
takes, and the per-step estimate (6 gate / up + 6 down + 1 head) of the best against the default.
"""

# The timing lambdas capture loop variables on purpose: each is called only within its own iteration.
# ruff: noqa: B023

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, parser
from deepinfer_kernels import get_op
from deepinfer_kernels.ops.grouped_gemm import CANDIDATES, CONFIGS, DEFAULT, SWEEP_SHAPES, GGConfig

CALLS_A_STEP = {(9, 4608, 5120): 6, (9, 5120, 2304): 6, (1, 129280, 5120): 1}
REL_TOL = 1e-2  # bf16 output of an fp32 accumulation: ~3e-3 expected


def rows_for(e: int, tokens: int = 64, top_k: int = 6, seed: int = 0, shared: bool = True) -> torch.Tensor:
    """End offsets int32 [E] of ``tokens`` tokens routed to ``top_k`` distinct experts each (E = 1: all
    rows to the one group); ``shared``: the last of the E groups is the shared expert's, every token once."""
    if e == 1:
        return torch.tensor([tokens], dtype=torch.int32)
    routed = e - 1 if shared else e
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(routed, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    ends = torch.cumsum(torch.bincount(ids, minlength=routed), 0)
    if shared:
        ends = torch.cat((ends, ends[-1:] + tokens))
    return ends.to(torch.int32)


def graph_call_time(fns: list[Callable[[], Any]], reps: int) -> float:
    """Median seconds a call when the calls ``fns`` are replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del graph
    return statistics.median(times) / len(fns)


def ceilings(reps: int) -> dict[str, float]:
    n = 1 << 30  # 1 GiB buffers: far past the L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * n / graph_call_time([lambda: dst.copy_(src)] * 4, reps)
    flat = src.view(torch.bfloat16)
    read = n / graph_call_time([lambda: flat.sum(dtype=torch.float32)] * 4, reps)
    emit("ceiling", {"bytes": n}, "d2d_copy", copy / 1e9, "GB/s")
    emit("ceiling", {"bytes": n, "kernel": "torch.sum bf16"}, "read_stream", read / 1e9, "GB/s")
    return {"copy_GBs": copy / 1e9, "read_GBs": read / 1e9}


def pick_best(results: dict[GGConfig, dict[str, float]], tol: float = REL_TOL) -> GGConfig | None:
    """The fastest config whose output passed (relative error under ``tol``, zero tail); None if none."""
    ok = {
        c: r
        for c, r in results.items()
        if r.get("rel_err", math.inf) < tol and r.get("tail_ok", 0) and "us" in r
    }
    return min(ok, key=lambda c: (ok[c]["us"], c != DEFAULT)) if ok else None


def sweep_shape(
    gg: Any,
    shape: tuple,
    cands: list[GGConfig],
    compiled: dict,
    ceil: dict[str, float],
    args: Any,
    t_start: float,
) -> tuple[GGConfig, float, float, float] | None:
    """Check and time every compiled candidate at ``shape``; (best, its us, the default's us, torch's us)."""
    e, n, k = shape
    offs = rows_for(e, shared=args.shared).cuda()
    r = int(offs[-1])
    g = torch.Generator(device="cuda").manual_seed(n + k)
    ws = [(torch.randn(e, n, k, device="cuda", generator=g) / k**0.5).bfloat16() for _ in range(2)]
    xs = torch.randn(r + 16, k, device="cuda", generator=g).bfloat16()  # 16 rows past offs[-1]
    x = xs[:r]
    nbytes = e * n * k * 2
    prm = {
        "E": e,
        "N": n,
        "K": k,
        "rows": r,
        "max_rows_an_expert": int(torch.diff(offs, prepend=offs.new_zeros(1)).max()),
    }
    try:
        want = torch._grouped_mm(x, ws[0].transpose(-2, -1), offs=offs).float()
        torch_ok = True
    except Exception as exc:  # the kernels are still checked, against the torch reference op
        log(f"torch._grouped_mm at {shape}: {type(exc).__name__}: {exc}")
        want, torch_ok = get_op("moe_grouped_gemm", "reference")(x.float(), ws[0].float(), offs), False

    def record(name: str, t: float, extra: dict[str, Any]) -> None:
        emit(name, {**prm, **extra}, "time_us", t * 1e6, "us")
        emit(name, {**prm, **extra}, "weight_bandwidth", nbytes / t / 1e9, "GB/s")
        emit(name, {**prm, **extra}, "fraction_of_copy", 100 * nbytes / t / 1e9 / ceil["copy_GBs"], "%")

    tt = math.nan
    if torch_ok:
        tt = graph_call_time(
            [
                lambda i=i: torch._grouped_mm(x, ws[i % 2].transpose(-2, -1), offs=offs)
                for i in range(args.calls)
            ],
            args.reps,
        )
        record("grouped_gemm_torch_grouped_mm", tt, {})
    tf = graph_call_time(
        [lambda: torch.zeros(r, n, dtype=torch.bfloat16, device="cuda")] * args.calls, args.reps
    )
    emit(
        "grouped_gemm_output_fill", prm, "time_us", tf * 1e6, "us"
    )  # what the kernel's own tail zeroing saves
    results: dict[GGConfig, dict[str, float]] = {}
    for c in cands:
        if isinstance(compiled.get((*shape, "bfloat16", c)), str):
            continue
        if time.perf_counter() - t_start > args.budget_s:
            log(f"budget of {args.budget_s} s spent: {c.name()} at {shape} not timed")
            continue
        res: dict[str, float] = {}
        try:
            got = gg.moe_grouped_gemm(xs, ws[0], offs, config=c)
            res["rel_err"] = ((got[:r].float() - want).norm() / want.norm()).item()
            res["tail_ok"] = float(bool((got[r:] == 0).all()))
            res["us"] = 1e6 * graph_call_time(
                [lambda i=i: gg.moe_grouped_gemm(x, ws[i % 2], offs, config=c) for i in range(args.calls)],
                args.reps,
            )
        except Exception as exc:  # one failing config must not end the sweep
            log(f"{c.name()} at {shape}: {type(exc).__name__}: {exc}")
            res.setdefault("rel_err", math.inf)
        results[c] = res
        extra = {"config": c.name(), "rel_err": res.get("rel_err"), "tail_ok": bool(res.get("tail_ok"))}
        if "us" in res:
            record("grouped_gemm_tilelang", res["us"] / 1e6, extra)
    b = pick_best(results)
    if b is None:
        log(f"no config passed at {shape}")
        return None
    d = results.get(DEFAULT, {}).get("us", math.nan)
    emit(
        "grouped_gemm_best",
        {
            **prm,
            "config": b.name(),
            "GGConfig": repr(b),
            "default_us": d,
            "torch_us": tt * 1e6,
            "vs_default": d / results[b]["us"],
            "vs_torch": tt * 1e6 / results[b]["us"],
            "fraction_of_copy": 100 * nbytes / results[b]["us"] / 1e3 / ceil["copy_GBs"],
            "fraction_of_read_stream": 100 * nbytes / results[b]["us"] / 1e3 / ceil["read_GBs"],
        },
        "time_us",
        results[b]["us"],
        "us",
    )
    return b, results[b]["us"], d, tt * 1e6


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--configs", default="", help="comma-separated GGConfig.name()s (default: all candidates)"
    )
    ap.add_argument("--shapes", default="", help="comma-separated E:N:K (default: the three wide shapes)")
    ap.add_argument(
        "--no-shared",
        dest="shared",
        action="store_false",
        help="E > 1 shapes are E routed experts (default: E - 1 and the shared expert's group)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    ap.add_argument(
        "--calls", type=int, default=6, help="calls a graph (weights alternating between 2 copies)"
    )
    ap.add_argument("--reps", type=int, default=25, help="graph replays timed (median)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop timing new configs past this (s)")
    ap.add_argument(
        "--write",
        default="",
        help="write the measured best per shape as a tuned table (JSON; "
        "DEEPINFER_GG_CONFIGS=FILE makes the kernel use it)",
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
    if not torch.cuda.is_available():
        log("benchmarks/grouped_gemm.py: no CUDA device; nothing to measure")
        return
    from deepinfer_kernels.cuda import grouped_gemm as gg

    logging.getLogger("TileLang").setLevel(logging.WARNING)  # one line per compile otherwise, on stdout

    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",") if s] or list(SWEEP_SHAPES)
    cands = [c for c in CANDIDATES if not args.configs or c.name() in args.configs.split(",")]
    if args.quick:
        cands, args.reps, args.calls = cands[:2], 5, 2
    todo = {s: [c for c in cands if c.valid() and c.takes(s[1], s[2])] for s in shapes}
    log(
        f"device: {torch.cuda.get_device_name()}; {sum(map(len, todo.values()))} kernels to compile, {args.workers} workers"
    )
    t0 = time.perf_counter()
    compiled = gg.precompile([(*s, "bfloat16", c) for s, cs in todo.items() for c in cs], args.workers)
    for (e, n, k, _, c), v in sorted(compiled.items(), key=lambda kv: str(kv[0])):
        p = {"E": e, "N": n, "K": k, "config": c.name()}
        if isinstance(v, str):
            log(f"compile failed {p}: {v}")
            emit("grouped_gemm_compile", {**p, "error": v[-300:]}, "compile_failed", 1.0, "")
        else:
            emit("grouped_gemm_compile", p, "compile_s", round(v, 2), "s")
    emit(
        "grouped_gemm_compile_all",
        {"kernels": len(compiled), "workers": args.workers},
        "wall_s",
        round(time.perf_counter() - t0, 1),
        "s",
    )
    ceil = ceilings(args.reps)

    best: dict[tuple, GGConfig] = {}
    step = {"best_us": 0.0, "default_us": 0.0, "torch_us": 0.0}
    for shape in shapes:
        try:  # a shape that fails (a sticky CUDA error) still leaves the table line of the others
            got = sweep_shape(gg, shape, todo[shape], compiled, ceil, args, t_start)
        except Exception as exc:
            log(f"shape {shape}: {type(exc).__name__}: {exc}")
            continue
        if got is None:
            continue
        b, us, d, tt = got
        best[shape] = b
        m = CALLS_A_STEP.get(shape, 0)
        step["best_us"] += m * us
        step["default_us"] += m * d
        step["torch_us"] += m * tt
    table = {s: best.get(s, CONFIGS.get(s, DEFAULT)) for s in shapes}
    if args.write:  # only measured shapes: a shape whose sweep failed keeps the module's table
        with open(args.write, "w") as fh:
            json.dump([{"shape": list(s), "config": c._asdict()} for s, c in best.items()], fh, indent=1)
    literal = "{" + ", ".join(f"{s}: {c!r}" for s, c in table.items()) + "}"
    emit(
        "grouped_gemm_table",
        {
            "CONFIGS": literal,
            "measured": [list(s) for s in best],
            "wall_s": round(time.perf_counter() - t_start, 1),
            **{k: round(v, 1) for k, v in step.items()},
        },
        "step_us_saved_vs_default",
        round(step["default_us"] - step["best_us"], 1),
        "us",
    )


if __name__ == "__main__":
    main()
