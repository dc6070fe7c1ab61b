"""Bad input fails its request alone, with a message naming the field; nothing is truncated."""

from __future__ import annotations

import pytest

from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-random", seed=0, num_blocks=32, block_size=16, max_num_seqs=4, max_model_len=128)


def test_bad_requests_fail_alone(llm: LLM) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cases = [  # (prompt, params, words the error must contain)
        ("", good, "prompt"),
        ([5, 6, 512], good, "prompt_token_ids[2]=512"),
        ([5, -1], good, "prompt_token_ids[1]=-1"),
        ([5, 6.5], good, "prompt_token_ids[1]"),
        ("x" * 128, good, "max_model_len=128"),  # prompt as long as the model allows: not truncated
        ("x" * 100, SamplingParams(max_tokens=64), "max_tokens=64"),  # 100 + 64 > 128
        ("ok", {"temperature": -1.0}, "temperature"),
        ("ok", {"top_p": 0.0}, "top_p"),
        ("ok", {"no_such_field": 1}, "no_such_field"),
        ("ok", SamplingParams(stop_token_ids=(600,)), "stop_token_ids"),
        ("ok", {"so_args": {"regexp": "a"}}, "so_args"),
        ("ok", 3.5, "sampling_params"),
    ]
    prompts = ["hello", *(c[0] for c in cases), "world"]
    params = [good, *(c[1] for c in cases), good]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
    for o, (_, _, words) in zip(outs[1:-1], cases):
        assert not o.ok and o.finish_reason == "error" and o.token_ids == (), o
        assert words in (o.error or ""), (words, o.error)
    for o in (outs[0], outs[-1]):
        assert o.ok and o.finish_reason == "length" and len(o.token_ids) == 4


def test_longest_allowed_prompt_runs(llm: LLM) -> None:
    (o,) = llm.generate([[7] * 127], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert o.ok and len(o.prompt_token_ids) == 127 and len(o.token_ids) == 1


def test_caller_errors_raise() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.num_blocks"):
        EngineConfig(num_blocks=1)
    with pytest.raises(ValueError, match=r"EngineConfig\.backend"):
        EngineConfig(backend="tpu")
    with pytest.raises(ValueError, match=r"EngineConfig\.model"):
        LLM(model="deepseek-v4")
    with pytest.raises(ValueError, match=r"EngineConfig\.num_speculative_tokens"):
        EngineConfig(speculative=True, num_speculative_tokens=6)
    with pytest.raises(ValueError, match=r"EngineConfig\.num_speculative_tokens.*BACKTRACKING"):
        LLM(speculative=True, num_speculative_tokens=5, envs=Envs(use_nextn_decode=2))
    llm = LLM(num_blocks=8, max_num_seqs=1)
    with pytest.raises(ValueError, match="sampling_params: 1 given for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_abort(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("keep", "abc", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.add_request("drop", "abc", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.abort("drop") and not eng.abort("nope")
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["drop"].finish_reason == "abort" and len(done["drop"].token_ids) < 50
    assert done["keep"].finish_reason == "length" and len(done["keep"].token_ids) == 5
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1 and eng.state_pool.num_free_slots == 4
