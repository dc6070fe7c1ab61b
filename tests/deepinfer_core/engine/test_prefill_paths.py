"""The engine's tokens do not depend on the executor's prefill path: the varlen prefill (every request of a
step at once) gives the tiled (per-request) path's greedy tokens on the trained ``tiny`` model, through
chunked prefill mixed with decode rows and prefix-cache hits (shared prefixes: encoder rings restored,
decoder floors)."""

from __future__ import annotations

import random

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.model import prefill
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts


def _prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    base = random_prompts(seed, 6, 20, 260)
    shared = base[0][:150] if len(base[0]) >= 150 else base[0] * 2
    # follow-ups sharing a long prefix with earlier prompts (prefix-cache hits once those are cached)
    return (
        base
        + [shared + p for p in random_prompts(seed + 1, 4, 5, 90)]
        + [base[1] + base[2][: rng.randint(1, 40)]]
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_prefill_gives_the_tiled_paths_greedy_tokens(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = {"n": 0}
    real = prefill.make_plan

    def counted(*a: object, **kw: object) -> object:
        plans["n"] += 1
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill, "make_plan", counted)
    prompts = _prompts(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for path in ("tiled", "varlen"):
        llm = LLM(model="tiny", seed=seed, num_blocks=256, max_num_seqs=6, max_num_batched_tokens=96)
        llm.engine.executor.prefill_path = path
        # two rounds: the second hits the prefixes the first cached
        outs = llm.generate(prompts[:6], sp, use_tqdm=False) + llm.generate(prompts[6:], sp, use_tqdm=False)
        got[path] = [o.token_ids for o in outs]
    assert plans["n"] > 0  # the varlen executor really ran its prefill steps on the varlen path
    assert got["varlen"] == got["tiled"]
