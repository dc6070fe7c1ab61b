"""Batch-invariant mode, batched: one executor call a step, and a request's tokens bitwise the same alone
and in any mix (issue #32: 20 mixes x 2 runs, greedy and seeded sampling).

The oracle is the request run alone on the same engine (its own batch of one); the mixes put it among
other requests of random prompt lengths, sampling parameters and output lengths, at a random place, and
run each mix twice. The engine's batch-invariant mode runs each step as ONE executor call (counted here)
whose products are row-chunked (model/invariant.py), so nothing but the request's own rows decides its
logits. (test_invariance.py keeps the mode's other contracts: sync scheduling, envs, seeds.)
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts

N = 4  # output tokens of the watched requests


@pytest.fixture(scope="module")
def case() -> dict:
    llm = LLM(model="tiny-random", seed=7, num_blocks=256, max_num_seqs=16, batch_invariant=True)
    # a greedy and a seeded request, and a short one (4 tokens: its prefill is a row-path step alone, so the
    # engine must keep it one in a prefill step with long prompts)
    prompts = [*random_prompts(2024, 2, 10, 40), "abcd"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=N, ignore_eos=True),
    ]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    return {"llm": llm, "prompts": prompts, "params": params, "alone": alone}


def _other(rng: random.Random, i: int) -> tuple[str, SamplingParams]:
    (p,) = random_prompts(rng.randrange(2**31), 1, 1, 32)
    n = rng.randint(1, N + 2)
    if rng.random() < 0.5:
        return p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return p, SamplingParams(
        temperature=rng.uniform(0.5, 1.5), top_k=rng.choice([0, 5, 50]), seed=i, max_tokens=n
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 6))
def test_a_request_gets_the_same_tokens_in_any_mix(case: dict, seed: int, size: int) -> None:
    rng = random.Random(seed)
    items = [_other(rng, i) for i in range(size)]
    at = sorted(rng.sample(range(size + 3), 3))  # where the watched requests go
    for k, w in enumerate(at):
        items.insert(w, (case["prompts"][k], case["params"][k]))
    llm = case["llm"]
    for run in range(2):
        outs = llm.generate([p for p, _ in items], [sp for _, sp in items], use_tqdm=False)
        got = [outs[w].token_ids for w in at]
        assert got == case["alone"], f"mix seed {seed}, size {size}, run {run}"


def test_one_executor_call_per_step(case: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = case["llm"]
    runner = llm.engine.runner
    ex = runner.executor
    assert ex.invariant_rows > 0  # the engine switched the executor's invariant products on
    calls: list[int] = []
    steps: list[int] = []
    execute, run_step = ex.execute, runner._execute

    def counted(batch, **kw):  # type: ignore[no-untyped-def]
        calls.append(batch.num_requests)
        return execute(batch, **kw)

    def counted_step(batch, *a, **kw):  # type: ignore[no-untyped-def]
        steps.append(batch.num_requests)
        return run_step(batch, *a, **kw)

    monkeypatch.setattr(ex, "execute", counted)
    monkeypatch.setattr(runner, "_execute", counted_step)
    prompts = random_prompts(5, 8, 10, 40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 5 for o in outs)
    assert calls == steps  # one executor call per step, with the whole batch
    assert max(calls) == 8  # and the steps were batched
    # a prefill step of long, short, long prompts: cut where the requests' own executor path changes
    calls.clear()
    steps.clear()
    llm.generate(
        [prompts[0], "abc", prompts[1]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert calls[:3] == [1, 1, 1] and steps[0] == 3  # the prefill step: 3 calls
    assert calls[3:] == steps[1:] == [3] * len(steps[1:])  # the decode steps: one call each
