"""Speculative drafting for seeded sampled requests: verification keyed by (seed, position) and argmax
drafts, so a request's tokens do not depend on its batch (the engine's batch-invariant mode).

Oracle: the same request run alone (one per engine) vs. in a mixed batch with other sampled and greedy
neighbours; and drafts must have been verified for the sampled requests themselves. (Without the keyed
verification this test fails: checked by switching SpecState.counter_seeds off.)
"""

from __future__ import annotations

import random

from deepinfer_core.engine import LLM
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts


def test_seeded_sampled_requests_draft_and_stay_batch_invariant() -> None:
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 4, 10, 40)
    # top_p = 1 and no top_k: the full distribution, which the executor's verification samples from
    sampled = [
        SamplingParams(temperature=0.8, seed=seed + i, max_tokens=12, ignore_eos=True) for i in range(3)
    ]
    kw = dict(
        seed=seed % 1000, num_blocks=128, max_num_seqs=8, speculative=True, envs=Envs(batch_invariant=True)
    )
    alone = []
    for p, s in zip(prompts[:3], sampled):
        llm = LLM(**kw)
        alone.append(llm.generate([p], s, use_tqdm=False)[0].token_ids)
        book = llm.engine.drafts
        assert book is not None and book.verified > 0, "sampled requests must verify drafts"
    mixed_llm = LLM(**kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    outs = mixed_llm.generate(
        [prompts[3], prompts[1], prompts[0], prompts[2]],
        [greedy, sampled[1], sampled[0], sampled[2]],
        use_tqdm=False,
    )
    assert [outs[2].token_ids, outs[1].token_ids, outs[3].token_ids] == alone, f"seed {seed}"
