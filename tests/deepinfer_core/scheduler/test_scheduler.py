"""Unit tests of the step planner: vote bound, async discard, preemption, chunking, validation, engines."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import (
    CostModel,
    EngineType,
    FinishReason,
    Plan,
    PreemptionPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
    StepType,
)

from .harness import EOS, Oracle, Spec, drive


def req(rid: str, n: int = 4, max_tokens: int = 8, **kw) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def step(s: Scheduler, tok: int = 5, group: tuple[bool, bool, bool] | None = None) -> tuple[Plan, list]:
    plan = s.schedule(group)
    return plan, s.update(plan, np.full(plan.num_rows, tok))


# ---- one step type per DP group, and the bound on a lone rank's prompt --------------------------------
def test_single_rank_prompt_waits_at_most_prefill_attempt_interval() -> None:
    k = 3
    s = Scheduler(PagedKVPool(400, 4), SchedulerConfig(max_model_len=1024, prefill_attempt_interval=k))
    s.add_request(req("long", max_tokens=500))
    plan, _ = step(s)
    assert plan.step_type is StepType.PREFILL
    for trial in range(4):
        s.add_request(req(f"p{trial}", max_tokens=500))
        waited = 0
        while True:
            plan, _ = step(s)
            if plan.step_type is StepType.PREFILL:
                assert f"p{trial}" in plan.request_ids
                break
            assert plan.step_type is StepType.DECODE
            waited += 1
        # The counter restarts at each prefill step, so a prompt arriving right after one waits k.
        assert waited == k


def group_of(wishes: list[tuple[bool, bool]]) -> tuple[bool, bool, bool]:
    return (all(w[0] for w in wishes), any(w[0] for w in wishes), any(w[1] for w in wishes))


@pytest.mark.parametrize(("prompts_on", "expect_wait"), [((0,), 7), ((0, 1, 2), 2)])
def test_dp_group_agrees_and_lone_prompt_bound(prompts_on: tuple[int, ...], expect_wait: int) -> None:
    cfg = SchedulerConfig(max_model_len=1024, prefill_attempt_interval=2, prefill_any_attempt_interval=7)
    ranks = [Scheduler(PagedKVPool(400, 4), cfg) for _ in range(3)]
    for i, s in enumerate(ranks):
        s.add_request(req(f"long{i}", max_tokens=500))
    for _ in range(2):  # prefill everyone's first request, then decode a while
        group = group_of([r.step_wish() for r in ranks])
        plans = [s.schedule(group) for s in ranks]
        for s, p in zip(ranks, plans):
            s.update(p, np.full(p.num_rows, 5))
    for trial in range(3):
        for i in prompts_on:
            ranks[i].add_request(req(f"new{i}-{trial}", max_tokens=500))
        waited = 0
        while True:
            group = group_of([r.step_wish() for r in ranks])  # the all-reduce, done by hand
            plans = [s.schedule(group) for s in ranks]
            assert len({p.step_type for p in plans}) == 1, "ranks of one group ran different step types"
            for s, p in zip(ranks, plans):
                s.update(p, np.full(p.num_rows, 5))
            if plans[0].step_type is StepType.PREFILL:
                break
            waited += 1
        assert waited <= expect_wait
        if trial > 0:  # the previous prefill reset the counter: the bound is met exactly
            assert waited == expect_wait


# ---- asynchronous scheduling: a request that ends at N while scheduled at N+1 --------------------------
def test_async_finished_request_slot_discarded_blocks_freed_once() -> None:
    pool = PagedKVPool(32, 4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=64, eos_token_id=EOS, async_mode=True))
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    free0 = pool.num_free_blocks
    p0 = s.schedule()  # prefill, samples output[0]
    p1 = s.schedule()  # decode output[0] (placeholder), samples output[1]
    assert p1.step_type is StepType.DECODE and p1.token_ids.tolist() == [-1]
    assert s.request_info("a")["output_len"] == 2  # output length counts the two tokens in flight
    assert s.update(p0, [7]) == []
    p2 = s.schedule()  # decode output[1] (still unknown)
    info = s.request_info("a")
    assert (info["schedule_cnt"], info["process_cnt"], info["pending"]) == (3, 1, 2)
    with pytest.raises(RuntimeError, match="not yet updated"):
        s.schedule()  # at most one step ahead
    ended = s.update(p1, [EOS])  # output[1] is EOS: the request ends while p2 holds a row for it
    assert [(f.request_id, f.finish_reason, f.output_token_ids) for f in ended] == [
        ("a", FinishReason.STOP, (7, EOS))
    ]
    assert pool.num_free_blocks == free0 and not pool.contains(int(p2.seq_ids[0]))
    assert s.update(p2, [9]) == []  # slot discarded: output not extended, nothing reported twice
    assert pool.num_free_blocks == free0
    assert not s.has_unfinished()
    pool.impl.check_invariants()


def test_async_plan_must_be_updated_in_order() -> None:
    s = Scheduler(PagedKVPool(32, 4), SchedulerConfig(max_model_len=64, async_mode=True))
    s.add_request(req("a"))
    p0, p1 = s.schedule(), s.schedule()
    with pytest.raises(ValueError, match="step_id"):
        s.update(p1, [1])
    with pytest.raises(ValueError, match="result"):
        s.update(p0, [1, 2])


# ---- preemption (DEEPINFER: from the longest-output end) -------------------------------------------------------
def test_first_preempted_is_longest_output_and_nothing_is_lost() -> None:
    # block_size 1: every decode token takes a block, so the pool runs out while all four run.
    specs = [Spec(no=i, arrive=3 * i, prompt=[2 + i, 3], max_tokens=30, ignore_eos=True) for i in range(4)]
    firsts: list[tuple[str, ...]] = []
    lengths: dict[str, int] = {}

    def before(s: Scheduler) -> None:
        lengths.clear()
        for rid in s._seq_of:
            if s._impl.contains(s.seq_id(rid)):
                lengths[rid] = s.request_info(rid)["output_len"]

    def on_plan(s: Scheduler, plan: Plan) -> None:
        if plan.preempted and not firsts:
            firsts.append(plan.preempted)
            longest = max(lengths[r] for r in lengths if s.request_info(r)["status"] in (0, 2))
            assert lengths[plan.preempted[0]] == longest

    s = Scheduler(
        PagedKVPool(41, 1),
        SchedulerConfig(max_model_len=64, max_num_seqs=4, preemption_policy=PreemptionPolicy.DEEPINFER),
    )
    res = drive(s, specs, lag=0, before_schedule=before, on_plan=on_plan)
    assert firsts and firsts[0][0] == "req-0"  # the earliest arrival has generated the most
    oracle = Oracle(specs)
    got = {f.request_id: f for f in res.finished}
    assert sum(f.num_preemptions for f in got.values()) > 0
    for sp in specs:
        assert list(got[sp.rid].output_token_ids) == oracle.expected(sp.rid, EngineType.NORMAL)[0]


# ---- chunked prefill under a time budget -------------------------------------------------------------
def test_chunks_are_the_largest_that_fit_the_budget() -> None:
    cost = CostModel(base_ns=5e5, token_ns=50.0, quad_ns=2e-3, ctx_ns=4e-3)
    budget = 2.0e6
    s = Scheduler(
        PagedKVPool(2000, 16),
        SchedulerConfig(max_model_len=20000, time_budget_ns=budget),
        cost_model=cost,
    )
    s.add_request(req("big", n=12000, max_tokens=2))
    c = 0
    while c < 12000:
        plan, _ = step(s)
        assert plan.step_type is StepType.PREFILL and plan.num_rows == 1
        q = int(plan.num_tokens[0])
        assert int(plan.start[0]) == c
        assert q == min(12000 - c, cost.max_chunk(c, budget))
        assert cost.predict(q, c) <= budget < cost.predict(q + 1, c) or c + q == 12000
        assert bool(plan.sample[0]) == (c + q == 12000)
        c += q
    assert c == 12000


def test_hard_cap_of_32768_tokens_per_step() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=40000)
    s = Scheduler(PagedKVPool(400, 256), SchedulerConfig(max_model_len=80000))
    s.add_request(req("huge", n=70000, max_tokens=1))
    sizes = [int(step(s)[0].num_tokens.sum()) for _ in range(3)]
    assert sizes == [32768, 32768, 70000 - 2 * 32768]


def test_budget_too_small_for_one_token_is_rejected() -> None:
    cost = CostModel(base_ns=1e6, token_ns=10.0, ctx_ns=1.0)
    with pytest.raises(ValueError, match="time_budget_ns"):
        Scheduler(
            PagedKVPool(64, 16),
            SchedulerConfig(max_model_len=1000, time_budget_ns=1.0e6 + 500),
            cost_model=cost,
        )


# ---- validation: a bad request fails alone, the queue is unchanged -----------------------------------
@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (Request("x", [], SamplingParams()), "prompt_token_ids"),
        (Request("x", [1, -2], SamplingParams()), "prompt_token_ids"),
        (Request("x", [1] * 60, SamplingParams(max_tokens=10)), "max_tokens"),
        (Request("", [1], SamplingParams()), "request_id"),
    ],
)
def test_invalid_request_names_field(request_: Request, field: str) -> None:
    s = Scheduler(PagedKVPool(64, 4), SchedulerConfig(max_model_len=64))
    s.add_request(req("ok"))
    with pytest.raises(ValueError, match=field):
        s.add_request(request_)
    assert s.num_waiting == 1 and s.num_live == 1


def test_non_integer_prompt_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("x", [1.5, 2.0])


def test_request_larger_than_pool_and_duplicates_rejected() -> None:
    s = Scheduler(PagedKVPool(5, 4), SchedulerConfig(max_model_len=64))  # 16 token slots
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("big", n=10, max_tokens=10))
    s.add_request(req("a"))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a"))
    with pytest.raises(TypeError, match="pool"):
        Scheduler(object())


def test_invalid_token_fails_its_request_only() -> None:
    pool = PagedKVPool(64, 4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=64))
    s.add_request(req("good", max_tokens=3))
    s.add_request(req("bad", max_tokens=3))
    ended = {}
    while s.has_unfinished():
        plan = s.schedule()
        toks = np.where(np.array(plan.request_ids) == "bad", -1, 5)
        ended.update({f.request_id: f for f in s.update(plan, toks)})
    assert ended["bad"].finish_reason is FinishReason.FAILED
    assert ended["good"].finish_reason is FinishReason.LENGTH and ended["good"].output_token_ids == (5, 5, 5)
    assert pool.num_free_blocks == 63


# ---- abort ---------------------------------------------------------------------------------------------
def test_abort_waiting_running_and_unknown() -> None:
    pool = PagedKVPool(64, 4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=64, max_num_seqs=1, async_mode=True))
    s.add_request(req("run", max_tokens=50))
    s.add_request(req("wait", max_tokens=50))
    p0 = s.schedule()
    assert p0.request_ids == ["run"]
    assert s.abort("wait") and not s.abort("wait") and not s.abort("nope")
    assert s.abort("run")  # in flight: blocks come back now, its row is discarded later
    assert pool.num_free_blocks == 63
    ended = s.update(p0, [5])
    assert sorted((f.request_id, f.finish_reason, f.output_token_ids) for f in ended) == [
        ("run", FinishReason.ABORT, ()),
        ("wait", FinishReason.ABORT, ()),
    ]
    assert not s.has_unfinished()


# ---- engine types ---------------------------------------------------------------------------------------
def test_prompt_engine_hands_off_blocks_after_one_token() -> None:
    pool = PagedKVPool(64, 4)
    s = Scheduler(pool, SchedulerConfig(engine_type=EngineType.PROMPT, max_model_len=64))
    s.add_request(req("p", n=10, max_tokens=20))
    plan = s.schedule()
    table = plan.block_tables[0][plan.block_tables[0] > 0].copy()
    assert pool.num_free_blocks == 63 - 3
    (f,) = s.update(plan, [9])
    assert f.finish_reason is FinishReason.HANDOFF and f.output_token_ids == (9,)
    assert f.handoff_block_ids.tolist() == table.tolist()
    assert pool.num_free_blocks == 63


def test_completion_engine_loads_kv_and_decodes_from_last_prompt_token() -> None:
    s = Scheduler(PagedKVPool(64, 4), SchedulerConfig(engine_type=EngineType.COMPLETION, max_model_len=64))
    s.add_request(req("c", n=10, max_tokens=2))
    plan = s.schedule()
    assert plan.step_type is StepType.DECODE
    assert plan.kv_load_seq_ids.tolist() == [s.seq_id("c")] and plan.kv_load_num_tokens.tolist() == [9]
    assert plan.start.tolist() == [9] and plan.token_ids.tolist() == [10]


def test_plan_arrays_match_pool_and_positions() -> None:
    pool = PagedKVPool(64, 4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=64))
    for i, n in enumerate([3, 9, 5]):
        s.add_request(req(f"r{i}", n=n))
    plan = s.schedule()
    assert plan.num_scheduled == {"r0": 3, "r1": 9, "r2": 5}
    np.testing.assert_array_equal(plan.block_tables, pool.block_tables(plan.seq_ids))
    want = np.concatenate([np.arange(a, a + q) for a, q in zip(plan.start, plan.num_tokens)])
    np.testing.assert_array_equal(plan.positions(), want)
    np.testing.assert_array_equal(plan.context_lens, [3, 9, 5])


def test_compact_tables_and_dense_views() -> None:
    """CSR rows are the pool's tables; dense views by index, mask, negative index; errors name rows."""
    pool = PagedKVPool(64, 4)
    s = Scheduler(pool, SchedulerConfig(max_model_len=64))
    for i, n in enumerate([3, 9, 5, 13]):
        s.add_request(req(f"r{i}", n=n))
    plan = s.schedule()
    off, ids = plan.block_offsets, plan.block_ids
    for i, seq in enumerate(plan.seq_ids.tolist()):
        assert ids[off[i] : off[i + 1]].tolist() == np.asarray(pool.block_table(seq)).tolist()
    dense = plan.block_tables
    assert dense.shape == (4, 4) and dense[0, 1:].tolist() == [0, 0, 0]  # padded with the null block
    np.testing.assert_array_equal(plan.dense_block_tables([2, 0]), dense[[2, 0]])
    np.testing.assert_array_equal(
        plan.dense_block_tables(np.array([True, False, False, True])), dense[[0, 3]]
    )
    np.testing.assert_array_equal(plan.dense_block_tables([-1]), dense[[-1]])
    assert plan.dense_block_tables([]).shape == (0, 4)
    with pytest.raises(IndexError, match=r"rows\[1\]=4"):
        plan.dense_block_tables([0, 4])
    with pytest.raises(ValueError, match="rows"):
        plan.dense_block_tables(np.array([True, False]))
    assert plan.request_ids == ["r0", "r1", "r2", "r3"]
    assert plan.request_id_array().tolist() == plan.request_ids


def test_core_keeps_the_pool_alive() -> None:
    import gc

    from deepinfer_core import _C

    # Only the C++ scheduler references this pool: nb::keep_alive must stop it being freed.
    core = _C.scheduler.StepScheduler(
        _C.kv.BlockPool(32, 4), 0, 4, 64, 64, -1, 0.0, 2, 16, False, 0, [0.0] * 4
    )
    gc.collect()
    core.add_request(1, np.array([1, 2, 3], dtype=np.int32), 2, 0, True, [])
    t = core.schedule(True, True, False)
    assert t[4] == 1  # one row
    core.check_invariants()
