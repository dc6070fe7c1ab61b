"""The manager's general path: any backend (``fill_rows`` or one matcher at a time) and any ``out``.

Round 1's code, kept as the reference the fast path (``_fastpath``, ``fastfill.cpp``) is tested against.
With the byte filter on (``u8``: the manager's per-state next-state tables), a draft whose bytes the
filter rejects cuts the draft like a grammar rejection, and ``rs`` receives each row's filter state
(rows that copy another row get that row's state), so the caller can AND every row with its state's
mask in one C++ pass afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_core.protocols import GrammarMatcher

REJECT = 255


def _u8_next(tab: Sequence[bytes], s: int, t: Any) -> int:
    row = tab[s]
    return row[t] if 0 <= t < len(row) else REJECT


def _fill_request(
    m: GrammarMatcher, bm: torch.Tensor, base: int, drafts: Sequence[int],
    u8: Sequence[bytes] | None = None, s0: int = 0, rs: list[int] | None = None,
) -> int:
    """Accept-draft-then-fill rows ``base..base+k``; roll back; return how many drafts were accepted."""
    fill = getattr(m, "fill_unchecked", m.fill_next_token_bitmask)
    fill(bm, base)
    if rs is not None:
        rs[base] = s0
    if not drafts:
        return 0
    accepted, s = 0, s0
    for t in drafts:
        t = int(t)
        ns = s
        if u8 is not None:
            ns = _u8_next(u8, s, t)
            if ns == REJECT:
                break
        if not m.accept_token(t):
            break
        accepted += 1
        s = ns
        if m.is_terminated():
            # An accepted EOS draft ends the text: nothing is sampled after it, so the draft ends
            # here, and its row repeats the previous one rather than being all-masked.
            bm[base + accepted] = bm[base + accepted - 1]
            if rs is not None:
                rs[base + accepted] = rs[base + accepted - 1]
            break
        fill(bm, base + accepted)
        if rs is not None:
            rs[base + accepted] = s
    m.rollback(accepted)
    # Unused rows repeat the last valid one: never all-masked, never looser than the grammar.
    end = base + 1 + len(drafts)
    if base + accepted + 1 < end:
        bm[base + accepted + 1 : end] = bm[base + accepted]
        if rs is not None:
            rs[base + accepted + 1 : end] = [rs[base + accepted]] * (end - base - accepted - 1)
    return accepted


def _fill_wavefront(
    fill_rows: Any, matchers: list[GrammarMatcher], bm: torch.Tensor, offsets: list[int], drafts: list[Sequence[int]],
    u8: Sequence[bytes] | None = None, s0: Sequence[int] | None = None, rs: list[int] | None = None,
) -> list[int]:
    """The same rows as :func:`_fill_request`, one draft depth at a time across the batch.

    Each depth is one ``backend.fill_rows`` call, which the engines run on their own thread pools
    (xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``) without a Python call per row.
    """
    n = len(matchers)
    fill_rows(matchers, bm, offsets[:n])
    cur = list(s0) if s0 is not None else [0] * n
    if rs is not None:
        for i in range(n):
            rs[offsets[i]] = cur[i]
    accepted = [0] * n
    active = [i for i in range(n) if drafts[i]]
    depth = 0
    while active:
        depth += 1
        go_m, go_rows, nxt = [], [], []
        for i in active:
            m, t = matchers[i], int(drafts[i][depth - 1])
            ns = cur[i]
            if u8 is not None:
                ns = _u8_next(u8, cur[i], t)
                if ns == REJECT:
                    continue
            if not m.accept_token(t):
                continue
            accepted[i] = depth
            cur[i] = ns
            row = offsets[i] + depth
            if m.is_terminated():  # an accepted EOS draft: its row repeats the previous one
                bm[row] = bm[row - 1]
                if rs is not None:
                    rs[row] = rs[row - 1]
                continue
            if rs is not None:
                rs[row] = ns
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
                if rs is not None:
                    rs[base + a + 1 : end] = [rs[base + a]] * (end - base - a - 1)
    return accepted
