"""The asynchronous overlap (engine/overlap.py): step N+1 launched before step N's tokens are read, its
placeholder inputs fed from step N's device tensor (CPU tensors on the reference backend: the same path).

Oracle: the same requests on a synchronous engine (``async_scheduling=False``: every step's tokens read
before the next is planned), float64 with raw KV so that batch composition cannot change a token. Also the
executor alone: a step fed from a device tensor equals the same step given the host tokens (logits, the
Engram rows hashed on the device, the host token ring once resolved).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.device_tokens import DeviceTokens, TokenFeed
from deepinfer_core.engine import LLMEngine
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.model import ForwardBatch, ModelExecutor
from deepinfer_core.model.checkpoint import load_model
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_kernels import get_backend
from tests.deepinfer_core.engine.helpers import drain

EXACT = {"model": "tiny-random", "seed": 11, "dtype": "float64", "quantize": False}


def engine(**kw) -> LLMEngine:
    base = dict(num_blocks=256, block_size=8, max_num_seqs=8, **EXACT)
    return LLMEngine(EngineConfig(**{**base, **kw}))


@functools.cache
def sync_engine() -> LLMEngine:
    return engine(async_scheduling=False, num_blocks=512, max_num_seqs=16)


def reference(reqs: list[tuple[str, list[int], SamplingParams]]) -> dict:
    eng = sync_engine()
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    return {k: (o.token_ids, o.finish_reason, o.text) for k, o in drain(eng).items()}


def all_free(eng: LLMEngine) -> None:
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs
    assert eng.num_live == 0 and len(eng.requests.seqs) == 0
    assert not eng.executor.state.fed  # every device-fed ring entry was resolved


def workload(seed: int, n: int, sampled: bool, **extra) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))]
        temp = 0.9 if sampled and rng.random() < 0.7 else 0.0
        sp = SamplingParams(
            temperature=temp,
            seed=rng.randrange(2**31),
            max_tokens=rng.randint(1, 14),
            ignore_eos=rng.random() < 0.5,
            **extra,
        )
        out.append((f"r{i}", prompt, sp))
    return out


def run(eng: LLMEngine, reqs: list) -> dict:
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    done = drain(eng)
    assert all(o.ok for o in done.values()), [o.error for o in done.values() if not o.ok]
    return {k: (o.token_ids, o.finish_reason, o.text) for k, o in done.items()}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({}, id="ample"),
        pytest.param({"num_blocks": 14, "max_num_seqs": 4}, id="preempting"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked"),
        pytest.param({"batch_invariant": True}, id="batch-invariant"),
    ],
)
def test_overlap_equals_sync(sampled: bool, limits: dict) -> None:
    reqs = workload(3 + sampled, 10, sampled)
    eng = engine(**limits)
    assert eng.step_mode == "overlap"
    got = run(eng, reqs)
    assert got == reference(reqs)
    assert (
        eng.stats.overlap_steps > eng.stats.steps // 2
    )  # most steps launched ahead of the previous one's read
    assert eng.stats.host_wait_steps == 0
    all_free(eng)


def test_preemption_is_exercised() -> None:
    """The tight pool really preempts requests whose rows are in flight (else the case above proves nothing)."""
    reqs = [
        (
            rid,
            p + [7] * 12,
            SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=24, ignore_eos=True),
        )
        for rid, p, sp in workload(3, 8, True)
    ]
    eng = engine(num_blocks=12, max_num_seqs=4)
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    done = drain(eng)
    assert sum(o.num_preemptions for o in done.values()) > 0
    assert {k: (o.token_ids, o.finish_reason, o.text) for k, o in done.items()} == reference(reqs)
    all_free(eng)


def test_overlap_equals_plain_async_and_off_switch() -> None:
    reqs = workload(9, 8, True)
    on, off = engine(), engine(async_overlap=False)
    assert on.step_mode == "overlap" and off.step_mode == "async"
    assert run(on, reqs) == run(off, reqs)
    assert off.stats.overlap_steps == 0


def test_stops_min_tokens_eos_and_one_token() -> None:
    """Stop strings and stop ids (checked on the host one step late), min_tokens bans (counted at launch),
    EOS, max_tokens=1: each request ends where the synchronous engine ends it; later rows launched for it
    are dropped."""
    eos = sync_engine().tokenizer.eos_token_id
    rng = random.Random(1)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 20))]
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=1)
        elif kind == 1:
            sp = SamplingParams(
                temperature=0.8, seed=i, max_tokens=20, stop=["e", "a", " "], min_tokens=rng.randint(0, 3)
            )
        elif kind == 2:
            sp = SamplingParams(
                temperature=0.8, seed=i, max_tokens=20, stop_token_ids=tuple(range(60, 140)), min_tokens=2
            )
        else:
            sp = SamplingParams(temperature=1.5, seed=i, max_tokens=20, stop_token_ids=(eos,))
        reqs.append((f"s{i}", prompt, sp))
    got = run(engine(), reqs)
    assert got == reference(reqs)
    assert any(0 < len(t) < 20 for t, _, _ in got.values())  # some ended early: stops really fired


def test_aborts_mid_flight() -> None:
    """Requests aborted while a step with their rows is in flight (and while their next row is planned):
    each is reported once, as an abort, its tokens a prefix of its full stream; the others are unaffected;
    every block and slot comes back."""
    reqs = workload(7, 8, True)
    for i, (rid, p, sp) in enumerate(reqs):
        reqs[i] = (
            rid,
            p,
            SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=12, ignore_eos=True),
        )
    want = reference(reqs)
    eng = engine()
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    done: dict = {}
    aborted = {"r1": 2, "r4": 4, "r6": 5}  # request -> the step after which it is aborted
    for k in range(500):
        if not eng.has_unfinished():
            break
        for o in [o for o in eng.step() if o.finished]:
            assert o.request_id not in done
            done[o.request_id] = o
        for rid, at in aborted.items():
            if at == k:
                assert eng.abort(rid)
    assert set(done) == set(want)
    for rid, o in done.items():
        if rid in aborted:
            assert o.finish_reason == "abort"
            assert list(o.token_ids) == list(want[rid][0][: len(o.token_ids)])
        else:
            assert (o.token_ids, o.finish_reason) == want[rid][:2]
    all_free(eng)


def test_failed_step_fails_its_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that raises fails its batch alone; so does an in-flight step whose tokens cannot be read
    (a device error surfacing at the wait). Later requests are served as by a clean engine."""
    eng = engine(max_num_seqs=4)
    real = eng.executor.execute
    calls = {"n": 0}

    def flaky(batch, **kw):  # the 3rd executor call blows up
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real(batch, **kw)

    monkeypatch.setattr(eng.executor, "execute", flaky)
    g = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], g)
    eng.add_request("b", [8, 9], g)
    done = drain(eng)
    assert {o.finish_reason for o in done.values()} == {"error"}
    assert all("injected device fault" in (o.error or "") for o in done.values())
    all_free(eng)
    monkeypatch.undo()
    real_host = DeviceTokens.host
    calls["n"] = 0

    def bad_host(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected wait fault")
        return real_host(self)

    monkeypatch.setattr(DeviceTokens, "host", bad_host)
    eng.add_request("c", [5, 6, 7], g)
    (c,) = drain(eng).values()
    assert c.finish_reason == "error" and "injected wait fault" in c.error
    monkeypatch.undo()
    all_free(eng)
    eng.add_request("d", [5, 6, 7], g)
    (d,) = drain(eng).values()
    assert d.ok and list(d.token_ids) == list(reference([("d", [5, 6, 7], g)])["d"][0])
    all_free(eng)


STRUCTURED = [
    {"regex": "[a-c]{3,5}"},
    {"regex": "(ab|cd)[0-9]{2}x?"},
    {"choice": ["yes", "no", "maybe"]},
    {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
]


def structured_workload(seed: int, n: int, sampled: bool) -> list[tuple[str, list[int], SamplingParams]]:
    """Plain requests and structured ones (regex, choice, JSON schema; ignore_eos on some, so a grammar
    that accepted its end runs into its dead end), greedy and seeded."""
    rng = random.Random(seed)
    reqs = workload(seed, n, sampled)
    for i in range(n):
        sp = SamplingParams(
            temperature=0.9 if sampled and rng.random() < 0.7 else 0.0,
            seed=rng.randrange(2**31),
            max_tokens=rng.randint(2, 24),
            ignore_eos=rng.random() < 0.3,
            so_args=rng.choice(STRUCTURED),
        )
        reqs.append((f"s{i}", [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))], sp))
    rng.shuffle(reqs)
    return reqs


def spy_overlap(eng: LLMEngine) -> list[bool]:
    """Record ``overlap`` of every step with a structured row launched behind a step in flight."""
    real, seen = eng.runner.run, []

    def spy(plan, prev=None, overlap=False, land_early=None):
        s = eng.requests.seqs
        if prev is not None and s.structured[s.ix(plan.seq_ids)].any():
            seen.append(overlap)
        return real(plan, prev, overlap, land_early)

    eng.runner.run = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_structured_rows_overlap(sampled: bool) -> None:
    """A step with structured rows launches behind the step in flight and lands it before it samples:
    the tokens, texts and finish reasons equal the synchronous engine's; nothing waits on the host."""
    pytest.importorskip("xgrammar")
    reqs = structured_workload(5 + sampled, 6, sampled)
    eng = engine()
    seen = spy_overlap(eng)
    got = run(eng, reqs)
    assert got == reference(reqs)
    assert seen and all(seen)
    assert eng.stats.host_wait_steps == 0
    assert eng.stats.overlap_steps > eng.stats.steps // 2
    all_free(eng)


class FaultyGrammars:
    """A grammar manager proxy that fails on chosen grammar states (request id, tokens taken so far), the
    same way whatever the step order: ``fill`` raises while building a mask, ``dead`` reports a dead end,
    ``advance`` raises when the token is taken."""

    def __init__(self, real, fill: set, dead: set, advance: set) -> None:
        self.real, self.fill, self.dead, self.adv = real, fill, dead, advance
        self.taken: dict = {}

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def fill_bitmask(self, batch, out=None):
        keys = [(rid, self.taken.get(rid, 0)) for rid, _ in batch]
        if any(k in self.fill for k in keys):
            raise RuntimeError("injected fill failure")
        m = self.real.fill_bitmask(batch, out)
        hit = np.array([k in self.dead for k in keys])
        if hit.any():
            m.bitmask[torch.as_tensor(np.flatnonzero(hit))] = 0
            m = type(m)(m.bitmask, m.offsets, m.num_drafts, np.asarray(m.dead_end) | hit)
        return m

    def advance(self, rid, tokens):
        k = (rid, self.taken.get(rid, 0))
        self.taken[rid] = k[1] + len(tokens)
        if k in self.adv:
            raise RuntimeError("injected advance failure")
        return self.real.advance(rid, tokens)

    def finish_reason(self, rid):
        why = self.real.finish_reason(rid)
        return "grammar_dead_end" if why is None and any(k[0] == rid for k in self.dead) else why


def test_structured_faults_overlap_equal_sync() -> None:
    """Grammar failures and dead ends under the overlap fail or end exactly the requests they hit, at the
    same token as on a synchronous engine; the others complete unchanged."""
    pytest.importorskip("xgrammar")
    reqs = structured_workload(9, 5, False)
    rids = [rid for rid, _, sp in reqs if sp.so_args]
    faults = {"fill": {(rids[0], 2)}, "dead": {(rids[1], 1)}, "advance": {(rids[2], 3)}}

    def faulty(eng: LLMEngine) -> dict:
        eng.grammars.get()
        real = eng.grammars.manager
        eng.grammars.manager = FaultyGrammars(real, **faults)  # type: ignore[assignment]
        try:
            for rid, p, sp in reqs:
                eng.add_request(rid, p, sp)
            return {k: (o.token_ids, o.finish_reason, o.error) for k, o in drain(eng).items()}
        finally:
            eng.grammars.manager = real

    want = faulty(engine(async_scheduling=False))
    eng = engine()
    seen = spy_overlap(eng)
    got = faulty(eng)
    assert got == want
    assert seen and all(seen)
    hit = {rid for rid, (_, _, err) in got.items() if err is not None}
    assert hit == set(rids[:3]), got  # each fault ends its own request, and only it
    all_free(eng)


def test_host_engram_tables_turn_the_overlap_off() -> None:
    model, _ = load_model("tiny-random", seed=11, dtype=torch.float64, device="cpu")
    assert model.cfg.engram_layer_ids  # the tiny model has Engram layers: the feed hashes on the device
    assert ModelExecutor(model, 32, 8, 4, quantize=False, draft_context=False).token_feed_ok
    assert not ModelExecutor(
        model, 32, 8, 4, quantize=False, draft_context=False, engram_placement="host"
    ).token_feed_ok
    assert not ModelExecutor(
        model, 32, 8, 4, quantize=False
    ).token_feed_ok  # a drafter context reads host tokens
    with pytest.raises(ValueError, match="feed"):
        ex = ModelExecutor(model, 32, 8, 4, quantize=False, draft_context=False, engram_placement="host")
        b = ForwardBatch(
            token_ids=np.asarray([5]),
            query_lens=[1],
            start_pos=[0],
            block_tables=np.asarray([[1]]),
            state_slots=[0],
            num_logits=[1],
        )
        ex.execute(
            b, feed=TokenFeed(np.zeros(1, np.int64), np.zeros(1, np.int64), DeviceTokens(torch.tensor([7])))
        )


@pytest.mark.parametrize("sync_free", [False, True], ids=["plain", "sync-free-rows"])
def test_executor_feed_equals_host_tokens(sync_free: bool) -> None:
    """Two executors run the same prefill and three decode steps; one gets the decode tokens as host ids, the
    other as placeholders fed from a 'previous step' tensor: same logits, same token ring once resolved.
    ``sync-free-rows``: the cuda backend's decode path (decode_step.execute_rows) forced on over the
    reference backend's ops on the CPU."""
    model, _ = load_model("tiny-random", seed=11, dtype=torch.float64, device="cpu")
    be = get_backend("reference") if sync_free else None
    exs = [ModelExecutor(model, 32, 8, 4, quantize=False, draft_context=False, backend=be) for _ in range(2)]
    for ex in exs:
        ex.sync_free = sync_free
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n) for n in (5, 9, 3)]
    tables = np.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    pre = ForwardBatch(
        token_ids=np.concatenate(prompts),
        query_lens=[len(p) for p in prompts],
        start_pos=[0, 0, 0],
        block_tables=tables,
        state_slots=[0, 1, 2],
        num_logits=[1, 1, 1],
    )
    for ex in exs:
        ex.execute(pre)
    pos = np.asarray([len(p) for p in prompts])
    for step in range(3):
        toks = rng.integers(3, 250, size=3)
        b = ForwardBatch(
            token_ids=toks,
            query_lens=[1, 1, 1],
            start_pos=pos,
            block_tables=tables,
            state_slots=[0, 1, 2],
            num_logits=[1, 1, 1],
        )
        want = exs[0].execute(b).logits
        src = torch.as_tensor(np.concatenate(([9, 9], toks[::-1], [4])))  # the previous step's rows, shuffled
        fed = np.asarray([0, 2]) if step != 1 else np.asarray([1])  # some tokens fed, the others host ids
        host_ids = toks.copy()
        host_ids[fed] = 0
        feed = TokenFeed(fed.astype(np.int64), (4 - fed).astype(np.int64), DeviceTokens(src))
        bf = ForwardBatch(
            token_ids=host_ids,
            query_lens=[1, 1, 1],
            start_pos=pos,
            block_tables=tables,
            state_slots=[0, 1, 2],
            num_logits=[1, 1, 1],
        )
        got = exs[1].execute(bf, feed=feed).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert exs[1].state.fed  # its ring holds placeholders until resolved
        exs[1].resolve_fed()
        np.testing.assert_array_equal(exs[1].state.tokens, exs[0].state.tokens)
        pos = pos + 1


action = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 10**6)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=12, deadline=None)
@given(actions=st.lists(action, min_size=1, max_size=25), tight=st.booleans())
def test_random_interleavings(actions: list, tight: bool) -> None:
    """Random add / abort / step interleavings on an overlapping engine: every request is reported
    exactly once; one never aborted has the synchronous engine's tokens, an aborted one a prefix of them."""
    eng = engine(num_blocks=16 if tight else 256, max_num_seqs=3)
    added: dict = {}
    done: dict = {}
    aborted: set = set()

    def step() -> None:
        for o in [o for o in eng.step() if o.finished]:
            assert o.request_id not in done, f"{o.request_id} reported twice"
            done[o.request_id] = o

    for kind, v in actions:
        if kind == "add":
            rng = random.Random(v)
            rid = f"q{len(added)}"
            p = [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))]
            sp = SamplingParams(
                temperature=rng.choice([0.0, 1.0]), seed=v, max_tokens=rng.randint(1, 10), ignore_eos=True
            )
            added[rid] = (p, sp)
            eng.add_request(rid, p, sp)
        elif kind == "abort" and added:
            rid = f"q{v % len(added)}"
            if eng.abort(rid):
                aborted.add(rid)
        else:
            for _ in range(v):
                step()
    while eng.has_unfinished():
        step()
    assert set(done) == set(added)
    want = reference([(rid, p, sp) for rid, (p, sp) in added.items()])
    for rid, o in done.items():
        if rid in aborted and o.finish_reason == "abort":
            assert list(o.token_ids) == list(want[rid][0][: len(o.token_ids)])
        else:
            assert o.ok and (o.token_ids, o.finish_reason) == want[rid][:2], rid
    all_free(eng)


@pytest.mark.gpu
def test_cuda_overlap_equals_sync() -> None:
    """On the cuda backend (float64 raw KV, eager sync-free decode steps): the overlap's tokens equal the
    synchronous engine's, stops and aborted-early rows included."""
    from deepinfer_core.envs import Envs

    kw = dict(
        model="tiny-random",
        seed=5,
        dtype="float64",
        quantize=False,
        num_blocks=256,
        block_size=8,
        max_num_seqs=8,
        backend="cuda",
    )
    reqs = workload(4, 8, True) + [
        (f"t{i}", [5 + i, 6, 7], SamplingParams(temperature=0.8, seed=i, max_tokens=16, stop=["e", " "]))
        for i in range(3)
    ]
    envs = Envs(use_nextn_decode=0, cuda_graphs=False)
    want = run(LLMEngine(EngineConfig(async_scheduling=False, **kw), envs=envs), reqs)
    eng = LLMEngine(EngineConfig(**kw), envs=envs)
    assert run(eng, reqs) == want
    assert eng.stats.overlap_steps > eng.stats.steps // 2
    all_free(eng)


@pytest.mark.gpu
def test_cuda_overlap_with_graphs_equals_plain_async() -> None:
    """The shipped tiny model (float32, quantised caches, Engram rows hashed on the device) with decode
    graphs replayed: the overlap feeds each replay's static token buffer from the previous step's tokens on
    the device; same tokens as the same engine without the overlap (the same batches: ignore_eos, no stops)."""
    from deepinfer_core.envs import Envs

    prompts = [[random.Random(i).randrange(3, 250) for _ in range(20 + 7 * i)] for i in range(6)]
    sp = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(6)
    ]
    reqs = [(f"g{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sp))]
    outs = {}
    for ov in (False, True):
        eng = LLMEngine(
            EngineConfig(backend="cuda", num_blocks=128, max_num_seqs=8, async_overlap=ov),
            envs=Envs(use_nextn_decode=0, cuda_graphs=True),
        )
        outs[ov] = run(eng, reqs)
        g = eng.executor.graphs()
        assert not g.failed and g.replays >= 8
        assert (eng.stats.overlap_steps > 0) == ov
        all_free(eng)
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_cuda_overlap_steady_state_never_synchronises() -> None:
    """Steady-state decode steps of the overlap (after the graphs are captured) make no synchronising CUDA
    call (torch's sync debug mode): the host only waits on the previous step's event."""
    import warnings

    from deepinfer_core.envs import Envs

    eng = LLMEngine(
        EngineConfig(backend="cuda", num_blocks=128, max_num_seqs=8), envs=Envs(use_nextn_decode=0)
    )
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"w{i}", [5 + i] * 30, sp)
    for _ in range(12):  # prefill, the first decode steps, graph capture
        eng.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(20):
                eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, syncs[:3]
    eng.abort_all()
    drain(eng)


@functools.cache
def _hasher_model():
    model, _ = load_model("tiny-random", seed=11, dtype=torch.float64, device="cpu")
    return model


def _oracle_ids(h, toks: np.ndarray, cu: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """The per-token Python-int hash (tests/deepinfer_core/engram/_oracle.py) as int32 [L, T, columns]."""
    from tests.deepinfer_core.engram._oracle import oracle_hash

    seqs = [(int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]  # (the model's map is the identity)
    got = oracle_hash(
        toks.tolist(),
        seqs,
        h.multipliers.tolist(),
        h.primes.tolist(),
        h.offsets.tolist(),
        h.pad_canonical,
        None,
        ctx.tolist(),
    )
    return np.asarray(got, np.int32).reshape(len(h.config.layer_ids), len(toks), h.config.num_columns)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 6), min_size=1, max_size=40), seed=st.integers(0, 2**31))
def test_device_hash_equals_the_hasher(lens: list, seed: int) -> None:
    """The overlap's sync-free hashes (``EngramHasher.hash(validate=False)`` for fed prefill / verify steps,
    ``decode_step.hash_decode_on_device`` for decode steps) give the oracle's, hash_host's and the
    validated hash's row ids: packed sequences, context ids and -1 (before the sequence start)."""
    from deepinfer_core.model.engram_context import hash_decode_on_device

    h = _hasher_model().engram_hasher
    rng = np.random.default_rng(seed)
    vocab = _hasher_model().cfg.vocab_size
    toks = rng.integers(0, vocab, size=sum(lens))
    cu = np.concatenate(([0], np.cumsum(lens)))
    ctx = rng.integers(-1, vocab, size=(len(lens), h.config.max_ngram - 1))
    want = _oracle_ids(h, toks, cu, ctx)
    np.testing.assert_array_equal(h.hash_host(toks, cu, ctx), want)
    args = (torch.as_tensor(toks), torch.as_tensor(cu), torch.as_tensor(ctx))
    np.testing.assert_array_equal(h.hash(*args, validate=False).numpy(), want)
    np.testing.assert_array_equal(h.hash(*args).numpy(), want)
    # a decode step (one token per row): the host-reduced context path
    ones = np.arange(len(lens) + 1)
    want1 = _oracle_ids(h, toks[: len(lens)], ones, ctx)
    np.testing.assert_array_equal(h.hash_host(toks[: len(lens)], ones, ctx), want1)
    np.testing.assert_array_equal(
        hash_decode_on_device(h, torch.as_tensor(toks[: len(lens)]), ctx).numpy(), want1
    )


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_unchecked_row_fetch_equals_the_table(fmt: str) -> None:
    """The overlap's check-free Engram fetch (``hashed_row_tables``: ``LocalEngramTable.fetch(check=False)``)
    returns the table's own rows and the rows read one by one (bf16 and fp8 storage)."""
    from deepinfer_core.engram.tables import LocalEngramTable, quantize_fp8
    from deepinfer_core.model.engram_context import hashed_row_tables

    g = torch.Generator().manual_seed(3)
    vals = torch.randn(97, 64, generator=g)
    t = LocalEngramTable.from_values(vals, fmt)
    ids = torch.randint(0, 97, (3, 11, 4), generator=g)
    (wrapped,) = hashed_row_tables({0: t}).values()
    assert wrapped is not t
    got = wrapped.fetch(ids)
    torch.testing.assert_close(got, t.fetch(ids), rtol=0, atol=0)
    if fmt == "bf16":
        rows = [vals[i].to(torch.bfloat16) for i in ids.reshape(-1).tolist()]
    else:
        data, codes = quantize_fp8(vals)
        rows = [
            torch.cat(
                [data[i, b * 32 : (b + 1) * 32].double() * 2.0 ** (int(codes[i, b]) - 127) for b in range(2)]
            ).to(torch.bfloat16)
            for i in ids.reshape(-1).tolist()
        ]
    assert torch.equal(got, torch.stack(rows).reshape(3, 11, 4, 64))
    with pytest.raises(IndexError, match="row_ids: id 97"):  # the table itself still checks
        t.fetch(torch.tensor([97]))
    other = object()
    assert hashed_row_tables({1: other})[1] is other  # a table of another kind keeps its own fetch


def test_device_hash_and_fetch_dispatch_no_syncing_op() -> None:
    """The executor's Engram path of a fed step (device hash, check-free fetch) dispatches no op that
    synchronises on CUDA (``.item()`` / ``bool()`` -> ``_local_scalar_dense``, ``nonzero``...): counted by
    a dispatch mode on the CPU; the validated hash and the checked fetch have some (the counter can fail)."""
    from deepinfer_core.model.engram_context import hash_decode_on_device, hashed_row_tables
    from tests.deepinfer_core.model.test_cuda_graphs import SyncOps

    model = _hasher_model()
    h = model.engram_hasher
    rng = np.random.default_rng(5)
    v, n1 = model.cfg.vocab_size, h.config.max_ngram - 1
    toks, cu, ctx = (
        torch.as_tensor(rng.integers(0, v, 9)),
        torch.tensor([0, 4, 9]),
        torch.as_tensor(rng.integers(-1, v, (2, n1))),
    )
    ctx1 = rng.integers(-1, v, (9, n1))
    tables = hashed_row_tables(model.engram_tables)
    h.device_params("cpu", torch.int64)  # the once-per-device parameter copies, outside the count
    with SyncOps() as counter:
        ids = h.hash(toks, cu, ctx, validate=False)
        rows = model.engram_fetch(ids, tables)
        rows1 = model.engram_fetch(hash_decode_on_device(h, toks, ctx1), tables)
    assert not counter.hits, counter.hits
    want = model.engram_fetch(h.hash(toks, cu, ctx))
    assert rows.keys() == want.keys() and all(torch.equal(rows[k], want[k]) for k in want)
    want1 = model.engram_fetch(torch.from_numpy(h.hash_host(toks.numpy(), np.arange(10), ctx1)))
    assert all(torch.equal(rows1[k], want1[k]) for k in want1)
    for checked in (lambda: h.hash(toks, cu, ctx), lambda: model.engram_fetch(ids)):
        with SyncOps() as c:
            checked()
        assert c.hits
