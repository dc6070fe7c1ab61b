"""Property test: any chunk schedule with any draft rollbacks gives the oracle's logits.

A narrow config (window 4, top-k 2, candidate blocks 2 x 2) makes every mechanism bind within 40
tokens, so hypothesis can try many schedules quickly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.model import DeepSeekV41

from .session import Session

T = 40


@pytest.fixture(scope="module")
def narrow() -> tuple[DeepSeekV41, torch.Tensor, torch.Tensor]:
    cfg = tiny_config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=32,
        sliding_window=4,
        index_topk=2,
        index_head_dim=16,
        candidate_block_size=2,
        candidate_topk_blocks=2,
        moe_intermediate_size=32,
    )
    m = DeepSeekV41.from_config(cfg, seed=5, dtype=torch.float64)
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(6))
    return m, toks, m.forward_full(toks)[0]


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=40), st.integers(0, 2**31)
)
def test_any_schedule_matches_oracle(narrow, plan: list[tuple[int, int]], seed: int) -> None:
    model, toks, ref = narrow
    s = Session(model, backtrack=3)
    g = torch.Generator().manual_seed(seed)
    pos = 0
    for n, junk in plan:
        if pos >= T:
            break
        n = min(n, T - pos)
        real = toks[pos : pos + n]
        if junk:  # a verify step: real tokens plus `junk` rejected drafts, then roll them back
            fed = torch.cat((real, torch.randint(0, 512, (junk,), generator=g)))
            _, (got,) = s.step([(0, fed, pos, len(fed))])
            got = got[:n]
        else:
            _, (got,) = s.step([(0, real, pos, n)])
        assert (got - ref[pos : pos + n]).abs().max().item() < 1e-9
        pos += n


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_any_mixed_batch_schedule_matches_oracle(narrow, data: st.DataObject) -> None:
    """Three sequences advanced in random subsets, chunk sizes and rejected drafts per step: every
    request's logits equal its own oracle (so requests never disturb each other)."""
    model, _, _ = narrow
    seqs = [
        torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(30 + n)) for n in (24, 31, 36)
    ]
    refs = [model.forward_full(t)[0] for t in seqs]
    s = Session(model, backtrack=3)
    pos = [0, 0, 0]
    for _ in range(40):
        live = [i for i in range(3) if pos[i] < len(seqs[i])]
        if not live:
            break
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        items, meta = [], []
        for i in chosen:
            n = min(data.draw(st.integers(1, 8)), len(seqs[i]) - pos[i])
            junk = data.draw(st.integers(0, 3))
            fed = torch.cat((seqs[i][pos[i] : pos[i] + n], torch.full((junk,), 7)))
            items.append((i, fed, pos[i], len(fed)))
            meta.append((i, n))
        _, per = s.step(items)
        for (i, n), got in zip(meta, per):
            assert (got[:n] - refs[i][pos[i] : pos[i] + n]).abs().max().item() < 1e-9
            pos[i] += n
