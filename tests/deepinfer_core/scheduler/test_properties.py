"""Property tests over random workloads with the deterministic fake executor.

For every engine type: synchronous and asynchronous scheduling give the same token streams, equal to
an oracle computed from the rules; no step exceeds the token cap or (by the model's prediction) the
time budget; decode rows and preemptions follow the policy's order (DEEPINFER: output length;
GUARDED: protected first, then admission, no request preempted more than max_preemptions times);
every request ends exactly once; no block leaks.
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
    FinishReason,
    Plan,
    PreemptionPolicy,
    Scheduler,
    SchedulerConfig,
    StepType,
)

from .harness import EOS, VOCAB, Oracle, Spec, drive

MAX_MODEL_LEN = 96


@st.composite
def workloads(draw: st.DrawFn, engine: EngineType) -> tuple[dict, list[Spec]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(4, 24))
    slots = (num_blocks - 1) * block_size  # token slots of the whole pool
    specs = []
    for no in range(draw(st.integers(2, 12))):
        p = int(rng.integers(1, min(24, slots) + 1))
        mt_max = max(1, min(30, slots - p + 1, MAX_MODEL_LEN - p))
        mt = int(rng.integers(1, mt_max + 1))
        abort_at = int(rng.integers(0, 60)) if rng.random() < 0.15 else None
        stop = tuple(int(x) for x in rng.integers(1, VOCAB, size=int(rng.integers(0, 3))))
        specs.append(
            Spec(
                no=no,
                arrive=int(rng.integers(0, 12)),
                prompt=[int(x) for x in rng.integers(1, VOCAB, size=p)],
                max_tokens=mt,
                min_tokens=int(rng.integers(0, mt + 1)) if rng.random() < 0.3 else 0,
                ignore_eos=bool(rng.random() < 0.5),
                stop_ids=stop,
                abort_at=abort_at,
            )
        )
    cost = CostModel(
        base_ns=float(rng.uniform(0, 1000)),
        token_ns=float(rng.uniform(1, 10)),
        quad_ns=float(rng.uniform(0, 0.1)),
        ctx_ns=float(rng.uniform(0, 0.05)),
    )
    worst = cost.predict(1, MAX_MODEL_LEN - 1)
    budget = None if rng.random() < 0.3 else float(worst * rng.uniform(1.0, 4.0))
    attempt = draw(st.integers(0, 4))
    cfg = dict(
        engine_type=engine,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_model_len=MAX_MODEL_LEN,
        eos_token_id=EOS,
        time_budget_ns=budget,
        prefill_attempt_interval=attempt,
        prefill_any_attempt_interval=attempt + draw(st.integers(0, 4)),
        watermark_blocks=draw(st.integers(0, 2)),
        preemption_policy=draw(st.sampled_from(list(PreemptionPolicy))),
        max_preemptions=draw(st.integers(0, 3)),
        headroom_steps=draw(st.sampled_from([0, 1, 4, 16])),
    )
    return {"cfg": cfg, "cost": cost, "num_blocks": num_blocks, "block_size": block_size}, specs


class StepChecker:
    """Per-step checks: caps, budget, one step type, the policy's order of decode rows and preemption.

    The GUARDED order is rebuilt here from what the plans show: a request is admitted by the plan whose
    row for it starts at 0 (prefill) or that lists it in kv_load_seq_ids (COMPLETION), in row order;
    it is protected if it had been preempted max_preemptions times by then."""

    def __init__(self, cfg: SchedulerConfig, cost: CostModel) -> None:
        self.cfg = cfg
        self.cost = cost
        self.decoding: list[int] = []  # seq ids of decoding requests before the step, in expected order
        self.preemptions = 0
        self.drafts_fed = self.drafts_accepted = 0
        self.admit_key: dict[int, tuple[int, int]] = {}  # GUARDED: seq -> (0 protected / 1, admission no.)
        self.admissions = 0
        self.first_admitted: list[int] = []  # seq ids in the order of their first admission
        self.max_preempted = 0  # most preemptions of one request seen

    def before(self, sched: Scheduler) -> None:
        keyed = []
        guarded = self.cfg.preemption_policy is PreemptionPolicy.GUARDED
        for rid, seq in sched._seq_of.items():
            info = sched.request_info(rid) if sched._impl.contains(seq) else None
            if info is None:
                continue
            self.max_preempted = max(self.max_preempted, info["num_preemptions"])
            if guarded:
                assert info["num_preemptions"] <= self.cfg.max_preemptions, f"{rid} preempted too often"
            if info["status"] == 2:  # DECODING
                # DEEPINFER: output length, seq ids grow with arrival as the tie-break
                keyed.append((self.admit_key[seq] if guarded else (info["output_len"], seq), seq))
        self.decoding = [seq for _, seq in sorted(keyed)]

    def _admit(self, sched: Scheduler, seqs: list[int]) -> None:
        for seq in seqs:
            if seq not in self.admit_key:
                self.first_admitted.append(seq)
            info = sched.request_info(sched._id_of[seq])
            protected = info["num_preemptions"] >= self.cfg.max_preemptions
            self.admit_key[seq] = (0 if protected else 1, self.admissions)
            self.admissions += 1

    def after(self, sched: Scheduler, plan: Plan) -> None:
        cfg = self.cfg
        assert plan.total_tokens <= cfg.max_num_batched_tokens
        assert plan.num_rows <= cfg.max_num_seqs
        # Compact tables: CSR offsets consistent, the dense view equal to the pool's own tables (an
        # independent oracle: the pool's hash map, not the scheduler's mirrors), any row subset too.
        off = plan.block_offsets
        assert off.shape == (plan.num_rows + 1,) and off[0] == 0 and (np.diff(off) >= 0).all()
        assert off[-1] == plan.block_ids.shape[0]
        dense = plan.block_tables
        assert dense.shape == (plan.num_rows, plan.width)
        if plan.num_rows:
            np.testing.assert_array_equal(dense, sched.pool.block_tables(plan.seq_ids))
            assert plan.width == int(np.diff(off).max())
            rows = np.flatnonzero(np.arange(plan.num_rows) % 2 == plan.step_id % 2)
            np.testing.assert_array_equal(plan.dense_block_tables(rows), dense[rows])
        if plan.step_type is StepType.PREFILL:
            self._admit(sched, plan.seq_ids[plan.start == 0].tolist())
            assert cfg.engine_type is not EngineType.COMPLETION
            assert (plan.token_ids >= 0).all()  # prefill inputs are always known tokens
            if cfg.time_budget_ns is not None and plan.num_rows:
                predicted = self.cost.step_ns(plan.num_tokens, plan.start)
                assert predicted <= cfg.time_budget_ns * (1 + 1e-12)
                assert abs(predicted - plan.predicted_ns) <= 1e-9 * max(1.0, predicted)
        elif plan.step_type is StepType.DECODE:
            assert cfg.engine_type is not EngineType.PROMPT
            assert (plan.num_tokens == 1 + plan.num_drafts).all() and plan.sample.all()
            loaded = set(plan.kv_load_seq_ids.tolist())
            self._admit(sched, plan.kv_load_seq_ids.tolist())
            # COMPLETION admissions: the KV to load is exactly what the row's first token attends to.
            starts = dict(zip(plan.seq_ids.tolist(), plan.start.tolist()))
            for s, k in zip(plan.kv_load_seq_ids.tolist(), plan.kv_load_num_tokens.tolist()):
                assert starts[s] == k
            rows = [s for s in plan.seq_ids.tolist() if s not in loaded]
            # Victims from the tail of the order (DEEPINFER: longest output; GUARDED: newest admission).
            pre = [sched._seq_of[r] for r in plan.preempted]
            self.preemptions += len(pre)
            assert pre == self.decoding[::-1][: len(pre)]
            # Decode rows follow the order and precede every preempted one.
            pos = {s: i for i, s in enumerate(self.decoding)}
            idx = [pos[s] for s in rows]
            assert idx == sorted(idx)
            if pre:
                assert not idx or max(idx) < min(pos[s] for s in pre)
        else:
            assert plan.num_rows == 0


def run(
    params: dict, specs: list[Spec], async_mode: bool, draft_seed: int | None = None
) -> tuple[dict, StepChecker]:
    pool = PagedKVPool(params["num_blocks"], params["block_size"])
    cfg = SchedulerConfig(async_mode=async_mode, **params["cfg"])
    sched = Scheduler(pool, cfg, cost_model=params["cost"])
    chk = StepChecker(cfg, params["cost"])
    rng = None if draft_seed is None else np.random.default_rng(draft_seed)
    res = drive(
        sched, specs, lag=1 if async_mode else 0, before_schedule=chk.before, on_plan=chk.after, drafts=rng
    )
    chk.drafts_fed, chk.drafts_accepted = res.drafts_fed, res.drafts_accepted
    assert not res.max_steps_hit, "workload did not finish"
    ids = [f.request_id for f in res.finished]
    assert len(ids) == len(set(ids)), "a request ended twice"
    assert set(ids) == {s.rid for s in specs}, "a request never ended"
    # No block leak: every block is back on the free list, no sequence left in the pool.
    assert pool.num_free_blocks == params["num_blocks"] - 1
    assert pool.impl.num_seqs == 0
    pool.impl.check_invariants()
    return {f.request_id: f for f in res.finished}, chk


def _assert_match_oracle(specs: list[Spec], engine: EngineType, *runs: dict) -> None:
    """Every run's stream equals the oracle's; an aborted request (when depends on the mode) a prefix."""
    oracle = Oracle(specs)
    for s in specs:
        want, why = oracle.expected(s.rid, engine)
        for done in runs:
            got = done[s.rid]
            if got.finish_reason is FinishReason.ABORT:
                assert list(got.output_token_ids) == want[: len(got.output_token_ids)]
            else:
                assert got.finish_reason is why
                assert list(got.output_token_ids) == want


@pytest.mark.parametrize("engine", list(EngineType), ids=[e.name for e in EngineType])
@given(data=st.data())
def test_sync_equals_async_and_oracle(engine: EngineType, data: st.DataObject) -> None:
    params, specs = data.draw(workloads(engine))
    sync, _ = run(params, specs, async_mode=False)
    asyn, _ = run(params, specs, async_mode=True)
    _assert_match_oracle(specs, engine, sync, asyn)
    for s in specs:
        if s.abort_at is None:
            assert sync[s.rid].output_token_ids == asyn[s.rid].output_token_ids


@pytest.mark.parametrize("policy", list(PreemptionPolicy), ids=[p.name for p in PreemptionPolicy])
def test_preemption_happens_in_property_workloads(policy: PreemptionPolicy) -> None:
    """Guard against a vacuous order check: a tight pool does preempt, and nothing is lost."""
    specs = [Spec(no=i, arrive=i, prompt=[1 + i] * 3, max_tokens=20, ignore_eos=True) for i in range(6)]
    params = {
        "cfg": dict(
            engine_type=EngineType.NORMAL,
            max_num_seqs=6,
            max_model_len=MAX_MODEL_LEN,
            eos_token_id=EOS,
            preemption_policy=policy,
            headroom_steps=0,
        ),
        "cost": CostModel(),
        "num_blocks": 30,
        "block_size": 2,
    }
    for mode in (False, True):
        done, chk = run(params, specs, async_mode=mode)
        assert chk.preemptions > 0
        assert sum(f.num_preemptions for f in done.values()) == chk.preemptions
        oracle = Oracle(specs)
        for s in specs:
            assert list(done[s.rid].output_token_ids) == oracle.expected(s.rid, EngineType.NORMAL)[0]


@pytest.mark.parametrize("engine", [EngineType.NORMAL, EngineType.COMPLETION], ids=["NORMAL", "COMPLETION"])
@given(data=st.data())
def test_speculative_sync_equals_async_and_oracle(engine: EngineType, data: st.DataObject) -> None:
    """Verify rows of 1 + k tokens, a random prefix of the drafts accepted: the same streams as the
    oracle in both modes, stops inside an accepted run honoured, every block back (checked in run)."""
    params, specs = data.draw(workloads(engine))
    seed = data.draw(st.integers(0, 2**32 - 1))
    sync, _ = run(params, specs, async_mode=False, draft_seed=seed)
    asyn, _ = run(params, specs, async_mode=True, draft_seed=seed + 1)
    _assert_match_oracle(specs, engine, sync, asyn)


@pytest.mark.parametrize("policy", list(PreemptionPolicy), ids=[p.name for p in PreemptionPolicy])
def test_speculative_drafts_are_planned_and_accepted(policy: PreemptionPolicy) -> None:
    """Guard against a vacuous property: drafts are fed and accepted, with preemption in a tight pool,
    and accepted drafts take fewer steps than one token a step."""
    specs = [Spec(no=i, arrive=0, prompt=[1 + i] * 3, max_tokens=30, ignore_eos=True) for i in range(6)]
    params = {
        "cfg": dict(
            engine_type=EngineType.NORMAL,
            max_num_seqs=6,
            max_model_len=MAX_MODEL_LEN,
            eos_token_id=EOS,
            preemption_policy=policy,
            headroom_steps=0,
        ),
        "cost": CostModel(),
        "num_blocks": 40,
        "block_size": 2,
    }
    oracle = Oracle(specs)
    for mode in (False, True):
        done, chk = run(params, specs, async_mode=mode, draft_seed=7)
        assert chk.drafts_fed > 0 and 0 < chk.drafts_accepted < chk.drafts_fed
        assert chk.preemptions > 0
        for s in specs:
            assert list(done[s.rid].output_token_ids) == oracle.expected(s.rid, EngineType.NORMAL)[0]
