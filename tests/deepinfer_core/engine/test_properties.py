"""Hypothesis: random workloads under random engine limits give the streams of an unconstrained run.

Each example draws requests (prompt lengths 1-40, greedy or seeded sampling, 1-8 output tokens, stop ids)
and limits (block size, a pool just large enough for the largest request, max_num_seqs, a per-step token
cap that chunks prefill, sync or one step ahead). Invariant: every request's tokens and finish reason
equal those of the same requests on an engine with an ample pool, no chunking and synchronous steps,
and every greedy stream is the argmax of ``forward_full`` over its own prefix (float64, raw KV: exact).
Afterwards every KV block and state slot is free again.
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import teacher_forced_argmax

EXACT = {"model": "tiny-random", "seed": 11, "dtype": "float64", "quantize": False}


@functools.cache
def reference_engine() -> LLM:
    return LLM(num_blocks=512, block_size=16, max_num_seqs=16, async_scheduling=False, **EXACT)


request = st.tuples(
    st.lists(st.integers(3, 258), min_size=1, max_size=40),  # byte tokens
    st.integers(1, 8),  # max_tokens
    st.one_of(st.none(), st.integers(0, 2**31)),  # None: greedy, else a sampling seed
    st.lists(st.integers(3, 511), max_size=2),  # stop ids
)


@settings(max_examples=6, deadline=None)
@given(
    reqs=st.lists(request, min_size=1, max_size=5),
    block_size=st.sampled_from([4, 8, 16]),
    max_num_seqs=st.integers(1, 4),
    token_cap=st.integers(8, 64),
    async_mode=st.booleans(),
    spare_blocks=st.integers(0, 6),
)
def test_random_workloads_match_unconstrained_run(
    reqs: list, block_size: int, max_num_seqs: int, token_cap: int, async_mode: bool, spare_blocks: int
) -> None:
    prompts = [p for p, _, _, _ in reqs]
    params = [
        SamplingParams(
            temperature=0.0 if s is None else 1.0,
            seed=s,
            max_tokens=n,
            stop_token_ids=tuple(stop),
            ignore_eos=True,
        )
        for _, n, s, stop in reqs
    ]
    want = reference_engine().generate(prompts, params, use_tqdm=False)
    # the largest request must fit alone (else the scheduler rightly refuses it); the rest contend
    need = max(-(-(len(p) + n - 1) // block_size) for p, n, _, _ in reqs)
    llm = LLM(
        num_blocks=need + 1 + spare_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_cap,
        async_scheduling=async_mode,
        **EXACT,
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w, sp in zip(got, want, params):
        assert g.ok and w.ok, (g.error, w.error)
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        # (forward_full cannot take a 1-token sequence: its ratio-2 compressor has no whole group)
        if sp.greedy and len(g.prompt_token_ids) >= 2:
            assert teacher_forced_argmax(llm.engine.model, g.prompt_token_ids, g.token_ids) == list(
                g.token_ids
            )
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == max_num_seqs
