"""The manager's general path: any backend (``fill_rows`` or one matcher at a time) and any ``out``.

Round 1's code, kept as the reference the fast path (``_fastpath``) is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_core.protocols import GrammarMatcher


def _fill_request(m: GrammarMatcher, bm: torch.Tensor, base: int, drafts: Sequence[int]) -> int:
    """Accept-draft-then-fill rows ``base..base+k``; roll back; return how many drafts were accepted."""
    fill = getattr(m, "fill_unchecked", m.fill_next_token_bitmask)
    fill(bm, base)
    if not drafts:
        return 0
    accepted = 0
    for t in drafts:
        if not m.accept_token(int(t)):
            break
        accepted += 1
        if m.is_terminated():
            # An accepted EOS draft ends the text: nothing is sampled after it, so the draft ends
            # here, and its row repeats the previous one rather than being all-masked.
            bm[base + accepted] = bm[base + accepted - 1]
            break
        fill(bm, base + accepted)
    m.rollback(accepted)
    # Unused rows repeat the last valid one: never all-masked, never looser than the grammar.
    end = base + 1 + len(drafts)
    if base + accepted + 1 < end:
        bm[base + accepted + 1 : end] = bm[base + accepted]
    return accepted


def _fill_wavefront(
    fill_rows: Any, matchers: list[GrammarMatcher], bm: torch.Tensor, offsets: list[int], drafts: list[Sequence[int]]
) -> list[int]:
    """The same rows as :func:`_fill_request`, one draft depth at a time across the batch.

    Each depth is one ``backend.fill_rows`` call, which the engines run on their own thread pools
    (xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``) without a Python call per row.
    """
    n = len(matchers)
    fill_rows(matchers, bm, offsets[:n])
    accepted = [0] * n
    active = [i for i in range(n) if drafts[i]]
    depth = 0
    while active:
        depth += 1
        go_m, go_rows, nxt = [], [], []
        for i in active:
            m = matchers[i]
            if not m.accept_token(int(drafts[i][depth - 1])):
                continue
            accepted[i] = depth
            row = offsets[i] + depth
            if m.is_terminated():  # an accepted EOS draft: its row repeats the previous one
                bm[row] = bm[row - 1]
                continue
            go_m.append(m)
            go_rows.append(row)
            if len(drafts[i]) > depth:
                nxt.append(i)
        if go_m:
            fill_rows(go_m, bm, go_rows)
        active = nxt
    for i in range(n):
        a, d = accepted[i], drafts[i]
        if d:
            matchers[i].rollback(a)
            base, end = offsets[i], offsets[i] + 1 + len(d)
            if base + a + 1 < end:  # unused rows repeat the last valid one
                bm[base + a + 1 : end] = bm[base + a]
    return accepted
