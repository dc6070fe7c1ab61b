"""Speculative decoding through the engine: DSpark drafts -> MTPVarlen -> verify rows -> tokens.

Oracles: greedy output with speculation must equal greedy output without it, exactly (float64 model,
raw KV caches), and the teacher-forced argmax of the cache-free forward; a drafter built to copy the
target (every draft right) must give the same text in fewer steps with every verified draft accepted;
seeded sampling (which never drafts) must not depend on speculating neighbours.
"""

from __future__ import annotations

import random

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts, teacher_forced_argmax


def _run(llm: LLM, prompts: list, params: list | SamplingParams) -> list[tuple[int, ...]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("varlen", [True, False], ids=["mtp_varlen", "fixed_length"])
def test_greedy_speculative_equals_plain_with_preemption(varlen: bool) -> None:
    base = random.randrange(2**31)
    # Whether the small pool preempts depends on the prompts (long ones can simply wait for admission), so
    # a few consecutive seeds are tried until one preempts; every seed tried must pass the equality checks.
    for seed in range(base, base + 6):
        if _speculative_equals_plain(seed, varlen):
            return
    pytest.fail(f"seeds {base}..{base + 5}: no preemption in any, the test lost its point")


def _speculative_equals_plain(seed: int, varlen: bool) -> bool:
    """Checks one seed; returns whether the speculative run preempted (the point of the test)."""
    prompts = random_prompts(seed, 4, 3, 40)
    sp = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(4)]
    # a stop token and min_tokens on one request: stops inside accepted runs, and the EOS ban before
    sp[1] = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=3)
    # the seed's victim rule preempts readily under this pool (the default guarded policy mostly avoids it)
    kw = dict(
        model="tiny-random",
        seed=seed % 1000,
        dtype="float64",
        quantize=False,
        block_size=4,
        num_blocks=24,
        max_num_seqs=4,
        preemption_policy="deepinfer",
    )
    envs = Envs(enable_mtp_varlen=varlen)
    plain = LLM(**kw, envs=envs)
    spec = LLM(**kw, speculative=True, envs=envs)
    want = _run(plain, prompts, sp)
    got = _run(spec, prompts, sp)
    assert got == want, f"seed {seed}"
    eng = spec.engine
    assert not eng.config.async_scheduling or eng.scheduler.config.async_mode is False
    assert eng.stats.verify_rows > 0 and eng.drafts is not None and eng.drafts.verified > 0
    # the small pool preempts (4 x 4-token blocks per request at most): rollback + recompute paths run
    outs = spec.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == want, f"seed {seed}"
    # independent oracle: every token is the argmax of the cache-free forward on its prefix
    for p, out in zip(prompts, want):
        ids = eng.tokenizer.encode(p)
        assert list(out) == teacher_forced_argmax(eng.model, ids, out), f"seed {seed}"
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    return sum(o.num_preemptions for o in outs) > 0


def test_copying_drafter_same_text_fewer_steps() -> None:
    from tests.deepinfer_core.model.test_drafter import _copying_drafter_model

    seed = random.randrange(1000)
    prompts = random_prompts(seed, 3, 5, 30)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    res, steps = {}, {}
    for spec in (False, True):
        model, _perm = _copying_drafter_model(seed)
        cfg = EngineConfig(dtype="float64", quantize=False, num_blocks=64, speculative=spec)
        eng = LLMEngine(cfg, envs=Envs(), model=model)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, sp)
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        res[spec] = [done[f"r{i}"] for i in range(len(prompts))]
        steps[spec] = eng.stats.steps
        if spec:
            book = eng.drafts
            assert book is not None and book.verified > 0 and book.accepted == book.verified  # all accepted
    assert res[True] == res[False], f"seed {seed}"
    # 1 prefill step + 19 plain decode steps vs. prefill + ceil(19 / 6) verify steps
    assert steps[True] < steps[False] / 2, steps


def test_seeded_sampling_is_batch_invariant_with_speculation() -> None:
    seed = random.randrange(2**31)
    prompts = random_prompts(seed, 4, 10, 40)
    sampled = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=seed + i, max_tokens=8, ignore_eos=True)
        for i in range(2)
    ]
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(2)]
    # batch-invariant mode (each request its own executor call): the engine's exact guarantee. The default
    # float32 mode can differ in a last-place bit between batch shapes, with or without speculation
    # (seen at seed 743359848 with speculation off too), which rarely flips a sampled token.
    kw = dict(model="tiny-random", seed=5, num_blocks=128, max_num_seqs=8, envs=Envs(batch_invariant=True))
    alone = [_run(LLM(**kw), [p], s)[0] for p, s in zip(prompts[:2], sampled)]
    spec = LLM(**kw, speculative=True)
    mixed = _run(
        spec, [prompts[2], prompts[0], prompts[3], prompts[1]], [greedy[0], sampled[0], greedy[1], sampled[1]]
    )
    assert [mixed[1], mixed[3]] == alone, f"seed {seed}"
    assert spec.engine.stats.verify_rows > 0  # the greedy neighbours did verify drafts
    # and speculation changes nothing for the greedy ones either (same batch-invariant engine setup)
    assert [mixed[0], mixed[2]] == _run(LLM(**kw), [prompts[2], prompts[3]], greedy)


def test_structured_requests_do_not_draft() -> None:
    pytest.importorskip("xgrammar")
    import re

    llm = LLM(model="tiny-random", seed=2, num_blocks=128, max_num_seqs=4, speculative=True)
    sp = [
        SamplingParams(temperature=0.0, max_tokens=16, so_args={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    plain = LLM(model="tiny-random", seed=2, num_blocks=128, max_num_seqs=4)
    got = llm.generate(["code:", "hello"], sp, use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got[0].text), got[0].text
    assert [o.token_ids for o in got] == _run(plain, ["code:", "hello"], sp)
