"""Stop conditions: max_tokens, stop_token_ids, EOS unless ignore_eos, min_tokens; an executor refusal
of one request fails it alone."""

from __future__ import annotations

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.model import BatchError
from deepinfer_core.sampling_params import SamplingParams

EOS = 1


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-random", seed=0, num_blocks=256, max_num_seqs=16)


def _greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **({"max_tokens": 24, "ignore_eos": True} | kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def streams(llm: LLM) -> tuple[list[str], list[tuple[int, ...]]]:
    prompts = [f"Request {i}: tell me a story about the number {i * 7}." for i in range(16)]
    return prompts, [o.token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def test_stop_token_ids(llm: LLM, streams: tuple) -> None:
    prompts, ref = streams
    s = ref[0]
    t = s[5]
    k = s.index(t)
    (o,) = llm.generate([prompts[0]], _greedy(stop_token_ids=(t, 600 % 512)), use_tqdm=False)
    assert o.finish_reason == "stop" and o.token_ids == s[: k + 1]


def test_min_tokens_masks_stop_tokens(llm: LLM, streams: tuple) -> None:
    prompts, ref = streams
    s = ref[1]
    (o,) = llm.generate([prompts[1]], _greedy(stop_token_ids=(s[0],), min_tokens=3), use_tqdm=False)
    assert s[0] not in o.token_ids[:3] and len(o.token_ids) >= 3
    assert o.token_ids[0] != s[0]  # the greedy choice was banned, so the stream changed
    if o.finish_reason == "stop":
        assert o.token_ids.index(s[0]) == len(o.token_ids) - 1


def test_eos_stops_unless_ignored(llm: LLM, streams: tuple) -> None:
    prompts, ref = streams
    hits = [(i, s.index(EOS)) for i, s in enumerate(ref) if EOS in s]
    if not hits:
        pytest.skip("no greedy stream of this model emits EOS within 24 tokens (structured tests cover EOS)")
    i, k = hits[0]
    o, o_ign = llm.generate([prompts[i]] * 2, [_greedy(ignore_eos=False), _greedy()], use_tqdm=False)
    assert o.finish_reason == "stop" and o.token_ids == ref[i][: k + 1]
    assert o_ign.finish_reason == "length" and o_ign.token_ids == ref[i]


def test_executor_refusal_fails_one_request(llm: LLM, streams: tuple) -> None:
    prompts, ref = streams
    eng = llm.engine
    real = eng.executor.execute
    calls = []

    def refuse_second(batch, **kw):  # type: ignore[no-untyped-def]  # kw: the async overlap's token feed
        calls.append(batch.num_requests)
        if len(calls) == 2:  # the first decode step: refuse request 1, as a real BatchError would
            raise BatchError(1, "token_ids", "refused by the test")
        return real(batch, **kw)

    eng.executor.execute = refuse_second
    try:
        outs = llm.generate(prompts[:3], _greedy(max_tokens=6), use_tqdm=False)
    finally:
        del eng.executor.execute
    assert calls[1:3] == [3, 2]  # the step was rerun without the refused request
    assert not outs[1].ok and "token_ids" in (outs[1].error or "") and outs[1].finish_reason == "error"
    assert [outs[0].token_ids, outs[2].token_ids] == [ref[0][:6], ref[2][:6]]
