"""Scheduler demo: fit a cost model, then serve a small burst of requests one step ahead.

A stand-in model (next token = a hash of request, position and previous token) replaces the GPU so the
demo runs anywhere in well under a second; the scheduling is the real C++ planner.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from deepinfer_core.display import printable
from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import CostModel, Plan, Request, Scheduler, SchedulerConfig, StepType
from deepinfer_core.tokenizer import ByteTokenizer


def _fake_model(plan: Plan, last: dict[str, int], space_id: int) -> np.ndarray:
    out = np.zeros(plan.num_rows, dtype=np.int32)
    ends = np.cumsum(plan.num_tokens)
    for i, rid in enumerate(plan.request_ids):
        prev = int(plan.token_ids[ends[i] - 1])
        prev = last.get(rid, 0) if prev < 0 else prev  # placeholder: this model's own previous sample
        # sum of the id's bytes: stable across runs, unlike hash(str)
        h = sum(rid.encode()) * 1_000_003 + int(plan.context_lens[i]) * 7_919 + prev * 31
        x = (h * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        out[i] = space_id + ((x ^ (x >> 29)) >> 16) % 95  # ids of printable ASCII, never EOS
        last[rid] = int(out[i])
    return out


def demo() -> None:
    rng = np.random.default_rng(0)
    # 1) Fit cost(q, c) from 200 "measured" prefill steps of a known model plus 2% noise.
    true = CostModel(base_ns=1.2e6, token_ns=60.0, quad_ns=1.5e-3, ctx_ns=4e-3)
    q, c = rng.integers(1, 32768, 200), rng.integers(0, 65536, 200)
    fit = CostModel.fit(q, c, true.predict(q, c) * (1 + 0.02 * rng.standard_normal(200)))
    names = ("base_ns", "token_ns", "quad_ns", "ctx_ns")
    print(
        "  prefill step-time model cost(q tokens, c cached) fitted from 200 noisy timings: "
        + ", ".join(f"{k}={v:.4g} (true {w:.4g})" for k, v, w in zip(names, fit.as_tuple(), true.as_tuple()))
    )
    print(
        f"  so a 3 ms prefill step takes {fit.max_chunk(0, 3e6):,} tokens of a fresh prompt, "
        f"{fit.max_chunk(32768, 3e6):,} after 32,768 cached tokens (attention to the cache costs time)"
    )

    # 2) Serve 12 requests asynchronously on a pool small enough to force preemption.
    tok = ByteTokenizer()
    max_tokens: dict[str, int] = {}
    pool = PagedKVPool(num_blocks=40, block_size=16)
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_model_len=512,
        eos_token_id=tok.eos_token_id,
        time_budget_ns=2e6,
        async_mode=True,
        prefill_attempt_interval=2,
    )
    sched = Scheduler(pool, cfg, cost_model=fit)
    for i in range(12):
        prompt = tok.encode(f"Request {i}: " + "tell me about paged attention " * int(rng.integers(1, 5)))
        max_tokens[f"r{i}"] = int(rng.integers(16, 64))
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[f"r{i}"])))
    last: dict[str, int] = {}
    inflight: deque = deque()
    steps: Counter[StepType] = Counter()
    preempted = 0
    chunk_tokens = []
    finished = []
    while sched.has_unfinished() or inflight:
        if sched.num_live:
            plan = sched.schedule()  # planned before the previous step's tokens are applied
            steps[plan.step_type] += 1
            preempted += len(plan.preempted)
            if plan.step_type is StepType.PREFILL:
                chunk_tokens.append(plan.total_tokens)
            inflight.append((plan, _fake_model(plan, last, tok.encode(" ")[0])))
        if inflight and (len(inflight) > 1 or not sched.num_live):
            finished += sched.update(*inflight.popleft())
    print(
        f"  12 requests on a deliberately small KV pool (39 blocks), a stand-in model: "
        f"{steps[StepType.PREFILL]} prefill steps ({min(chunk_tokens)}-{max(chunk_tokens)} tokens each), "
        f"{steps[StepType.DECODE]} decode steps; {preempted} preemptions when the pool ran out"
    )
    reasons = Counter(f.finish_reason.name for f in finished)
    exact = all(len(f.output_token_ids) == max_tokens[f.request_id] for f in finished)
    print(f"  every request got exactly its max_tokens outputs, preempted ones included: {exact}")
    print(
        f"  {len(finished)} requests ended ({dict(reasons)}); all KV blocks returned: {pool.num_free_blocks}/39 free"
    )
    f0 = max(finished, key=lambda f: (f.num_preemptions, len(f.output_token_ids)))
    print(
        f"  {f0.request_id}: {len(f0.output_token_ids)} tokens, preempted {f0.num_preemptions}x, "
        f"stand-in text {printable(tok.decode(f0.output_token_ids[:24]))!r}..."
    )


if __name__ == "__main__":
    demo()
