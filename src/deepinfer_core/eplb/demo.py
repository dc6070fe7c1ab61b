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
        np.broadcast_to(np.arange(DECODE_TRACE.num_experts), (DECODE_TRACE.num_layers, DECODE_TRACE.num_experts)),
        DECODE_TRACE.num_experts, gpus,
    )
    load = window.load()
    print(f"EPLB demo: {DECODE_TRACE.num_layers} layers x {DECODE_TRACE.num_experts} experts -> {reps} slots "
          f"on EP{gpus} ({reps // gpus} per GPU), planned in {dt:.1f} ms")
    print(f"  in-sample moe_lb: plain 6/GPU {moe_lb(load, plain):.3f} -> planned {moe_lb(load, plan):.4f}")
    later = trace.steps(3000)  # traffic mix drifts
    print(f"  next 3,000 steps, per-step moe_lb with that plan: {np.mean([moe_lb(c, plan) for c in later[::50]]):.3f}")
    window.record_many(later[-200:])
    m = replan_with_migration(plan, window.load(), tolerance=0.01, expert_bytes=EXPERT_BYTES)
    print(f"  re-plan: from scratch moves {m.scratch_moves.moved_bytes / 1e9:.1f} GB "
          f"(balance {m.scratch_balance.mean():.4f}); migration-aware moves {m.moves.moved_bytes / 1e9:.1f} GB "
          f"(balance {m.balance.mean():.4f}, {len(m.moves)} moves)")
    print(f"  first moves (layer, expert, from GPU, to GPU): {m.moves.as_tuples()[:3]}")


if __name__ == "__main__":
    demo()
