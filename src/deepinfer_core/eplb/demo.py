"""A few lines showing EPLB at work: plan, drift, score, re-plan with few moves (well under 5 s)."""

from __future__ import annotations

import time

import numpy as np

from deepinfer_core.eplb import DECODE, ExpertLoadWindow, ExpertPlacement, moe_lb
from deepinfer_core.eplb.migration import replan_with_migration
from deepinfer_core.eplb.simulate import DECODE_TRACE, DriftingTrace

# V4.1 Flash routed expert in MXFP4: 3 x 5120 x 2304 weights at 4.25 bits.
EXPERT_BYTES = 3 * 5120 * 2304 * 17 // 32


def demo() -> None:
    gpus = 64
    trace = DriftingTrace(DECODE_TRACE, seed=3)  # 8 layers x 384 experts, 3,840 decode requests a step
    cfg = DECODE
    reps = cfg.num_replicas(DECODE_TRACE.num_experts, gpus)
    window = ExpertLoadWindow(DECODE_TRACE.num_layers, DECODE_TRACE.num_experts, window_steps=200)
    window.record_many(trace.steps(200))
    t0 = time.perf_counter()
    plan = ExpertPlacement.plan(window.load(), reps, 1, 1, gpus)
    dt = (time.perf_counter() - t0) * 1e3
    plain = ExpertPlacement.from_phy2log(
        np.broadcast_to(
            np.arange(DECODE_TRACE.num_experts), (DECODE_TRACE.num_layers, DECODE_TRACE.num_experts)
        ),
        DECODE_TRACE.num_experts,
        gpus,
    )
    load = window.load()
    print(
        f"  {DECODE_TRACE.num_layers} layers x {DECODE_TRACE.num_experts} experts placed on {reps} slots of "
        f"{gpus} GPUs ({reps // gpus} per GPU, so {reps - DECODE_TRACE.num_experts} slots hold replicas of hot "
        f"experts), planned from 200 steps of a synthetic skewed load in {dt:.1f} ms"
    )
    print(
        f"  balance on those 200 steps: {moe_lb(load, plain):.3f} with {DECODE_TRACE.num_experts // gpus} experts "
        f"per GPU in order, no replicas -> {moe_lb(load, plan):.4f} placed (1.0 = every GPU equally busy)"
    )
    later = trace.steps(3000)  # traffic mix drifts
    print(
        f"  the next 3,000 steps (the topic mix drifts, routing is noisy), same plan: "
        f"{np.mean([moe_lb(c, plan) for c in later[::50]]):.3f} per step on average"
    )
    window.record_many(later[-200:])
    m = replan_with_migration(plan, window.load(), tolerance=0.01, expert_bytes=EXPERT_BYTES)
    print(
        f"  re-plan on the recent load: from scratch would move {m.scratch_moves.moved_bytes / 1e9:.1f} GB of "
        f"expert weights (balance {m.scratch_balance.mean():.4f}); keeping experts in place where that costs "
        f"< 1% balance moves {m.moves.moved_bytes / 1e9:.1f} GB ({len(m.moves)} expert copies, balance "
        f"{m.balance.mean():.4f})"
    )
    print(f"  first moves (layer, expert, from GPU, to GPU): {m.moves.as_tuples()[:3]}")


if __name__ == "__main__":
    demo()
