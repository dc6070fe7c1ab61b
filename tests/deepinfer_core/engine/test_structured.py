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
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "who": {"enum": ["ann", "bob", "cy"]}},
    "required": ["ok", "n", "who"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def outs(request: pytest.FixtureRequest) -> tuple[int, list]:
    if request.param == "llguidance":
        pytest.importorskip("llguidance")
    seed = random.randrange(2**31)
    llm = LLM(seed=seed % 1000, num_blocks=128, max_num_seqs=8, structured_backend=request.param)
    sp = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=24, so_args={"regex": REGEX}) for i in range(2)]
    sp += [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=48, so_args={"json_schema": SCHEMA})
           for i in range(2)]
    sp += [SamplingParams(temperature=0.0, max_tokens=16, so_args={"regex": "[unclosed"}),
           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
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
    llm = LLM(seed=1, num_blocks=64, max_num_seqs=2)
    (r,) = llm.generate(["digits: "], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                     so_args={"regex": "[0-9]{2}"}), use_tqdm=False)
    assert r.finish_reason == "stop" and r.ok
    assert re.fullmatch("[0-9]{2}", r.text) and len(r.token_ids) == 3
