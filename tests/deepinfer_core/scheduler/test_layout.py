"""The core's memory layout for many running requests: output tokens staged inline in a request's hot
cache lines (flushed every 10 tokens, at preemption and at the end), block-table mirrors in one arena,
plans written in place into recycled buffers that Python owns, and the request-id list built in one
pass. None of it may change what the scheduler reports, which these tests check against independent
records: the oracle's token streams, the pool's own block tables, copies of earlier plans.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core import _C
from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import EngineType, Request, Scheduler, SchedulerConfig, StepType

from .harness import Oracle, Spec, drive
from .test_properties import workloads

STAGE = 10  # the core's kStage: output tokens a decoding request keeps inline


class MidFlight:
    """Before every schedule: each request the core holds, its known output (``output_token_ids``: the token buffer
    plus the inline stage) equals the oracle's stream up to its known length, and that length is the
    output length minus the tokens still in flight."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.longest = 0  # most known output tokens seen (the stage is exercised past STAGE)

    def __call__(self, sched: Scheduler) -> None:
        for rid, seq in list(sched._seq_of.items()):
            if not sched._impl.contains(seq):
                continue  # aborted, slot already gone, end not reported yet
            out = sched.output_token_ids(rid)
            info = sched.request_info(rid)
            assert len(out) == info["output_len"] - info["pending"], (rid, out, info)
            p = len(self.oracle.specs[rid].prompt)
            assert out == [self.oracle.token(rid, p + j) for j in range(len(out))], rid
            self.longest = max(self.longest, len(out))


@given(data=st.data(), lag=st.sampled_from([0, 1]), speculate=st.booleans())
@pytest.mark.parametrize("engine", [EngineType.NORMAL, EngineType.COMPLETION])
def test_staged_tokens_match_the_oracle_at_every_step(
    engine: EngineType, data: st.DataObject, lag: int, speculate: bool
) -> None:
    """Staging flushed right across preemption, abort, finish and multi-token verify rows: mid-flight
    outputs and every finished request's output equal the oracle (aborted ones: a prefix)."""
    params, specs = data.draw(workloads(engine))
    if speculate:
        lag = 0  # verify rows in flight block the next plan of their request; the engine runs them synchronously
    pool = PagedKVPool(params["num_blocks"], params["block_size"])
    sched = Scheduler(pool, SchedulerConfig(**params["cfg"], async_mode=bool(lag)), cost_model=params["cost"])
    oracle = Oracle(specs)
    check = MidFlight(oracle)
    res = drive(
        sched, specs, lag=lag, before_schedule=check, drafts=np.random.default_rng(7) if speculate else None
    )
    assert not res.max_steps_hit
    for f in res.finished:
        want, _ = oracle.expected(f.request_id, engine)
        got = list(f.output_token_ids)
        if oracle.specs[f.request_id].abort_at is not None:
            assert got == want[: len(got)], f.request_id
        else:
            assert got == want, f.request_id
    assert pool.num_free_blocks == params["num_blocks"] - 1


def test_staging_is_exercised_through_preemption() -> None:
    """Not vacuous: a fixed tight-pool workload where requests decode past several stage flushes and are
    preempted mid-stage (then recomputed from the flushed buffer), streams equal the oracle."""
    specs = [Spec(no=i, arrive=i, prompt=[1 + i, 2, 3], max_tokens=37, ignore_eos=True) for i in range(4)]
    pool = PagedKVPool(13, 4)  # 48 slots: four requests of 40 tokens cannot all fit
    sched = Scheduler(pool, SchedulerConfig(max_num_seqs=4, max_model_len=64, headroom_steps=0))
    oracle = Oracle(specs)
    check = MidFlight(oracle)
    res = drive(sched, specs, lag=0, before_schedule=check)
    assert sched.num_preemptions > 0 and check.longest > 3 * STAGE
    for f in res.finished:
        assert list(f.output_token_ids) == oracle.expected(f.request_id, EngineType.NORMAL)[0]


def test_plan_arrays_survive_later_plans_and_block_region_growth() -> None:
    """A plan's arrays are its own buffers: later plans (recycled buffers) never write into a plan still
    held, and a plan whose block ids outgrow the first estimate (the region grows, the written part
    copied) still equals the pool's tables."""
    pool = PagedKVPool(4000, 1)  # block size 1: a 1,500-token prompt is 1,500 block ids in one row
    sched = Scheduler(pool, SchedulerConfig(max_num_seqs=8, max_model_len=4096, async_mode=True))
    rng = np.random.default_rng(0)
    for i in range(3):
        sched.add_request(
            Request(f"r{i}", rng.integers(1, 50, size=500 * (i + 1)), SamplingParams(max_tokens=40))
        )
    held = []
    for _ in range(30):
        plan = sched.schedule()
        tables = pool.block_tables(plan.seq_ids)
        assert (plan.dense_block_tables() == tables[:, : plan.width]).all()
        copy = {
            k: getattr(plan, k).copy()
            for k in (
                "seq_ids",
                "num_tokens",
                "start",
                "token_ids",
                "block_offsets",
                "block_ids",
                "sample",
                "cached",
            )
        }
        held.append((plan, copy))
        if len(held) > 1:  # one step ahead: update the older plan after the newer one exists
            old, _ = held[-2]
            sched.update(old, np.full(old.num_rows, 5, np.int32))
        for p, c in held:
            for k, v in c.items():
                assert (getattr(p, k) == v).all(), k
        if not sched.has_unfinished():
            break
    assert any(p.step_type is StepType.PREFILL and p.block_ids.size > 1000 for p, _ in held)


def test_request_ids_list_gather() -> None:
    """``plan.request_ids`` (the core's one-pass list) equals the numpy form, is a fresh list each read,
    and an id outside the table raises instead of reading past it."""
    pool = PagedKVPool(64, 4)
    sched = Scheduler(pool, SchedulerConfig(max_num_seqs=8))
    for i in range(5):
        sched.add_request(Request(f"id-{i}", [1, 2, 3], SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    ids = plan.request_ids
    assert ids == plan.request_id_array().tolist() == [f"id-{i}" for i in range(5)]
    ids.append("x")
    assert plan.request_ids == [f"id-{i}" for i in range(5)]
    bad = np.array([plan._base + plan._names.shape[0]], np.int64)
    with pytest.raises(IndexError, match="outside the request-id table"):
        _C.scheduler.gather_names(plan._names_at, plan._names.shape[0], bad, 1, plan._base)
