"""Shared conventions of benchmarks/*.py: one JSON object per line on stdout, `--quick` for CI smoke runs.

Each line: {"bench": str, "params": {...}, "metric": str, "value": float, "unit": str}.
Timings use the median of repeated runs; CPU figures should be quoted as ratios measured side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"


class BenchParser(argparse.ArgumentParser):
    """The benchmarks' parser: ``--plot`` (or a script's ``--plot-from`` / ``--replot``) checks matplotlib
    when the arguments are parsed, before any measurement, and exits 1 with the one-line
    ``pip install "deepinfer-components[plot]"`` message when it is missing."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        ns, rest = super().parse_known_args(args, namespace)
        if any(getattr(ns, k, None) for k in ("plot", "plot_from", "replot")):
            from deepinfer_core.extras import MissingExtraError, require

            try:
                require("matplotlib", f"{self.prog} --plot")
            except MissingExtraError as e:
                print(f"{self.prog}: error: {e}", file=sys.stderr)
                raise SystemExit(1) from None
        return ns, rest


def parser(description: str) -> argparse.ArgumentParser:
    ap = BenchParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI smoke run)")
    ap.add_argument(
        "--plot",
        action="store_true",
        help='also write a PNG under benchmarks/out/ (needs matplotlib: the "plot" extra)',
    )
    return ap


def emit(bench: str, params: dict[str, Any], metric: str, value: float, unit: str) -> None:
    print(
        json.dumps({"bench": bench, "params": params, "metric": metric, "value": value, "unit": unit}),
        flush=True,
    )


def time_it(fn: Callable[[], Any], repeat: int = 5, number: int = 1, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` batches of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def graph_replay_ms(ex: Any, reps: int = 20) -> float:
    """The executor's most recently replayed decode graph (``ex.graphs()``, LRU order) replayed back to back
    (same inputs: its cache writes repeat the same bytes at the same slots): synchronised wall ms a replay,
    the device's own time for the step with the gaps between its kernels and no host work. NaN when no
    graph was captured. A step's ``ms_per_step`` minus this is the host's exposed share; this minus the
    kernels' own time, the gaps inside the graph. Needs CUDA (torch imported here: the CPU benchmarks never
    call it)."""
    import torch

    graphs = ex.graphs().graphs
    g = next(reversed(graphs.values()), None) if graphs else None
    if g is None or g.graph is None:
        return float("nan")
    g.graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def out_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / name


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cuda_time(fn: Callable[[], Any], reps: int = 50, warmup: int = 5) -> float:
    """Median seconds per call of ``fn`` on the current CUDA stream, by CUDA events around each call
    (after ``warmup`` calls and a synchronisation)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)
