"""Engine reliability: aborts and engine-ended requests at full occupancy, recovery after a failed step,
``reset`` / ``abort_all``, threads, prompt shapes, grammar-library limits."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from deepinfer_core.engine import LLM, LLMEngine
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import drain

MODES = {
    "sync": dict(async_scheduling=False),
    "async": dict(async_scheduling=True),
    "spec": dict(speculative=True, num_speculative_tokens=2),
}
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def _all_free(eng: LLMEngine) -> None:
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs
    assert eng.num_live == 0 and len(eng.requests.seqs) == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_abort_at_full_occupancy_admits_waiting(mode: str) -> None:
    """Every seat taken, requests waiting: aborting running requests (one per step, several rounds) must
    hand the state slot back before the scheduler gives the seat away."""
    eng = LLM(model="tiny-random", seed=1, num_blocks=64, block_size=8, max_num_seqs=2, **MODES[mode]).engine
    rng = random.Random(5)
    for i in range(8):
        eng.add_request(
            f"r{i}", [rng.randrange(3, 259) for _ in range(rng.randint(2, 12))], {**GREEDY, "max_tokens": 12}
        )
    done: dict = {}
    for i in range(0, 8, 2):
        done.update({o.request_id: o for o in eng.step() if o.finished})
        done.update({o.request_id: o for o in eng.step() if o.finished})  # both seats are taken now
        assert eng.scheduler.num_running == 2 or i >= 6
        eng.abort(f"r{i}")
        done.update(
            {o.request_id: o for o in eng.step() if o.finished}
        )  # admits a waiting one into r{i}'s seat
    done.update(drain(eng, 500))
    assert len(done) == 8 and all(o.ok for o in done.values()), [o.error for o in done.values()]
    assert {r for r, o in done.items() if o.finish_reason == "abort"} >= {"r0", "r2", "r4"}
    _all_free(eng)


@pytest.mark.parametrize("mode", list(MODES))
def test_grammar_end_under_ignore_eos_at_full_occupancy(mode: str) -> None:
    pytest.importorskip("xgrammar")
    eng = LLM(model="tiny-random", seed=2, num_blocks=64, block_size=8, max_num_seqs=2, **MODES[mode]).engine
    for i in range(6):  # each ends itself (the grammar accepts "ab") while others wait for its seat
        eng.add_request(
            f"g{i}",
            [5, 6, 7 + i],
            {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, "so_args": {"choice": ["ab"]}},
        )
        eng.add_request(f"p{i}", [9, 10 + i], GREEDY)
    done = drain(eng, 500)
    assert len(done) == 12
    for i in range(6):
        g, p = done[f"g{i}"], done[f"p{i}"]
        assert g.ok and g.finish_reason == "stop" and g.text == "ab", g
        assert p.ok and p.finish_reason == "length" and len(p.token_ids) == 6, p
    _all_free(eng)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_step_fails_its_batch_only(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error inside a step fails that step's requests (with the error), the engine keeps
    serving later requests, and their tokens equal a clean engine's."""
    llm = LLM(
        model="tiny-random",
        seed=3,
        num_blocks=64,
        block_size=8,
        max_num_seqs=4,
        batch_invariant=True,
        **MODES[mode],
    )
    eng = llm.engine
    real = eng.executor.execute
    calls = {"n": 0}

    def flaky(batch, **kw):  # the 3rd executor call blows up (kw: the async overlap's device token feed)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real(batch, **kw)

    monkeypatch.setattr(eng.executor, "execute", flaky)
    eng.add_request("a", [5, 6, 7], GREEDY)
    eng.add_request("b", [8, 9], GREEDY)
    done = drain(eng, 500)
    assert {o.finish_reason for o in done.values()} == {"error"}
    assert all("injected device fault" in (o.error or "") for o in done.values())
    _all_free(eng)
    eng.add_request("c", [5, 6, 7], GREEDY)
    (c,) = drain(eng, 500).values()
    (want,) = LLM(
        model="tiny-random",
        seed=3,
        num_blocks=64,
        block_size=8,
        max_num_seqs=4,
        batch_invariant=True,
        **MODES[mode],
    ).generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert c.ok and c.token_ids == want.token_ids
    _all_free(eng)


def test_failing_update_resets_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure the step cannot repair (the scheduler's update itself) resets the engine: every live
    request fails with the reason, every block and slot is free, and the engine serves again."""
    eng = LLM(
        model="tiny-random", seed=4, num_blocks=32, block_size=8, max_num_seqs=2, async_scheduling=False
    ).engine
    for i in range(4):
        eng.add_request(f"r{i}", [5, 6, 7 + i], GREEDY)
    eng.step()
    monkeypatch.setattr(eng.scheduler, "update", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = [o for o in eng.step() if o.finished]
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
    assert all(o.finish_reason == "error" and "boom" in o.error for o in outs)
    _all_free(eng)
    eng.add_request("again", [5, 6], GREEDY)
    assert drain(eng, 500)["again"].ok


def test_abort_all_and_reset_return_everything() -> None:
    eng = LLM(model="tiny-random", seed=5, num_blocks=32, block_size=8, max_num_seqs=2).engine
    for i in range(5):
        eng.add_request(f"r{i}", [5, 6, 7 + i], {**GREEDY, "max_tokens": 20})
    eng.step()
    eng.step()
    assert eng.abort_all() == 5
    done = drain(eng, 500)
    assert len(done) == 5 and {o.finish_reason for o in done.values()} == {"abort"}
    _all_free(eng)
    for i in range(3):
        eng.add_request(f"s{i}", [5, 6], GREEDY)
    eng.step()
    outs = eng.reset("maintenance")
    assert sorted(o.request_id for o in outs) == ["s0", "s1", "s2"] and all(
        o.error == "maintenance" for o in outs
    )
    _all_free(eng)
    assert not eng.has_unfinished()


def test_two_threads_generate_on_one_llm() -> None:
    llm = LLM(model="tiny-random", seed=6, num_blocks=128, block_size=8, max_num_seqs=4, batch_invariant=True)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    got: dict = {}
    errors: list = []

    def worker(k: int) -> None:
        try:
            got[k] = [o.token_ids for o in llm.generate(prompts[k::2], GREEDY, use_tqdm=False)]
        except Exception as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and got[0] == want[0::2] and got[1] == want[1::2]
    _all_free(llm.engine)


def test_front_end_thread_adds_and_aborts_while_loop_steps() -> None:
    eng = LLM(model="tiny-random", seed=7, num_blocks=64, block_size=8, max_num_seqs=3).engine
    n = 40
    stop = threading.Event()
    done: dict = {}

    def loop() -> None:
        while not stop.is_set() or eng.has_unfinished():
            for o in [o for o in eng.step() if o.finished]:
                done[o.request_id] = o

    t = threading.Thread(target=loop)
    t.start()
    rng = random.Random(0)
    for i in range(n):
        eng.add_request(
            f"f{i}",
            [rng.randrange(3, 259) for _ in range(rng.randint(2, 10))],
            {**GREEDY, "max_tokens": rng.randint(1, 8)},
        )
        if i % 3 == 2:
            eng.abort(f"f{rng.randrange(i)}")
    stop.set()
    t.join(300)
    assert not t.is_alive() and len(done) == n
    assert all(o.ok for o in done.values()), [o.error for o in done.values() if not o.ok]
    _all_free(eng)


def test_prompt_shapes() -> None:
    llm = LLM(model="tiny-random", seed=8, num_blocks=64, block_size=8, max_num_seqs=4)
    ids = [5, 6, 7, 8]
    (ref,) = llm.generate([ids], GREEDY, use_tqdm=False)
    (a,) = llm.generate(np.asarray(ids, np.int32), GREEDY, use_tqdm=False)  # one prompt, not four
    rows = llm.generate(np.asarray([ids, ids], np.int64), GREEDY, use_tqdm=False)  # one per row
    (d,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # vLLM's dict form
    (t,) = llm.generate({"prompt": "hi"}, GREEDY, use_tqdm=False)
    assert a.token_ids == d.token_ids == ref.token_ids and [r.token_ids for r in rows] == [ref.token_ids] * 2
    assert t.ok and t.prompt == "hi"
    (b,) = llm.generate(b"abc", GREEDY, use_tqdm=False)  # bytes: one bad request, not token ids
    assert not b.ok and "prompt" in b.error and "bytes" in b.error
    (k,) = llm.generate({"text": "hi"}, GREEDY, use_tqdm=False)
    assert not k.ok and "prompt" in k.error
    (s,) = llm.generate(["x\ud800"], GREEDY, use_tqdm=False)
    assert not s.ok and "surrogate" in s.error
    (n,) = llm.generate([ids], {**GREEDY, "stop_token_ids": np.asarray([300, 301])}, use_tqdm=False)
    assert n.ok
    (n2,) = llm.generate([ids], SamplingParams(stop_token_ids=[np.int64(300)], max_tokens=2), use_tqdm=False)
    assert n2.ok
    _all_free(llm.engine)


def test_validation_rules() -> None:
    assert (
        SamplingParams(max_tokens=2.0).max_tokens == 2
        and type(SamplingParams(max_tokens=2.0).max_tokens) is int
    )
    assert SamplingParams(top_k=0).top_k == -1  # vLLM: 0 or -1 is off
    assert SamplingParams(temperature=1e-38).temperature == 0.01  # vLLM's floor, logged
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5
    for kw in (
        {"seed": 1.5},
        {"top_k": 5.5},
        {"stop_token_ids": [True]},
        {"max_tokens": True},
        {"temperature": float("inf")},
        {"ignore_eos": "no"},
        {"ignore_eos": None},
        {"ignore_eos": 2},
        {"top_k": 2**64},
        {"max_tokens": 2**31},
        {"stop_token_ids": 5},
    ):
        field = next(iter(kw))
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
            SamplingParams(**kw)


def test_max_tokens_none_fills_the_context() -> None:
    llm = LLM(model="tiny-random", seed=9, num_blocks=32, block_size=8, max_num_seqs=2, max_model_len=24)
    (o,) = llm.generate(
        [[5, 6, 7, 8]], {"temperature": 0.0, "ignore_eos": True, "max_tokens": None}, use_tqdm=False
    )
    assert o.ok and o.finish_reason == "length" and len(o.token_ids) == 20


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammar_library_limit_is_the_requests_error(backend: str) -> None:
    pytest.importorskip(backend)
    llm = LLM(
        model="tiny-random", seed=10, num_blocks=64, block_size=8, max_num_seqs=2, structured_backend=backend
    )
    options = [f"opt{i}" for i in range(2500)]  # past llguidance's 2,000 items per parser row
    big, plain = llm.generate(
        ["pick: ", "x"],
        [{"temperature": 0.0, "max_tokens": 8, "so_args": {"choice": options}}, GREEDY],
        use_tqdm=False,
    )
    assert plain.ok
    if backend == "llguidance":
        assert not big.ok and big.token_ids == () and "max is 2000" in big.error and "so_args" in big.error
    else:  # xgrammar serves it
        assert big.ok and big.text in options
