"""EPLB on a drifting load: plan once and keep it, or re-plan online (migration-aware), vs no replicas.

    python examples/eplb_drifting_load.py [--steps 6000] [--gpus 64] [--plot eplb_drift.png] [--quick]

A synthetic decode trace (8 MoE layers x 384 experts, Zipf-skewed topics whose mix drifts, Poisson
routing noise) feeds three placements step by step. Each step is scored by ``moe_lb``: the busiest GPU's
load over the mean GPU load, summed over layers (1.0 = perfectly balanced). ``OnlineBalancer`` is the
loop an engine drives: it records each step's routed counts and, every ``--replan`` steps, returns a new
placement plus the expert moves that realise it, keeping experts in place where that costs < 1 % balance.
With ``--plot`` (needs the plot extra) the per-step moe_lb curves are drawn.
"""

from __future__ import annotations

import argparse

import numpy as np

from deepinfer_core.eplb import EPLBConfig, ExpertPlacement, OnlineBalancer, moe_lb
from deepinfer_core.eplb.simulate import DriftingTrace, TraceConfig

# A V4.1-Flash routed expert in MXFP4: 3 x 5120 x 2304 weights at 4.25 bits.
EXPERT_BYTES = 3 * 5120 * 2304 * 17 // 32


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--window", type=int, default=300, help="statistics window (steps)")
    ap.add_argument("--replan", type=int, default=1000, help="steps between re-plans")
    ap.add_argument(
        "--drift", type=float, default=3000.0, help="steps over which the topic mix drifts by ~1 sd"
    )
    ap.add_argument("--plot", metavar="PNG", help="write the moe_lb curves here (needs matplotlib)")
    ap.add_argument("--quick", action="store_true", help="1,500 steps (CI)")
    args = ap.parse_args(argv)
    if args.plot:  # before the run: a missing matplotlib is said up front, in one line
        from deepinfer_core.extras import MissingExtraError, require

        try:
            require("matplotlib.pyplot", "--plot")
        except MissingExtraError as e:
            ap.exit(1, f"{ap.prog}: error: {e}\n")
    steps = 1500 if args.quick else args.steps
    if steps <= args.window:
        ap.error(f"--steps ({steps}) must exceed --window ({args.window})")

    tc = TraceConfig(requests_per_step=args.gpus * 60, tokens_per_request=4, drift_steps=args.drift)
    trace = DriftingTrace(tc, seed=1)
    cfg = EPLBConfig(window_steps=args.window, replan_interval=args.replan, redundant_per_gpu=1)
    online = OnlineBalancer(tc.num_layers, tc.num_experts, args.gpus, cfg, expert_bytes=EXPERT_BYTES)
    reps = cfg.num_replicas(tc.num_experts, args.gpus)
    plain = ExpertPlacement.from_phy2log(
        np.broadcast_to(np.arange(tc.num_experts), (tc.num_layers, tc.num_experts)), tc.num_experts, args.gpus
    )
    static: ExpertPlacement | None = None  # planned once, when the window first fills, then kept
    lb: dict[str, list[float]] = {"plain (no replicas)": [], "planned once": [], "re-planned online": []}
    moved = []
    for step in range(steps):
        counts = trace.step()  # routed tokens [layers, experts] this step
        if static is not None:  # score with the placements in force during this step
            lb["plain (no replicas)"].append(moe_lb(counts, plain))
            lb["planned once"].append(moe_lb(counts, static))
            lb["re-planned online"].append(moe_lb(counts, online.placement))
        plan = online.record(counts)
        if plan is not None:
            moved.append((step + 1, len(plan.moves), plan.moves.moved_bytes, plan.scratch_moves.moved_bytes))
        if static is None and step + 1 == args.window:
            static = ExpertPlacement.plan(online.window.load(), reps, 1, 1, args.gpus)

    print(
        f"{tc.num_layers} layers x {tc.num_experts} experts on {args.gpus} GPUs ({reps} slots), {steps} steps, "
        f"window {args.window}, re-plan every {args.replan}"
    )
    means = {k: float(np.mean(v)) for k, v in lb.items()}
    for k, v in lb.items():
        tail = float(np.mean(v[-len(v) // 4 :]))
        print(f"  {k:20s} moe_lb mean {means[k]:.3f}, last quarter {tail:.3f}")
    for i, (s, n, b, sb) in enumerate(moved):
        what = "first plan (from the uniform start)" if i == 0 else "re-plan"
        print(
            f"  {what} at step {s}: {n} expert copies moved ({b / 1e9:.2f} GB; from scratch {sb / 1e9:.2f} GB)"
        )

    if args.plot:
        from deepinfer_core.extras import require

        plt = require("matplotlib.pyplot", "--plot")
        fig, ax = plt.subplots(figsize=(8, 4))
        x = np.arange(args.window, args.window + len(lb["planned once"]))
        k = 50  # moving average over 50 steps, so the drift shows through the routing noise
        for name, v in lb.items():
            if name.startswith("plain"):
                continue
            ax.plot(x[k - 1 :], np.convolve(v, np.ones(k) / k, mode="valid"), label=name)
        for s, *_ in moved:
            ax.axvline(s, color="grey", lw=0.5, ls=":")
        ax.set_xlabel("step")
        ax.set_ylabel("moe_lb (busiest GPU / mean), 50-step mean")
        ax.set_title(
            f"EPLB on a drifting load, EP{args.gpus} (plain, no replicas: {means['plain (no replicas)']:.2f})"
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return means


if __name__ == "__main__":
    main()
