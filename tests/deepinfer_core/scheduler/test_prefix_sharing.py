"""Prefix sharing at admission (``Scheduler.set_prefix_sharing``): hits share cached blocks by refcount.

The oracle is a simulated KV memory: every plan row "writes" the oracle's tokens of its positions into
the slots of its block table, and the test publishes each request's whole computed blocks to the
prefix index after each plan (what the engine does after a step). Then, step by step:

- a row never writes a block another sequence holds (refcount 1), so sharing never needs a copy;
- an admission row (``plan.cached >= 0``) starts at its hit, the hit is whole ``align`` groups, at most
  ``known - tail`` tokens, and the shared blocks hold exactly the request's tokens (memory oracle);
- scheduler and pool invariants hold; every request ends with the oracle's stream; every block is
  free at the end (cached ones evictable).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.kv import PagedKVPool, PrefixIndex
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import PreemptionPolicy, Request, Scheduler, SchedulerConfig, StepType
from tests.deepinfer_core.scheduler.harness import EOS, VOCAB, Oracle, Spec, drive

MAX_MODEL_LEN = 96


class Memory:
    """Simulated KV memory + the engine's publishing, checked against the oracle's token streams."""

    def __init__(self, pool: PagedKVPool, specs: list[Spec], align: int, tail: int) -> None:
        self.pool, self.index, self.bs = pool, PrefixIndex(pool), pool.block_size
        self.kv: dict[int, np.ndarray] = {}
        self.oracle = Oracle(specs)
        self.prompt_len = {s.rid: len(s.prompt) for s in specs}
        self.align, self.tail = align, tail
        self.hits = self.shared_admissions = 0

    def on_plan(self, sched: Scheduler, plan) -> None:
        bs = self.bs
        cached = plan.cached
        assert cached.shape == (plan.num_rows,)
        rids = plan.request_ids
        for i, rid in enumerate(rids):
            seq, start, q = int(plan.seq_ids[i]), int(plan.start[i]), int(plan.num_tokens[i])
            table = plan.block_ids[plan.block_offsets[i] : plan.block_offsets[i + 1]]
            c = int(cached[i])
            if c >= 0:  # first row of an admission: starts at its hit, which is whole groups within the cap
                assert plan.step_type is StepType.PREFILL
                assert start == c and c % self.align == 0
                info = sched.request_info(rid)
                known = self.prompt_len[rid] + info["output_len"] - int(plan.sample[i])
                assert c <= max(0, known - self.tail) // self.align * self.align
                for b in range(c // bs):  # the shared blocks hold this request's tokens
                    want = [self.oracle.token(rid, b * bs + j) for j in range(bs)]
                    assert self.kv[int(table[b])].tolist() == want, (
                        f"{rid}: shared block {b} holds other tokens"
                    )
                if c:
                    self.hits += 1
                    self.shared_admissions += any(self.pool.refcount(int(x)) > 1 for x in table[: c // bs])
            else:
                assert start > 0 or plan.step_type is StepType.DECODE
            for p in range(start, start + q):  # the row's writes: only into blocks it holds alone
                blk = int(table[p // bs])
                assert self.pool.refcount(blk) == 1, f"{rid}: writes position {p} into shared block {blk}"
                self.kv.setdefault(blk, np.full(bs, -1, np.int64))[p % bs] = self.oracle.token(rid, p)
            full = (start + q) // bs * bs
            if full:
                self.index.insert([self.oracle.token(rid, p) for p in range(full)], table[: full // bs])
            assert self.pool.contains(seq)
        # the hit ends before the table's last block, so the pool never queues a copy-on-write (which no
        # caller would execute: the engine's tables never fork)
        assert self.pool.impl.num_pending_copy_ops == 0
        self.pool.check_invariants()


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[Spec]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    align = block_size * draw(st.sampled_from([1, 2]))
    num_blocks = draw(st.integers(6, 28))
    slots = (num_blocks - 1) * block_size
    prefixes = [
        [int(x) for x in rng.integers(1, VOCAB, size=int(rng.integers(1, 30)))]
        for _ in range(draw(st.integers(1, 3)))
    ]
    specs = []
    for no in range(draw(st.integers(2, 12))):
        p = prefixes[int(rng.integers(len(prefixes)))] + [
            int(x) for x in rng.integers(1, VOCAB, size=int(rng.integers(0, 6)))
        ]
        p = p[: max(1, min(40, slots - 1))]
        mt = int(rng.integers(1, max(1, min(24, slots - len(p) + 1, MAX_MODEL_LEN - len(p))) + 1))
        specs.append(
            Spec(
                no=no,
                arrive=int(rng.integers(0, 30)),
                prompt=p,
                max_tokens=mt,
                ignore_eos=bool(rng.random() < 0.7),
                abort_at=int(rng.integers(0, 60)) if rng.random() < 0.1 else None,
            )
        )
    cfg = dict(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_model_len=MAX_MODEL_LEN,
        eos_token_id=EOS,
        watermark_blocks=draw(st.integers(0, 2)),
        preemption_policy=draw(st.sampled_from(list(PreemptionPolicy))),
        max_preemptions=draw(st.integers(0, 3)),
        headroom_steps=draw(st.sampled_from([0, 4])),
    )
    return {
        "cfg": cfg,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "align": align,
        "tail": draw(st.integers(1, 6)),
    }, specs


@given(w=workloads(), async_mode=st.booleans())
def test_shared_prefix_admissions_never_write_shared_blocks(w, async_mode) -> None:
    params, specs = w
    pool = PagedKVPool(params["num_blocks"], params["block_size"])
    sched = Scheduler(pool, SchedulerConfig(async_mode=async_mode, **params["cfg"]))
    sched.set_prefix_sharing(params["align"], params["tail"])
    mem = Memory(pool, specs, params["align"], params["tail"])
    res = drive(sched, specs, lag=1 if async_mode else 0, on_plan=mem.on_plan)
    assert not res.max_steps_hit
    oracle = Oracle(specs)
    for f in res.finished:
        want, why = oracle.expected(f.request_id, sched.config.engine_type)
        got = list(f.output_token_ids)
        assert got == want[: len(got)] and (
            f.finish_reason.name == "ABORT" or (got == want and f.finish_reason is why)
        )
    assert {f.request_id for f in res.finished} == {s.rid for s in specs}
    assert pool.num_free_blocks == params["num_blocks"] - 1 and pool.impl.num_seqs == 0
    pool.check_invariants()


def _sched(num_blocks: int, bs: int, **kw) -> tuple[PagedKVPool, Scheduler, PrefixIndex]:
    pool = PagedKVPool(num_blocks, bs)
    sched = Scheduler(pool, SchedulerConfig(max_model_len=MAX_MODEL_LEN, **kw))
    return pool, sched, PrefixIndex(pool)


def _req(rid: str, prompt: list[int], n: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def test_a_hit_shares_the_blocks_of_a_running_request() -> None:
    bs = 4
    pool, sched, index = _sched(40, bs, max_num_seqs=4, prefill_attempt_interval=0)
    sched.set_prefix_sharing(bs, 3)
    prompt = list(range(1, 23))  # 22 tokens
    sched.add_request(_req("a", prompt))
    plan = sched.schedule()
    a = int(plan.seq_ids[0])
    assert plan.cached.tolist() == [0] and plan.start.tolist() == [0]
    index.insert(prompt[:20], pool.block_table(a)[:5])  # the engine publishes the computed whole blocks
    sched.update(plan, [7])
    free = pool.num_free_blocks
    sched.add_request(_req("b", [*prompt, 9, 9]))
    plan = sched.schedule()
    assert plan.step_type is StepType.PREFILL
    b = int(plan.seq_ids[0])
    # b knows 24 tokens: cap (24 - 3) // 4 * 4 = 20, all published by a
    assert plan.cached.tolist() == [20] and plan.start.tolist() == [20] and plan.num_tokens.tolist() == [4]
    tb, ta = pool.block_table(b), pool.block_table(a)
    assert tb[:5].tolist() == ta[:5].tolist() and len(tb) == 6
    assert [pool.refcount(int(x)) for x in tb[:5]] == [2] * 5
    assert pool.refcount(int(tb[5])) == 1
    assert free - pool.num_free_blocks == 1  # only b's private block was taken (not 6)
    sched.update(plan, [5])
    assert sched.abort("a") and sched.abort("b")
    sched.update(sched.schedule(), [])
    assert pool.num_free_blocks == 39 and all(pool.refcount(int(x)) == 0 for x in tb)
    pool.check_invariants()


def test_admission_revives_its_cached_prefix_instead_of_evicting_it() -> None:
    # a pool with room for exactly one request: b's fresh blocks would have to come from a's cached
    # ones; sharing revives the hit first, so b still hits
    bs = 4
    prompt = list(range(1, 30))  # 29 tokens, 8 blocks with its 3 output slots
    pool, sched, index = _sched(9, bs, max_num_seqs=2)
    sched.set_prefix_sharing(2 * bs, 5)
    sched.add_request(_req("a", prompt))
    for _ in range(8):
        plan = sched.schedule()
        if plan.step_type is StepType.PREFILL:
            index.insert(prompt[:28], pool.block_table(int(plan.seq_ids[0]))[:7])
        sched.update(plan, [3] * plan.num_rows)
    assert not sched.has_unfinished() and index.num_evictable_blocks == 7
    sched.add_request(
        _req("b", [*prompt[:25], 1, 1, 1])
    )  # 28 tokens, 31 with its output: 8 blocks, all there are
    plan = sched.schedule()
    assert plan.cached.tolist() == [
        16
    ]  # (28 - 5) // 8 * 8: 4 blocks revived, 3 fresh (2 of a's tail evicted)
    assert [pool.refcount(int(x)) for x in pool.block_table(int(plan.seq_ids[0]))] == [1] * 7  # its 28 tokens
    pool.check_invariants()


def test_preempted_request_rehits_its_own_prefix() -> None:
    # two requests whose prompts fit but whose growth does not: one is preempted and, re-admitted,
    # starts on its own published blocks (prompt + the output kept)
    bs = 2
    pool, sched, index = _sched(12, bs, max_num_seqs=2, preemption_policy=PreemptionPolicy.DEEPINFER)
    sched.set_prefix_sharing(bs, 1)
    prompts = {"a": list(range(1, 9)), "b": list(range(20, 28))}
    for rid, p in prompts.items():
        sched.add_request(_req(rid, p, n=12))
    rehit: list[tuple[str, int]] = []
    preempted: set[str] = set()
    for _ in range(200):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        preempted.update(plan.preempted)
        for i, rid in enumerate(plan.request_ids):
            if plan.cached[i] > 0:
                assert rid in preempted
                rehit.append((rid, int(plan.cached[i])))
            full = (int(plan.start[i]) + int(plan.num_tokens[i])) // bs * bs
            known = prompts[rid] + sched.output_token_ids(rid)
            if full <= len(known):  # publish what the row computed (the engine does it after the step)
                index.insert(known[:full], pool.block_table(int(plan.seq_ids[i]))[: full // bs])
        sched.update(plan, [5] * plan.num_rows)
    assert preempted, "the small pool must preempt"
    assert rehit  # (how much depends on what the survivor's growth evicted of its released tail)
    assert pool.num_free_blocks == 11
    pool.check_invariants()


def test_set_prefix_sharing_validation() -> None:
    _, sched, _ = _sched(8, 4)
    with pytest.raises(ValueError, match="align"):
        sched.set_prefix_sharing(6, 1)
    with pytest.raises(ValueError, match="align"):
        sched.set_prefix_sharing(-4, 1)
    with pytest.raises(ValueError, match="tail"):
        sched.set_prefix_sharing(4, 0)
    with pytest.raises(ValueError, match="align"):
        sched.set_prefix_sharing(True, 1)
    sched.set_prefix_sharing(0, 1)  # off
    with pytest.raises(ValueError, match=r"SchedulerConfig\.prefix_tail"):
        SchedulerConfig(prefix_align=4, prefix_tail=0)
    # the setting travels with the config (a scheduler rebuilt from it shares too)
    sched.set_prefix_sharing(8, 3)
    assert (sched.config.prefix_align, sched.config.prefix_tail) == (8, 3)
    again = Scheduler(sched.pool, sched.config)
    assert (again.config.prefix_align, again.config.prefix_tail) == (8, 3)
