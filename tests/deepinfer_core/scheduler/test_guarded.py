"""The GUARDED preemption policy: no starvation under adversarial arrivals, bounded preemptions, and
fewer evictions than the seed's DEEPINFER policy where that one thrashes.

Starvation is checked two ways on hypothesis workloads built to starve a request (a long prompt or a
long output arriving first, then a stream of short requests every step, in a pool too small for all):
first admissions happen in arrival order (nothing overtakes a waiting request), and every request
finishes within a step bound computed from the workload (each step computes at least one token or waits
for an arrival, and each request's work is redone at most max_preemptions times), so the run cannot
starve or livelock. The streams equal the oracle's and the per-step checks of test_properties apply.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.scheduler import (
    CostModel,
    EngineType,
    PreemptionPolicy,
    Scheduler,
    SchedulerConfig,
)

from .harness import EOS, Oracle, Spec, drive
from .test_properties import MAX_MODEL_LEN, StepChecker, _assert_match_oracle


@st.composite
def adversarial(draw: st.DrawFn) -> tuple[dict, list[Spec]]:
    """A pool of 8-24 blocks; one to three big requests first, then a stream of short ones."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(8, 24))
    slots = (num_blocks - 1) * block_size
    specs: list[Spec] = []
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 3))):  # the would-be victims: most of the pool each
        p = int(rng.integers(max(1, slots // 3), max(2, slots * 2 // 3)))
        mt = int(max(1, min(slots - p + 1, MAX_MODEL_LEN - p, 40)))
        specs.append(
            Spec(
                no=len(specs),
                arrive=int(rng.integers(0, 3)),
                prompt=[1 + len(specs)] * p,
                max_tokens=mt,
                ignore_eos=True,
            )
        )
    stream_steps = draw(st.integers(5, 30))
    per_step = draw(st.integers(1, 3))
    for step in range(1, stream_steps + 1):  # short requests every step, as a flood would
        for _ in range(per_step):
            p = int(rng.integers(1, 4))
            specs.append(
                Spec(
                    no=len(specs),
                    arrive=step,
                    prompt=[int(x) for x in rng.integers(1, 40, p)],
                    max_tokens=int(rng.integers(1, min(8, slots - p + 1) + 1)),
                    ignore_eos=bool(rng.random() < 0.7),
                )
            )
    cfg = dict(
        engine_type=EngineType.NORMAL,
        max_num_seqs=draw(st.integers(2, 8)),
        max_num_batched_tokens=draw(st.integers(4, 64)),
        max_model_len=MAX_MODEL_LEN,
        eos_token_id=EOS,
        preemption_policy=PreemptionPolicy.GUARDED,
        max_preemptions=draw(st.integers(0, 3)),
        headroom_steps=draw(st.sampled_from([0, 2, 8])),
        prefill_attempt_interval=draw(st.integers(0, 3)),
    )
    cfg["prefill_any_attempt_interval"] = cfg["prefill_attempt_interval"] + draw(st.integers(0, 4))
    return {"cfg": cfg, "num_blocks": num_blocks, "block_size": block_size}, specs


def _step_bound(specs: list[Spec], cap: int) -> int:
    """Steps within which every request must have finished: the last arrival, plus every token of work
    done up to cap + 1 times (at least one token a step), plus one step per request of slack."""
    work = sum(len(s.prompt) + s.max_tokens for s in specs)
    return max(s.arrive for s in specs) + work * (cap + 1) + len(specs) + 10


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@given(data=st.data())
def test_no_starvation_under_adversarial_arrivals(async_mode: bool, data: st.DataObject) -> None:
    params, specs = data.draw(adversarial())
    cfg = SchedulerConfig(async_mode=async_mode, **params["cfg"])
    pool = PagedKVPool(params["num_blocks"], params["block_size"])
    sched = Scheduler(pool, cfg)
    chk = StepChecker(cfg, CostModel())  # includes: nobody preempted more than max_preemptions times
    bound = _step_bound(specs, cfg.max_preemptions)
    res = drive(
        sched,
        specs,
        lag=1 if async_mode else 0,
        before_schedule=chk.before,
        on_plan=chk.after,
        max_steps=bound,
    )
    assert not res.max_steps_hit, f"not finished within {bound} steps: starvation or livelock"
    done = {f.request_id: f for f in res.finished}
    assert set(done) == {s.rid for s in specs}
    assert max(f.num_preemptions for f in done.values()) <= cfg.max_preemptions
    # first admissions in arrival order (seq ids are given in arrival order): nobody overtakes
    assert chk.first_admitted == sorted(chk.first_admitted)
    _assert_match_oracle(specs, EngineType.NORMAL, done)
    assert pool.num_free_blocks == params["num_blocks"] - 1 and pool.impl.num_seqs == 0


def _thrash_case(policy: PreemptionPolicy) -> dict:
    """A long-output request among short ones arriving steadily, in a pool that fits the prompts but not
    everyone's growth: under DEEPINFER the long one is the victim again and again."""
    specs = [Spec(no=0, arrive=0, prompt=[3] * 4, max_tokens=30, ignore_eos=True)]
    specs += [
        Spec(no=i, arrive=2 * i, prompt=[1 + i % 30] * 3, max_tokens=6, ignore_eos=True) for i in range(1, 40)
    ]
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        eos_token_id=EOS,
        preemption_policy=policy,
        prefill_attempt_interval=0,
        prefill_any_attempt_interval=0,
    )
    res = drive(Scheduler(PagedKVPool(18, 2), cfg), specs, lag=0)
    assert not res.max_steps_hit
    done = {f.request_id: f for f in res.finished}
    oracle = Oracle(specs)
    for s in specs:
        assert list(done[s.rid].output_token_ids) == oracle.expected(s.rid, EngineType.NORMAL)[0]
    return done


def test_guarded_bounds_what_deepinfer_thrashes() -> None:
    seed = _thrash_case(PreemptionPolicy.DEEPINFER)
    guarded = _thrash_case(PreemptionPolicy.GUARDED)
    worst_seed = max(f.num_preemptions for f in seed.values())
    assert worst_seed > 4, (
        f"premise: the seed's policy should evict one request repeatedly here ({worst_seed})"
    )
    assert max(f.num_preemptions for f in guarded.values()) <= SchedulerConfig().max_preemptions
    assert sum(f.num_preemptions for f in guarded.values()) < sum(f.num_preemptions for f in seed.values())


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="preemption_policy"):
        SchedulerConfig(preemption_policy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_preemptions"):
        SchedulerConfig(max_preemptions=-1)
    with pytest.raises(ValueError, match="headroom_steps"):
        SchedulerConfig(headroom_steps=-2)
