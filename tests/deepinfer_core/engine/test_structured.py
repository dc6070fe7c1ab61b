"""Structured outputs through the engine: so_args -> grammar -> bitmask -> sample.

The texts must satisfy their constraint by an independent checker (``re.fullmatch``, ``jsonschema``);
an invalid grammar fails its request alone while the others in the batch complete.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams

pytest.importorskip("xgrammar")

REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "who": {"enum": ["ann", "bob", "cy"]},
    },
    "required": ["ok", "n", "who"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def outs(request: pytest.FixtureRequest) -> tuple[int, list]:
    if request.param == "llguidance":
        pytest.importorskip("llguidance")
    seed = random.randrange(2**31)
    llm = LLM(
        model="tiny-random",
        seed=seed % 1000,
        num_blocks=128,
        max_num_seqs=8,
        structured_backend=request.param,
    )
    sp = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=24, so_args={"regex": REGEX})
        for i in range(2)
    ]
    sp += [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=48, so_args={"json_schema": SCHEMA})
        for i in range(2)
    ]
    sp += [
        SamplingParams(temperature=0.0, max_tokens=16, so_args={"regex": "[unclosed"}),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    prompts = ["A code: ", "Another code: ", "As JSON: ", "JSON again: ", "broken", "plain text"]
    return seed, llm.generate(prompts, sp, use_tqdm=False)


def test_regex_output_matches(outs: tuple[int, list]) -> None:
    seed, o = outs
    for r in o[:2]:
        assert r.ok and r.finish_reason == "stop", (seed, r)
        assert r.token_ids[-1] == 1  # the grammar ends in EOS, which stops the request
        assert re.fullmatch(REGEX, r.text), (seed, r.text)


def test_json_schema_output_validates(outs: tuple[int, list]) -> None:
    seed, o = outs
    for r in o[2:4]:
        assert r.ok and r.finish_reason == "stop", (seed, r)
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_invalid_grammar_fails_alone(outs: tuple[int, list]) -> None:
    _, o = outs
    bad, plain = o[4], o[5]
    assert not bad.ok and bad.finish_reason == "grammar_invalid" and bad.token_ids == ()
    assert "so_args" in (bad.error or "")
    assert plain.ok and plain.finish_reason == "length" and len(plain.token_ids) == 6


def test_grammar_end_stops_under_ignore_eos() -> None:
    # with ignore_eos the scheduler would not stop on EOS; the engine ends the request at the grammar's end
    llm = LLM(model="tiny-random", seed=1, num_blocks=64, max_num_seqs=2)
    (r,) = llm.generate(
        ["digits: "],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, so_args={"regex": "[0-9]{2}"}),
        use_tqdm=False,
    )
    assert r.finish_reason == "stop" and r.ok
    assert re.fullmatch("[0-9]{2}", r.text) and len(r.token_ids) == 3


# ----------------------------------------------------------------------------- round 2 (issue #20)
def test_auto_backend_reports_the_engine_and_violations() -> None:
    pytest.importorskip("llguidance")
    seed = random.randrange(2**31)
    llm = LLM(seed=seed % 1000, num_blocks=128, max_num_seqs=4, structured_backend="auto")
    # uniqueItems: llguidance refuses it, xgrammar ignores it, so the only document is ["a","a"]: the
    # request must end with grammar_violation, not stop
    dup = {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    sp = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=48, so_args={"json_schema": SCHEMA}),
        SamplingParams(temperature=0.0, max_tokens=16, so_args={"json_schema": dup}),
    ]
    ok, bad = llm.generate(["As JSON: ", "Twice: "], sp, use_tqdm=False)
    assert ok.ok and ok.finish_reason == "stop" and ok.metrics["grammar_engine"] == "llguidance", (seed, ok)
    jsonschema.validate(json.loads(ok.text), SCHEMA)
    assert list(json.loads(ok.text)) == list(SCHEMA["properties"])  # the schema's property order
    assert bad.finish_reason == "grammar_violation" and not bad.ok, (seed, bad)
    assert bad.metrics["grammar_engine"] == "xgrammar" and "llguidance" in bad.metrics["grammar_refused"]
    assert "non-unique" in (bad.error or "")


def test_stop_strings_end_the_text_as_vllm_does() -> None:
    seed = random.randrange(1000)
    llm = LLM(seed=seed, num_blocks=128, max_num_seqs=4)
    tok = llm.engine.tokenizer
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(["Once upon a time"], sp, use_tqdm=False)
    data = b"".join(tok.token_bytes()[t] for t in full.token_ids)
    stop = data[10:12].decode("utf-8", errors="ignore") or "\x00never"  # a stop string the text contains
    for include in (False, True):
        sp2 = SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop, "\x00never"],
            include_stop_str_in_output=include,
        )
        (out,) = llm.generate(["Once upon a time"], sp2, use_tqdm=False)
        if stop == "\x00never":
            assert out.finish_reason == "length" and out.stop_reason is None
            continue
        at = data.find(stop.encode())
        assert out.finish_reason == "stop" and out.stop_reason == stop, (seed, out)
        cut = at + len(stop.encode()) if include else at
        assert out.text == data[:cut].decode("utf-8", errors="replace"), (seed, out.text, data)
        n = len(out.token_ids)  # every token up to the one completing the stop string
        assert out.token_ids == full.token_ids[:n]
        assert (
            len(b"".join(tok.token_bytes()[t] for t in out.token_ids[:-1]))
            < at + len(stop.encode())
            <= len(b"".join(tok.token_bytes()[t] for t in out.token_ids))
        )


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_structured_speculative_equals_plain_and_validates(backend: str) -> None:
    if backend == "auto":
        pytest.importorskip("llguidance")
    seed = random.randrange(1000)
    kw = dict(
        seed=seed, dtype="float64", quantize=False, num_blocks=128, max_num_seqs=4, structured_backend=backend
    )
    # structured requests only: the drafts counted below are theirs
    sp = [
        SamplingParams(temperature=0.0, max_tokens=64, so_args={"json_schema": SCHEMA}),
        SamplingParams(temperature=0.0, max_tokens=24, so_args={"regex": REGEX}),
    ]
    prompts = ["As JSON: ", "A code: "]
    plain = LLM(**kw).generate(prompts, sp, use_tqdm=False)
    spec_llm = LLM(**kw, speculative=True)
    spec = spec_llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain], seed
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain], seed
    eng = spec_llm.engine
    assert eng.drafts is not None and eng.drafts.verified > 0, "structured requests must have verified drafts"
    if spec[0].finish_reason == "stop":
        jsonschema.validate(json.loads(spec[0].text), SCHEMA)
    if spec[1].finish_reason == "stop":
        assert re.fullmatch(REGEX, spec[1].text)
