"""The engine on the cuda backend (model on the GPU, cache writes, mask and sampling through the cuda
ops) gives the reference backend's tokens. Skipped without CUDA."""

from __future__ import annotations

import random
import re

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts


@pytest.mark.gpu
def test_cuda_backend_matches_reference() -> None:
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 4, 20, 80)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=seed + 1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=16, so_args={"regex": "[0-9]{3}-[a-z]{2}"})]
    kw = {"model": "tiny-random", "seed": seed % 1000, "dtype": "float64", "quantize": False, "num_blocks": 128, "max_num_seqs": 8}
    ref = LLM(backend="reference", **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(backend="cuda", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref], f"seed {seed}"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", got[3].text)
