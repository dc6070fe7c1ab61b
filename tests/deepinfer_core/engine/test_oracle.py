"""Greedy output through the engine equals greedy decoding by the model's cache-free full forward.

float64 with quantisation off, so the cached executor equals ``forward_full`` to ~1e-14 and the argmax
cannot flip. The same streams must come out synchronously, one step ahead, with prefill chunked into
small steps, and with a pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import random

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import greedy_oracle, random_prompts, teacher_forced_argmax

N_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case() -> dict:
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 3, 24, 56)  # past the window (16), through compression and top-k
    llm = LLM(
        model="tiny-random",
        seed=seed % 1000,
        dtype="float64",
        quantize=False,
        num_blocks=64,
        block_size=16,
        max_num_seqs=4,
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {"seed": seed, "prompts": prompts, "llm": llm, "outs": outs}


def _streams(outs: list) -> list[tuple[int, ...]]:
    assert all(o.ok and o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def test_greedy_equals_full_forward_oracle(case: dict) -> None:
    llm = case["llm"]
    model = llm.engine.model
    for o in case["outs"]:
        assert o.ok, o.error
        assert len(o.token_ids) == N_TOKENS and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)
        # every token is the argmax of the full forward over everything before it (one causal forward)
        assert teacher_forced_argmax(model, o.prompt_token_ids, o.token_ids) == list(o.token_ids), (
            f"seed {case['seed']}, prompt {o.prompt!r}"
        )
    # and literally: greedy decoding by re-running the full forward on the growing sequence
    o = case["outs"][0]
    assert greedy_oracle(model, o.prompt_token_ids, 6) == list(o.token_ids[:6]), f"seed {case['seed']}"


@pytest.mark.parametrize(
    "kw",
    [
        # synchronous scheduling with a pool that holds every prompt but not their growth: decode
        # preempts the longest-output requests, which are recomputed by prefill later
        # (the seed's victim rule: the default guarded policy holds admission back instead of preempting,
        # and must give the same tokens under the same tight pool)
        pytest.param(
            {
                "async_scheduling": False,
                "num_blocks": "tight",
                "block_size": 8,
                "preemption_policy": "deepinfer",
            },
            id="sync-preempted",
        ),
        pytest.param(
            {"num_blocks": "tight", "block_size": 8, "preemption_policy": "deepinfer"}, id="async-preempted"
        ),
        pytest.param({"num_blocks": "tight", "block_size": 8}, id="async-tight-guarded"),
        pytest.param({"max_num_batched_tokens": 40}, id="chunked-prefill"),
    ],
)
def test_same_tokens_sync_preempted_chunked(case: dict, kw: dict) -> None:
    if kw.get("num_blocks") == "tight":
        kw = kw | {"num_blocks": sum(-(-len(p) // 8) for p in case["prompts"]) + 2}
    llm = LLM(
        **(
            {
                "model": "tiny-random",
                "seed": case["seed"] % 1000,
                "dtype": "float64",
                "quantize": False,
                "num_blocks": 64,
                "block_size": 16,
                "max_num_seqs": 4,
            }
            | kw
        )
    )
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert _streams(outs) == _streams(case["outs"]), f"seed {case['seed']}"
    if kw.get("preemption_policy") == "deepinfer":
        assert sum(o.num_preemptions for o in outs) > 0, "the small pool should have forced a preemption"
