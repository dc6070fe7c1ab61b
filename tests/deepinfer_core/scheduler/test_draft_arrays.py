"""The array form of the draft request (``draft_seq_ids`` / ``draft_counts``) against the dict form.

The property: on the same random workload (random live sets, random k, caps, preemption, aborts, one
step ahead), asking for drafts by seq-id arrays plans exactly what the ``{request id: k}`` dict plans,
step by step, and both end with the oracle's streams. Then the validation: every bad input raises a
``ValueError`` naming the field and changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import (
    CostModel,
    EngineType,
    Plan,
    PreemptionPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
    StepType,
)

from .harness import EOS, RunResult, Spec, drive
from .test_properties import MAX_MODEL_LEN, StepChecker, _assert_match_oracle, workloads


def _snapshot(plan: Plan) -> tuple:
    arrays = (
        plan.seq_ids,
        plan.num_tokens,
        plan.start,
        plan.sample,
        plan.num_drafts,
        plan.token_ids,
        plan.block_tables,
        plan.kv_load_seq_ids,
        plan.kv_load_num_tokens,
    )
    return (plan.step_type, plan.preempted, tuple(plan.request_ids), *(a.tolist() for a in arrays))


def _run(
    params: dict, specs: list[Spec], async_mode: bool, seed: int, max_drafts: int, form: str
) -> tuple[RunResult, list[tuple]]:
    pool = PagedKVPool(params["num_blocks"], params["block_size"])
    cfg = SchedulerConfig(async_mode=async_mode, **params["cfg"])
    sched = Scheduler(pool, cfg, cost_model=params["cost"])
    chk = StepChecker(cfg, params["cost"])
    plans: list[tuple] = []

    def on_plan(s: Scheduler, plan: Plan) -> None:
        chk.after(s, plan)
        plans.append(_snapshot(plan))

    res = drive(
        sched,
        specs,
        lag=1 if async_mode else 0,
        before_schedule=chk.before,
        on_plan=on_plan,
        drafts=np.random.default_rng(seed),
        max_drafts=max_drafts,
        draft_form=form,
    )
    assert not res.max_steps_hit, "workload did not finish"
    assert pool.num_free_blocks == params["num_blocks"] - 1 and pool.impl.num_seqs == 0
    return res, plans


def _finished(res: RunResult) -> dict:
    return {f.request_id: (f.finish_reason, f.output_token_ids, f.num_preemptions) for f in res.finished}


def _capped_and_skipped(res: RunResult, plans: list[tuple]) -> tuple[int, int]:
    """Rows planned with fewer drafts than asked (but > 0), and asks (k > 0) with no row at all."""
    capped = skipped = 0
    for ask, p in zip(res.asked, plans, strict=True):
        if p[0] is not StepType.DECODE:
            continue
        rows = dict(zip(p[2], p[7]))  # request id -> planned drafts
        capped += sum(1 for rid, k in rows.items() if 0 < k < ask.get(rid, 0))
        skipped += sum(1 for rid, k in ask.items() if k > 0 and rid not in rows)
    return capped, skipped


@pytest.mark.parametrize("engine", [EngineType.NORMAL, EngineType.COMPLETION], ids=["NORMAL", "COMPLETION"])
@given(data=st.data())
def test_array_form_plans_exactly_as_dict_form(engine: EngineType, data: st.DataObject) -> None:
    params, specs = data.draw(workloads(engine))
    seed = data.draw(st.integers(0, 2**32 - 1))
    async_mode = data.draw(st.booleans())
    max_drafts = data.draw(st.sampled_from([1, 4, 12]))  # 12: often capped by max_tokens / the token cap
    by_dict, plans_d = _run(params, specs, async_mode, seed, max_drafts, "dict")
    by_array, plans_a = _run(params, specs, async_mode, seed, max_drafts, "array")
    assert plans_a == plans_d
    assert _finished(by_array) == _finished(by_dict)
    _assert_match_oracle(specs, engine, {f.request_id: f for f in by_array.finished})


def test_equal_forms_cover_caps_and_outstanding_verify_rows() -> None:
    """Guard against a vacuous property: on a fixed workload both forms see drafts capped below the
    ask, asks skipped while a verify row is outstanding (one step ahead), and preemption."""
    specs = [
        Spec(no=i, arrive=i % 3, prompt=[1 + i] * 3, max_tokens=12 + i, ignore_eos=True) for i in range(6)
    ]
    params = {
        "cfg": dict(
            engine_type=EngineType.NORMAL,
            max_num_seqs=6,
            max_num_batched_tokens=20,
            max_model_len=MAX_MODEL_LEN,
            eos_token_id=EOS,
            preemption_policy=PreemptionPolicy.DEEPINFER,
        ),
        "cost": CostModel(),
        "num_blocks": 40,
        "block_size": 2,
    }
    for async_mode in (False, True):
        by_dict, plans_d = _run(params, specs, async_mode, 3, 8, "dict")
        by_array, plans_a = _run(params, specs, async_mode, 3, 8, "array")
        assert plans_a == plans_d and _finished(by_array) == _finished(by_dict)
        capped, skipped = _capped_and_skipped(by_array, plans_a)
        assert capped > 0
        assert any(p[1] for p in plans_a), "no preemption"
        if async_mode:
            assert skipped > 0


# ---- validation ----------------------------------------------------------------------------------------
def _decoding(n: int = 3, async_mode: bool = False, **sp) -> Scheduler:
    s = Scheduler(
        PagedKVPool(200, 4), SchedulerConfig(max_model_len=512, async_mode=async_mode, eos_token_id=EOS)
    )
    for i in range(n):
        s.add_request(
            Request(f"r{i}", [1, 2, 3, 4], SamplingParams(**{"max_tokens": 50, "ignore_eos": True, **sp}))
        )
    plan = s.schedule()
    assert plan.step_type is StepType.PREFILL and plan.num_rows == n
    s.update(plan, np.full(n, 5))
    return s


def _seqs(s: Scheduler, *rids: str) -> np.ndarray:
    return np.array([s.seq_id(r) for r in rids], np.int64)


@pytest.mark.parametrize(
    ("seqs", "ks", "match"),
    [
        ([1, 2], [1], r"draft_seq_ids / draft_counts: lengths differ \(2 vs 1\)"),
        ([[1, 2]], [[1, 1]], r"draft_seq_ids: must be 1-D, got shape \(1, 2\)"),
        ([1.0, 2.0], [1, 1], r"draft_seq_ids: must be an integer array, got dtype float64"),
        ([1, 2], [1.5, 1], r"draft_counts: must be an integer array"),
        ([1, 2], np.array([True, False]), r"draft_counts: must be an integer array, got dtype bool"),
        (
            [1, 2],
            np.array([1, -1], np.int32),
            r"draft_counts\[1\]=-1 \(draft_seq_ids\[1\]=2\): must be in \[0, 64\]",
        ),
        (
            [1, 2],
            np.array([65, 1], np.int32),
            r"draft_counts\[0\]=65 \(draft_seq_ids\[0\]=1\): must be in \[0, 64\]",
        ),
        ([1, 2], np.array([1, 2**32 + 1], np.int64), r"draft_counts\[1\]=4294967297 .*must be in \[0, 64\]"),
        ([1, 999], [1, 1], r"draft_seq_ids\[1\]=999: not a live request"),
        ([3, 1, 3], [1, 1, 2], r"draft_seq_ids\[2\]=3: given more than once"),
        (
            np.array([2**64 - 1], np.uint64),
            [1],
            r"draft_seq_ids\[0\]=18446744073709551615: not a live request",
        ),
    ],
)
def test_bad_arrays_raise_naming_the_field_and_change_nothing(seqs: object, ks: object, match: str) -> None:
    s = _decoding()
    with pytest.raises(ValueError, match=match):
        s.schedule(draft_seq_ids=seqs, draft_counts=ks)
    plan = s.schedule()  # the failed call changed nothing: no drafts were left behind for this one
    assert plan.step_type is StepType.DECODE and plan.num_rows == 3 and not plan.num_drafts.any()


def test_valid_entries_before_a_bad_one_are_not_applied() -> None:
    s = _decoding()
    with pytest.raises(ValueError, match=r"draft_seq_ids\[1\]=77"):
        s.schedule(draft_seq_ids=np.array([s.seq_id("r0"), 77]), draft_counts=np.array([3, 1]))
    assert not s.schedule().num_drafts.any()


def test_mixing_forms_or_half_an_array_pair_is_refused() -> None:
    s = _decoding()
    with pytest.raises(ValueError, match="not both"):
        s.schedule(num_draft_tokens={"r0": 1}, draft_seq_ids=_seqs(s, "r0"), draft_counts=np.array([1]))
    with pytest.raises(ValueError, match="give both"):
        s.schedule(draft_seq_ids=_seqs(s, "r0"))
    with pytest.raises(ValueError, match="give both"):
        s.schedule(draft_counts=np.array([1]))


def test_arrays_plan_the_asked_drafts() -> None:
    s = _decoding()
    plan = s.schedule(draft_seq_ids=_seqs(s, "r2", "r0"), draft_counts=np.array([4, 2], np.int32))
    got = dict(zip(plan.request_ids, plan.num_drafts.tolist()))
    assert got == {"r0": 2, "r1": 0, "r2": 4}
    assert (plan.num_tokens == 1 + plan.num_drafts).all()
    s.update(plan, np.full(int(plan.num_tokens.sum()), 5), plan.num_tokens)  # every draft accepted
    plan = s.schedule(draft_seq_ids=np.zeros(0, np.int64), draft_counts=[])  # empty: nothing asked
    assert not plan.num_drafts.any()


def test_aborted_but_unreported_is_skipped_then_refused_once_reported() -> None:
    s = _decoding()
    seq1 = s.seq_id("r1")
    assert s.abort("r1")
    plan = s.schedule(draft_seq_ids=np.array([seq1, s.seq_id("r0")]), draft_counts=np.array([2, 2]))
    assert dict(zip(plan.request_ids, plan.num_drafts.tolist())) == {"r0": 2, "r2": 0}
    ended = s.update(plan, np.full(int(plan.num_tokens.sum()), 5), plan.num_tokens)
    assert [f.request_id for f in ended] == ["r1"]
    with pytest.raises(ValueError, match=rf"draft_seq_ids\[0\]={seq1}: not a live request"):
        s.schedule(draft_seq_ids=np.array([seq1]), draft_counts=np.array([1]))


def test_reported_end_with_a_row_in_flight_is_refused() -> None:
    """Async: a request that ends at step N's update while its N+1 row is in flight keeps its core slot
    until that row is processed, but its end is reported, so it is no longer live for the caller."""
    s = Scheduler(PagedKVPool(200, 4), SchedulerConfig(max_model_len=512, async_mode=True, eos_token_id=EOS))
    for i in range(2):
        s.add_request(Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=50)))
    prefill = s.schedule()
    s.update(prefill, np.full(2, 5))
    d1 = s.schedule()
    d2 = s.schedule()  # one step ahead: both requests have a row in d1 and d2
    seq0 = s.seq_id("r0")
    ended = s.update(d1, np.where(d1.seq_ids == seq0, EOS, 5))  # r0 stops on EOS
    assert [f.request_id for f in ended] == ["r0"]
    assert s._impl.contains(seq0)  # the core slot lives on for d2's row
    with pytest.raises(ValueError, match=rf"draft_seq_ids\[0\]={seq0}: not a live request"):
        s.schedule(draft_seq_ids=np.array([seq0]), draft_counts=np.array([1]))
    with pytest.raises(ValueError, match="request 'r0' is not live"):
        s.schedule(num_draft_tokens={"r0": 1})
    s.update(d2, np.full(2, 5))
    s.check_invariants()


def test_dict_form_errors_name_the_request() -> None:
    s = _decoding()
    with pytest.raises(ValueError, match=r"num_draft_tokens\['r0'\]=65: must be in \[0, 64\]"):
        s.schedule(num_draft_tokens={"r0": 65})
    with pytest.raises(ValueError, match=r"num_draft_tokens\['r1'\]=-2: must be in \[0, 64\]"):
        s.schedule(num_draft_tokens={"r0": 1, "r1": -2})
    with pytest.raises(ValueError, match=r"num_draft_tokens\['r0'\]: True must be an int"):
        s.schedule(num_draft_tokens={"r0": True})
    with pytest.raises(ValueError, match="request 'nope' is not live"):
        s.schedule(num_draft_tokens={"nope": 1})
    assert not s.schedule().num_drafts.any()
