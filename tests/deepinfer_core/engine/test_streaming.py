"""Streamed outputs (engine/output_builder.py) and parallel sampling (SamplingParams.n).

Oracles: the same requests through ``LLM.generate`` (FINAL_ONLY, batch-invariant mode) and Python's one-shot
UTF-8 decode; invariants: deltas concatenate to the final text and tokens, cumulative outputs only grow,
one finished output per request, every block and slot free at the end.
"""

from __future__ import annotations

import codecs
import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import LLM, EngineConfig, LLMEngine
from deepinfer_core.engine.output_builder import IncrementalText
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams

CFG = dict(
    seed=3, num_blocks=96, block_size=8, max_num_seqs=4, batch_invariant=True, structured_backend="xgrammar"
)
CHARS = "ab é中😀\n"


@pytest.fixture(scope="module")
def pair() -> tuple[LLMEngine, LLM]:
    """A streaming engine and an offline reference of the same model (tiny-random: byte tokens, so a
    multi-byte character always spans several tokens)."""
    return LLMEngine(EngineConfig(model="tiny-random", **CFG)), LLM("tiny-random", **CFG)


def run_stream(eng: LLMEngine, reqs: dict[str, tuple[str, SamplingParams]]) -> dict[str, list]:
    for rid, (p, sp) in reqs.items():
        eng.add_request(rid, p, sp)
    got: dict[str, list] = {rid: [] for rid in reqs}
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            assert not (got[o.request_id] and got[o.request_id][-1].finished), (
                f"{o.request_id}: output after its end"
            )
            got[o.request_id].append(o)
    assert not eng.has_unfinished()
    return got


def all_free(eng: LLMEngine) -> None:
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1  # block 0 is the pool's null block
    assert eng.state_pool.num_free_slots == eng.state_pool.num_slots
    assert eng.num_live == 0 and eng.outputs.num_tracked == 0


@given(data=st.binary(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=12), hold=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_incremental_text_equals_one_shot_decode(data: bytes, cuts: list[int], hold: int) -> None:
    """Any bytes (invalid UTF-8 included) split into tokens anywhere: the emitted pieces concatenate to the
    one-shot decode with replacement, and no piece ends in half a character."""
    bounds = sorted({0, len(data), *[c for c in cuts if c <= len(data)]})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    table = [*pieces, b""]  # token i is piece i; the last is a control token (no bytes)
    inc = IncrementalText(table, hold=hold)
    out = [inc.feed([i, len(pieces)]) for i in range(len(pieces))]
    text = "".join(out) + inc.flush()
    assert text == data.decode("utf-8", errors="replace")
    if hold == 0:  # a complete prefix is emitted at once: at most 3 bytes of a character wait
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        assert "".join(out) == dec.decode(data)


prompts = st.text(alphabet=CHARS, min_size=1, max_size=12)
kinds = st.sampled_from(list(RequestOutputKind))


@st.composite
def request(draw: st.DrawFn) -> tuple[str, dict]:
    p = draw(prompts)
    sp: dict = dict(
        max_tokens=draw(st.integers(1, 10)),
        output_kind=draw(kinds),
        temperature=draw(st.sampled_from([0.0, 0.9])),
        seed=draw(st.integers(0, 99)),
    )
    shape = draw(st.sampled_from(["plain", "multibyte", "stop"]))
    if shape == "multibyte":  # the grammar makes the model emit multi-byte characters, byte by byte
        sp.update(so_args={"regex": "[é中😀a]{1,6}"}, max_tokens=24)
    elif shape == "stop":
        sp.update(
            stop=[draw(st.text(alphabet="ab é", min_size=1, max_size=3))],
            include_stop_str_in_output=draw(st.booleans()),
            max_tokens=12,
        )
    return p, sp


@given(reqs=st.lists(request(), min_size=1, max_size=4))
@settings(
    max_examples=int(os.environ.get("STREAM_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_streamed_outputs_match_offline(pair: tuple[LLMEngine, LLM], reqs: list[tuple[str, dict]]) -> None:
    eng, llm = pair
    before = torch.get_num_threads()
    ids = {f"r{i}": (p, SamplingParams(**sp)) for i, (p, sp) in enumerate(reqs)}
    got = run_stream(eng, ids)
    ref = llm.generate([p for p, _ in ids.values()], [sp for _, sp in ids.values()], use_tqdm=False)
    torch.set_num_threads(before)
    for (rid, (_, sp)), want in zip(ids.items(), ref):
        outs = got[rid]
        assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1]), rid
        last = outs[-1]
        assert last.finish_reason == want.finish_reason and last.error == want.error, (rid, last, want)
        kind = sp.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
            assert (last.text, last.token_ids) == (want.text, want.token_ids)
        elif kind == RequestOutputKind.DELTA:
            assert "".join(o.text for o in outs) == want.text, (rid, [o.text for o in outs], want.text)
            assert sum((o.token_ids for o in outs), ()) == want.token_ids
        else:
            for a, b in itertools.pairwise(outs):
                assert b.text.startswith(a.text) and b.token_ids[: len(a.token_ids)] == a.token_ids
            assert (last.text, last.token_ids) == (want.text, want.token_ids)
        for o in outs[:-1]:
            assert "\ufffd" not in o.text or "\ufffd" in want.text  # never half a character
        m = last.metrics
        if kind != RequestOutputKind.FINAL_ONLY and want.token_ids:
            assert m["arrival_time"] <= m["first_token_time"] <= m["last_token_time"]
        assert m["num_generated_tokens"] == len(want.token_ids) or sp.stop
    all_free(eng)


def test_multibyte_characters_split_across_tokens_stream_whole(pair: tuple[LLMEngine, LLM]) -> None:
    """Each delta is whole characters although every character here is 2-4 byte tokens."""
    eng, _ = pair
    sp = SamplingParams(
        temperature=0.9, seed=7, max_tokens=40, output_kind="delta", so_args={"regex": "[é中😀]{4,8}"}
    )
    outs = run_stream(eng, {"m": ("x", sp)})["m"]
    text = "".join(o.text for o in outs)
    assert len(text) >= 4 and set(text) <= set("é中😀")
    assert sum(len(o.token_ids) for o in outs) == len(text.encode()) + 1  # the bytes, then EOS
    assert len(outs) > 2 and all("\ufffd" not in o.text for o in outs)
    all_free(eng)


def test_parallel_sampling_equals_seeded_requests(pair: tuple[LLMEngine, LLM]) -> None:
    """n=3: one output with 3 samples; sample i is the request with seed + i; the prompt's full blocks
    come from sample 0's prefill (cached_tokens), and everything is freed."""
    eng, llm = pair
    prompt = "the same long prompt for every sample, é中 " * 2
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=8, n=3, output_kind="delta")
    outs = run_stream(eng, {"g": (prompt, sp)})["g"]
    alone = llm.generate(
        [prompt] * 3,
        [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=8) for i in range(3)],
        use_tqdm=False,
    )
    for i in range(3):
        toks = sum((s.token_ids for o in outs for s in o.samples if s.index == i), ())
        text = "".join(s.text for o in outs for s in o.samples if s.index == i)
        assert (toks, text) == (alone[i].token_ids, alone[i].text), i
    last = outs[-1]
    assert last.finished and all(not o.finished for o in outs[:-1])
    assert last.cached_tokens > 0  # samples 1, 2 took sample 0's prompt blocks from the prefix cache
    grouped = llm.generate(
        prompt, SamplingParams(temperature=0.9, seed=11, max_tokens=8, n=3), use_tqdm=False
    )[0]
    assert [s.token_ids for s in grouped.outputs] == [a.token_ids for a in alone]
    assert grouped.token_ids == alone[0].token_ids and grouped.finished
    all_free(eng)


def test_parallel_sampling_abort_frees_every_sample(pair: tuple[LLMEngine, LLM]) -> None:
    eng, _ = pair
    eng.add_request("g", "abort me please, a long enough prompt", SamplingParams(max_tokens=50, n=4, seed=1))
    eng.step()
    eng.step()
    assert eng.abort("g")
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "g"]
    assert outs[-1].finished and {s.finish_reason for s in outs[-1].samples} == {"abort"}
    assert len(outs[-1].samples) == 4
    assert not eng.abort("g")
    all_free(eng)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"n": 0}, "SamplingParams.n"),
        ({"n": 1.5}, "SamplingParams.n"),
        ({"n": 2, "best_of": 3}, "SamplingParams.best_of"),
        ({"output_kind": "sometimes"}, "SamplingParams.output_kind"),
    ],
)
def test_bad_n_best_of_and_kind_fail_alone(pair: tuple[LLMEngine, LLM], params: dict, field: str) -> None:
    eng, _ = pair
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)
    out = run_stream(eng, {"bad": ("x", params), "ok": ("y", {"max_tokens": 2})})
    assert out["bad"][-1].error.startswith(field) and out["ok"][-1].ok
    all_free(eng)


def test_engine_defaults_to_one_thread() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        eng = LLMEngine(EngineConfig(model="tiny-random", num_blocks=16, max_num_seqs=2))
        assert torch.get_num_threads() == 1 and eng.num_threads == 1
        torch.set_num_threads(2)  # changed behind the engine's back: the next step pins it again
        eng.add_request("a", "x", {"max_tokens": 1})
        eng.step()
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads"):
            LLMEngine(EngineConfig(model="tiny-random", num_blocks=16), num_threads=0)
    finally:
        torch.set_num_threads(before)


def test_parallel_samples_share_prompt_blocks_by_refcount(pair: tuple[LLMEngine, LLM]) -> None:
    """While the 3 samples run, their tables start with the same prompt blocks, each held 3 times (the
    pool's refcount); each sample's later blocks are its own (it only ever writes those)."""
    eng, _ = pair
    eng.add_request(
        "share", "the same long prompt for every sample, é中 " * 2, SamplingParams(max_tokens=6, n=3, seed=2)
    )
    seen = False
    while eng.has_unfinished():
        eng.step()
        seqs = [r.seq for r in eng.requests.reqs.values() if r.seq >= 0 and eng.kv_pool.contains(r.seq)]
        if len(seqs) == 3:
            tabs = [list(eng.kv_pool.block_table(s)) for s in seqs]
            shared = [b for b in tabs[0] if all(b in t for t in tabs[1:])]
            assert shared and all(eng.kv_pool.refcount(b) == 3 for b in shared)
            rest = [set(t) - set(shared) for t in tabs]
            assert not (rest[0] & rest[1]) and not (rest[1] & rest[2]) and not (rest[0] & rest[2])
            seen = True
    assert seen
    all_free(eng)


def test_abort_all_ends_held_samples_too(pair: tuple[LLMEngine, LLM]) -> None:
    """abort_all right after an n > 1 request arrived (samples 1..n-1 still held back): every sample ends."""
    eng, _ = pair
    eng.add_request(
        "held", "a prompt long enough to hold the samples back", SamplingParams(max_tokens=30, n=3)
    )
    eng.step()
    assert eng.abort_all() >= 1
    outs = []
    for _ in range(50):
        if not eng.has_unfinished():
            break
        outs += [o for o in eng.step() if o.request_id == "held"]
    assert len(outs[-1].samples) == 3 and {s.finish_reason for s in outs[-1].samples} == {"abort"}
    all_free(eng)


def test_streaming_with_speculation_counts_drafts_per_request() -> None:
    """speculative=True (verify rows hand several tokens per step): DELTA streams concatenate to the
    non-streamed output, and each request's drafts_verified / drafts_accepted add up to the engine's."""
    kw = dict(model="tiny", seed=0, num_blocks=128, max_num_seqs=4, speculative=True, batch_invariant=True)
    eng = LLMEngine(EngineConfig(**kw))
    prompts = {
        "s0": "import os\n\n\ndef ",
        "s1": "class Stack:\n    def push(self, x):",
        "s2": "for i in range(",
    }
    reqs = {
        rid: (p, SamplingParams(temperature=0, max_tokens=24, output_kind="delta"))
        for rid, p in prompts.items()
    }
    got = run_stream(eng, reqs)
    ref = LLM("tiny", **{k: v for k, v in kw.items() if k != "model"})
    want = ref.generate(list(prompts.values()), SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    verified = accepted = 0
    for outs, w in zip(got.values(), want):
        assert "".join(o.text for o in outs) == w.text and sum((o.token_ids for o in outs), ()) == w.token_ids
        m = outs[-1].metrics
        assert 0 <= m["drafts_accepted"] <= m["drafts_verified"]
        verified += m["drafts_verified"]
        accepted += m["drafts_accepted"]
    assert verified == eng.drafts.verified > 0 and accepted == eng.drafts.accepted > 0
    assert any(len(o.token_ids) > 1 for outs in got.values() for o in outs)  # accepted drafts: several a step
    all_free(eng)
