"""P/D hand-off in one process: PROMPT engine -> Handoff -> COMPLETION engine, against a NORMAL engine
(batch-invariant mode, fresh prompts and seeds). The torchrun test sends the same packages over gloo."""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from deepinfer_core.distributed.pd import CompletionEngine, PromptEngine
from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.sampling_params import SamplingParams

CFG = EngineConfig(seed=3, num_blocks=128, max_num_seqs=8, batch_invariant=True)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _case(seed: int) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = ["".join(rng.choice("abcdefghij klmnopq,.") for _ in range(rng.randint(17, 90))) for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 7), ignore_eos=True),
              SamplingParams(temperature=0.9, seed=seed, max_tokens=rng.randint(3, 7), ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=30, max_tokens=rng.randint(3, 7), ignore_eos=True),  # no seed
              SamplingParams(temperature=0.8, seed=seed + 1, max_tokens=1, ignore_eos=True)]  # ends on the P side
    return prompts, params


def test_handoff_tokens_equal_normal_engine() -> None:
    seed = random.randrange(2**31)
    prompts, params = _case(seed)
    pe, ce = PromptEngine(CFG), CompletionEngine(CFG)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        pe.add_request(str(i), p, sp)
    done, handoffs = {}, []
    while pe.has_unfinished():
        outs, ready = pe.step()
        done.update({o.request_id: o for o in outs})
        handoffs += ready
    assert sorted(done) == ["3"] and done["3"].finish_reason == "length" and len(done["3"].token_ids) == 1
    assert sorted(h.request_id for h in handoffs) == ["0", "1", "2"]
    for h in handoffs:
        assert h.num_tokens == len(h.prompt_token_ids) and h.params.seed is not None and h.nbytes > 0
        ce.add_handoff(h)
    while ce.has_unfinished():
        done.update({o.request_id: o for o in ce.step()})
    # the NORMAL engine gets the resolved seed of the unseeded request (the PROMPT engine picked it)
    seeds = {h.request_id: h.params.seed for h in handoffs}
    ref_params = [attrs.evolve(sp, seed=seeds.get(str(i), sp.seed)) for i, sp in enumerate(params)]
    want = [o.token_ids for o in LLM(**{k: getattr(CFG, k) for k in ("seed", "num_blocks", "max_num_seqs",
                                                                     "batch_invariant")})
            .generate(prompts, ref_params, use_tqdm=False)]
    got = [done[str(i)].token_ids for i in range(len(prompts))]
    assert got == want, f"seed {seed}"
    assert all(done[str(i)].ok and done[str(i)].prompt == prompts[i] for i in range(len(prompts)))


def test_handoff_errors() -> None:
    pe = PromptEngine(CFG)
    pe.add_request("a", "some prompt text", SamplingParams(max_tokens=4, ignore_eos=True))
    ready = []
    while pe.has_unfinished():
        ready += pe.step()[1]
    (h,) = ready
    with pytest.raises(ValueError, match="block_size"):
        CompletionEngine(attrs.evolve(CFG, block_size=8)).add_handoff(h)
    with pytest.raises(ValueError, match="not supported with P/D"):
        PromptEngine(attrs.evolve(CFG, speculative=True, num_speculative_tokens=2))
