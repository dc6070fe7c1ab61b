"""The C++ step scheduler on a synthetic serving workload, with its CPU cost per step.

    python examples/scheduler_workload.py [--requests 400] [--blocks 2000] [--sync] [--quick]

Requests arrive over time (Poisson), with prompt and output lengths drawn from a skewed distribution; a
stand-in model (next token = a hash of the request and position; it never emits EOS) replaces the GPU,
so what runs is the real planner: admission, chunked prefill under the fitted step-time budget, KV block
reservation on a ``PagedKVPool``, preemption when the pool runs out, stop checks. By default the
scheduler runs one step ahead (``async_mode``: step N+1 is planned before step N's tokens are applied),
as an engine that overlaps CPU planning with GPU execution does. Printed: step counts by type, batch
sizes, preemptions, and the CPU time of ``schedule()`` + ``update()`` per step.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, deque

import numpy as np

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import CostModel, Plan, Request, Scheduler, SchedulerConfig, StepType

EOS = 0


def stand_in_model(plan: Plan) -> np.ndarray:
    """One sampled token per scheduled row, deterministic in (request, position), never EOS."""
    rid_hash = np.array([sum(r.encode()) for r in plan.request_ids], dtype=np.int64)
    x = (rid_hash * 1_000_003 + plan.context_lens.astype(np.int64) * 7_919) & 0xFFFFFFFF
    return (1 + (x * 2_654_435_761 >> 7) % 255).astype(np.int32)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=2000, help="KV pool size in blocks of 16 tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--arrivals-per-step", type=float, default=2.0, help="mean new requests per step")
    ap.add_argument("--sync", action="store_true", help="plan synchronously (default: one step ahead)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="60 requests (CI)")
    args = ap.parse_args(argv)
    n_req = 60 if args.quick else args.requests
    rng = np.random.default_rng(args.seed)

    pool = PagedKVPool(num_blocks=args.blocks, block_size=16)
    cfg = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=8192,
        eos_token_id=EOS,
        time_budget_ns=20e6,
        async_mode=not args.sync,
    )
    # A prefill cost model: ~1 ms fixed + 60 ns per token + attention terms (what CostModel.fit would give).
    sched = Scheduler(
        pool, cfg, cost_model=CostModel(base_ns=1e6, token_ns=60.0, quad_ns=1.5e-3, ctx_ns=4e-3)
    )
    prompt_lens = np.clip(rng.lognormal(5.5, 1.0, n_req), 8, 4000).astype(int)
    out_lens = np.clip(rng.lognormal(4.0, 0.8, n_req), 4, 1000).astype(int)
    arrivals = np.cumsum(rng.exponential(1.0 / args.arrivals_per_step, n_req)).astype(int)

    steps: Counter[StepType] = Counter()
    rows, cpu = [], []
    inflight: deque = deque()
    finished = []
    added, step = 0, 0
    while added < n_req or sched.has_unfinished() or inflight:
        while added < n_req and arrivals[added] <= step:
            prompt = rng.integers(1, 256, prompt_lens[added]).tolist()
            sched.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=int(out_lens[added]))))
            added += 1
        t0 = time.process_time()
        if sched.num_live:
            plan = sched.schedule()
            steps[plan.step_type] += 1
            rows.append(plan.num_rows)
            inflight.append((plan, stand_in_model(plan)))
        # one step ahead: apply step N's tokens after planning step N+1 (synchronous: right away)
        while inflight and (args.sync or len(inflight) > 1 or not sched.num_live):
            finished += sched.update(*inflight.popleft())
        cpu.append(time.process_time() - t0)
        step += 1

    exact = all(len(f.output_token_ids) == out_lens[int(f.request_id[1:])] for f in finished)
    res = {
        "steps": float(step),
        "prefill_steps": float(steps[StepType.PREFILL]),
        "decode_steps": float(steps[StepType.DECODE]),
        "preemptions": float(sched.num_preemptions),
        "us_per_step": 1e6 * float(np.median(cpu)),
    }
    print(
        f"{n_req} requests (prompts {int(np.median(prompt_lens))} tokens median, outputs "
        f"{int(np.median(out_lens))}), {args.blocks} blocks x 16 tokens, "
        f"{'synchronous' if args.sync else 'one step ahead'}"
    )
    print(
        f"  {step} steps: {steps[StepType.PREFILL]} prefill, {steps[StepType.DECODE]} decode; rows per step "
        f"median {int(np.median(rows))}, max {max(rows)}; {sched.num_preemptions} preemptions"
    )
    print(
        f"  all {len(finished)} requests finished with exactly their max_tokens: {exact and len(finished) == n_req}; "
        f"free blocks {pool.num_free_blocks}/{args.blocks - 1}"
    )
    print(f"  schedule() + update(): {res['us_per_step']:.0f} us of CPU per step (median; this machine)")
    return res


if __name__ == "__main__":
    main()
