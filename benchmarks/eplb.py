"""EPLB benchmark: the four figures of issue #5, one JSON line each (see docs/eplb.md for the trace model).

1. In-sample balance (max / mean GPU load) on Zipf loads, 384 experts, 448 slots, EP64, skew 0.6 and 1.0:
   plain 6-per-GPU placement, the public greedy (loop-per-layer oracle from the tests), ours.
2. Out-of-sample moe_lb on the drifting synthetic trace, prefill (EP4/DP4, 100-step window, re-plan every
   1,000, 4 redundant per GPU) and decode (EP64, 1,000-step window, re-plan every 10,000, 1 redundant).
3. Plan time for 61 layers x 384 experts x 448 slots: ours vs the straightforward implementation, side by side.
4. Moved bytes per re-plan, from scratch vs migration-aware (balance within 1%), V4.1-Flash expert size.

Usage: python benchmarks/eplb.py [--quick] [--plot]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from _common import emit, log, out_path, parser, time_it
from deepinfer_core.eplb import DECODE, PREFILL, ExpertPlacement, rebalance_experts
from deepinfer_core.eplb.migration import replan_with_migration
from deepinfer_core.eplb.simulate import DECODE_TRACE, PREFILL_TRACE, DriftingTrace, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "deepinfer_core" / "eplb"))
from reference_greedy import gpu_balance, reference_rebalance

BENCH = "eplb"
# V4.1 Flash routed expert: gate, up, down of 5120 x 2304, MXFP4 (4-bit values + one e8m0 scale per 32).
EXPERT_BYTES = 3 * 5120 * 2304 * 17 // 32


def zipf_loads(rng: np.random.Generator, layers: int, experts: int, skew: float) -> np.ndarray:
    """Zipf(skew) loads over a random permutation of the experts, one per layer."""
    return (1.0 / np.arange(1, experts + 1) ** skew)[np.argsort(rng.random((layers, experts)), axis=1)]


def in_sample(quick: bool) -> None:
    layers = 4 if quick else 32
    rng = np.random.default_rng(0)
    for skew, seed_plain, seed_policy in [(0.6, 3.58, 1.004), (1.0, 10.50, 1.009)]:
        w = zipf_loads(rng, layers, 384, skew)
        plain = w.reshape(layers, 64, 6).sum(axis=2)
        p = {"experts": 384, "slots": 448, "gpus": 64, "skew": skew, "layers": layers}
        emit(
            BENCH,
            {**p, "placement": "plain 6 per GPU", "seed_figure": seed_plain},
            "balance_max_over_mean",
            float((plain.max(axis=1) / plain.mean(axis=1)).mean()),
            "ratio",
        )
        rp, rc = reference_rebalance(w, 448, 1, 1, 64)
        emit(
            BENCH,
            {**p, "placement": "public greedy", "seed_figure": seed_policy},
            "balance_max_over_mean",
            float(gpu_balance(w, rp, rc, 64).mean()),
            "ratio",
        )
        phy2log, _, logcnt = rebalance_experts(w, 448, 1, 1, 64)
        emit(
            BENCH,
            {**p, "placement": "ours (greedy + swaps)", "seed_figure": seed_policy},
            "balance_max_over_mean",
            float(gpu_balance(w, phy2log, logcnt, 64).mean()),
            "ratio",
        )


def cpu_time_it(fn: Callable[[], Any], repeat: int) -> float:
    """Median CPU seconds of this process per call: less distorted than wall time on a shared machine."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples)


def plan_time(quick: bool) -> None:
    layers = 8 if quick else 61
    rng = np.random.default_rng(1)
    w = rng.poisson(1e4 * zipf_loads(rng, layers, 384, 0.8)).astype(np.float64)
    repeat = 3 if quick else 7
    p = {"layers": layers, "experts": 384, "slots": 448, "gpus": 64, "groups": 8, "nodes": 1}
    impls = [
        ("straightforward loop per layer (test oracle)", lambda: reference_rebalance(w, 448, 8, 1, 64)),
        ("ours, greedy only (refine_passes=0)", lambda: rebalance_experts(w, 448, 8, 1, 64, refine_passes=0)),
        ("ours, greedy + 12 swap passes", lambda: rebalance_experts(w, 448, 8, 1, 64)),
    ]
    wall, cpu = {}, {}
    # Interleaved, so the machine's load drifts over all three alike.
    for _ in range(2):
        for name, fn in impls:
            reps = 1 if "straightforward" in name else repeat
            wall.setdefault(name, []).append(time_it(fn, repeat=reps, warmup=0))
            cpu.setdefault(name, []).append(cpu_time_it(fn, repeat=reps))
    for name, _ in impls:
        emit(BENCH, {**p, "impl": name}, "plan_time_wall", min(wall[name]) * 1e3, "ms")
        emit(BENCH, {**p, "impl": name}, "plan_time_cpu", min(cpu[name]) * 1e3, "ms")
    ref, ours = impls[0][0], impls[2][0]
    emit(BENCH, p, "speedup_vs_straightforward_wall", min(wall[ref]) / min(wall[ours]), "x")
    emit(BENCH, p, "speedup_vs_straightforward_cpu", min(cpu[ref]) / min(cpu[ours]), "x")
    # Prefill shape: EP4, 400 slots.
    tp = cpu_time_it(lambda: rebalance_experts(w, 400, 1, 1, 4), repeat=repeat)
    emit(BENCH, {**p, "slots": 400, "gpus": 4, "groups": 1, "impl": "ours"}, "plan_time_cpu", tp * 1e3, "ms")


def online(quick: bool, plot: bool) -> None:
    cases = []
    if quick:
        layers, scale = 2, 10
        cases.append(("prefill", attrs.evolve(PREFILL_TRACE, num_layers=layers), PREFILL, 4, 2_100))
        dec = attrs.evolve(
            DECODE, window_steps=DECODE.window_steps // scale, replan_interval=DECODE.replan_interval // scale
        )
        cases.append(("decode", attrs.evolve(DECODE_TRACE, num_layers=layers), dec, 64, 2_100))
    else:
        cases.append(("prefill", PREFILL_TRACE, PREFILL, 4, 10_100))
        cases.append(("decode", DECODE_TRACE, DECODE, 64, 21_000))
        # Sensitivity: the traffic mix drifting 6x faster (5 minutes), and not at all (routing noise only).
        fast = attrs.evolve(DECODE_TRACE, drift_steps=DECODE_TRACE.drift_steps / 6)
        cases.append(("decode, fast drift (5 min)", fast, DECODE, 64, 21_000))
        cases.append(
            ("decode, no drift (noise floor)", attrs.evolve(DECODE_TRACE, drift_sd=0.0), DECODE, 64, 11_000)
        )
    production = {"prefill": 1.074, "decode": 1.090}
    results = []
    for name, tc, cfg, gpus, steps in cases:
        log(f"simulating {name}: {steps} steps, {tc.num_layers} layers, EP{gpus}")
        r = simulate(DriftingTrace(tc, seed=7), cfg, gpus, steps, expert_bytes=EXPERT_BYTES, progress=True)
        results.append((name, cfg, r))
        p = {
            "phase": name,
            "gpus": gpus,
            "layers": tc.num_layers,
            "window": cfg.window_steps,
            "replan_every": cfg.replan_interval,
            "redundant_per_gpu": cfg.redundant_per_gpu,
            "steps_scored": int(r.steps.size),
            "production_figure": production.get(name.split(",")[0]),
        }
        emit(
            BENCH,
            {**p, "placement": "from scratch"},
            "moe_lb_per_step_mean",
            float(r.moe_lb_scratch.mean()),
            "ratio",
        )
        emit(
            BENCH,
            {**p, "placement": "migration-aware"},
            "moe_lb_per_step_mean",
            float(r.moe_lb_migration.mean()),
            "ratio",
        )
        emit(
            BENCH,
            {**p, "placement": "plain, no redundancy"},
            "moe_lb_per_step_mean",
            float(r.moe_lb_plain.mean()),
            "ratio",
        )
        for i, step in enumerate(r.replan_steps):
            q = {**p, "replan_at_step": step, "expert_bytes": EXPERT_BYTES}
            emit(
                BENCH,
                {**q, "plan": "from scratch", "in_sample_balance": r.balance_scratch[i]},
                "moved_bytes_per_replan",
                r.moved_bytes_scratch[i] / 1e9,
                "GB",
            )
            emit(
                BENCH,
                {**q, "plan": "migration-aware (tolerance 1%)", "in_sample_balance": r.balance_migration[i]},
                "moved_bytes_per_replan",
                r.moved_bytes_migration[i] / 1e9,
                "GB",
            )
    tolerance_sweep(results)
    if plot:
        _plot(results)


def tolerance_sweep(results: list) -> None:
    """Moved bytes vs balance tolerance, re-planning between consecutive windows of each simulation."""
    for name, cfg, r in results:
        if len(r.window_loads) < 2 or "," in name:  # the main prefill and decode runs only
            continue
        gpus = 4 if name == "prefill" else 64
        reps = cfg.num_replicas(r.window_loads[0].shape[1], gpus)
        old = ExpertPlacement.plan(r.window_loads[0], reps, 1, 1, gpus)
        for tol in (0.0, 0.001, 0.005, 0.01, 0.02):
            m = replan_with_migration(old, r.window_loads[1], tolerance=tol, expert_bytes=EXPERT_BYTES)
            p = {
                "phase": name,
                "gpus": gpus,
                "layers": old.num_layers,
                "tolerance": tol,
                "scratch_GB": m.scratch_moves.moved_bytes / 1e9,
                "balance": float(m.balance.mean()),
                "scratch_balance": float(m.scratch_balance.mean()),
            }
            emit(BENCH, p, "migration_moved_bytes", m.moves.moved_bytes / 1e9, "GB")


def _plot(results: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)), squeeze=False)
    for ax, (name, _cfg, r) in zip(axes[:, 0], results):
        k = 50
        for series, label in [(r.moe_lb_scratch, "from scratch"), (r.moe_lb_migration, "migration-aware")]:
            smooth = np.convolve(series, np.ones(k) / k, mode="valid")
            ax.plot(r.steps[k - 1 :], smooth, label=f"{label} ({k}-step mean)", lw=1)
        for s in r.replan_steps:
            ax.axvline(s, color="grey", lw=0.5, ls="--")
        ax.set_title(f"{name}: moe_lb per step (plain placement mean {r.moe_lb_plain.mean():.2f})")
        ax.set_xlabel("step")
        ax.set_ylabel("slowest rank / mean")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = out_path("eplb_moe_lb.png")
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    in_sample(args.quick)
    plan_time(args.quick)
    online(args.quick, args.plot)


if __name__ == "__main__":
    main()
