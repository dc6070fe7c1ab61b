"""The manager's general path: any backend (``fill_rows`` or one matcher at a time) and any ``out``.

Round 1's code, kept as the reference the fast path (``_fastpath``, ``fastfill.cpp``) is tested against.
With the byte filter on (``u8``: the manager's per-state next-state tables), a draft whose bytes the
filter rejects cuts the draft like a grammar rejection, and ``rs`` receives each row's filter state
(rows that copy another row get that row's state), so the caller can AND every row with its state's
mask in one C++ pass afterwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from deepinfer_core.protocols import GrammarMatcher

REJECT = 255


def _u8_next(tab: Sequence[bytes], s: int, t: Any) -> int:
    row = tab[s]
    return row[t] if 0 <= t < len(row) else REJECT


def _fill_request(
    m: GrammarMatcher,
    bm: torch.Tensor,
    base: int,
    drafts: Sequence[int],
    u8: Sequence[bytes] | None = None,
    s0: int = 0,
    rs: list[int] | None = None,
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
    fill_rows: Any,
    matchers: list[GrammarMatcher],
    bm: torch.Tensor,
    offsets: list[int],
    drafts: list[Sequence[int]],
    u8: Sequence[bytes] | None = None,
    s0: Sequence[int] | None = None,
    rs: list[int] | None = None,
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


def fill_general(
    mgr: Any, batch: Sequence[tuple[Hashable, Sequence[int]]], out: torch.Tensor | None, batch_mask: type
) -> Any:
    """Any backend, any ``out``: the reference the fast path is tested against."""
    # Per-call and per-request costs in Python are what this layer adds to the engines' own work,
    # so one loop gathers offsets and matchers, the buffer views are cached between calls, and the
    # draft-free case (the common one) skips the draft machinery.
    n = len(batch)
    offsets = [0] * (n + 1)
    matchers: list[GrammarMatcher] = [None] * n  # type: ignore[list-item]
    reqs, total, any_drafts = mgr._requests, 0, False
    for i, (rid, drafts) in enumerate(batch):
        req = reqs.get(rid)
        m = req.matcher if req is not None and req.finish is None else None
        # Fail before touching any state; the checks' calls run only off the common path.
        matchers[i] = m if m is not None else mgr._active_matcher(rid)
        if drafts:
            any_drafts = True
            total += 1 + len(drafts)
        else:
            total += 1
        offsets[i + 1] = total
    bm, a, tail = views(mgr, total, out)
    fill_rows = getattr(mgr._backend, "fill_rows", None)
    u8 = mgr._u8f
    tab = mgr._u8tab if u8 is not None else None
    s0 = [mgr._u8[rid] for rid, _ in batch] if u8 is not None else None
    rs: list[int] | None = [0] * total if u8 is not None else None
    if not any_drafts:
        if fill_rows is not None:
            fill_rows(matchers, bm, offsets[:n])
        else:
            for m, off in zip(matchers, offsets):
                getattr(m, "fill_unchecked", m.fill_next_token_bitmask)(bm, off)
        num_drafts = np.zeros(n, dtype=np.int64)
        rs = s0
    elif fill_rows is not None:
        batch_drafts: list[Sequence[int]] = [d for _, d in batch]
        num_drafts = np.array(
            _fill_wavefront(fill_rows, matchers, bm, offsets, batch_drafts, tab, s0, rs), dtype=np.int64
        )
    else:
        k = [
            _fill_request(m, bm, off, d, tab, s0[i] if s0 is not None else 0, rs)
            for i, (m, off, (_, d)) in enumerate(zip(matchers, offsets, batch))
        ]
        num_drafts = np.array(k, dtype=np.int64)
    if u8 is not None and total:  # the byte filter, before the dead-row pass (it can empty a row)
        u8.apply_ptr(bm.data_ptr(), mgr._words, rs)
    offs, dead_end = np.array(offsets, dtype=np.int64), np.zeros(n, dtype=bool)
    # One pass clears the padding bits and finds rows that allow nothing: row 0 is a dead end of
    # the request, a later row is a state a draft reached but no token can continue, so the draft
    # is cut before it. (Rows past a request's surviving drafts copy its last valid row, so a dead
    # row always lies within the valid ones.)
    dead_rows = _finish_rows(a, tail, mgr._tail_keep, mgr._tail_keep_c)
    if len(dead_rows):
        mgr._cut_rows(batch, a, offs, dead_rows, num_drafts, dead_end)
    return batch_mask(bitmask=bm, offsets=offs, num_drafts=num_drafts, dead_end=dead_end)


def views(
    mgr: Any, rows: int, out: torch.Tensor | None
) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
    """(tensor rows, the same memory as numpy, its last column when it has padding bits)."""
    if out is None:
        if mgr._buf.shape[0] < rows:
            mgr._grow(rows)
        hit = mgr._view_cache.get(rows)
        if hit is None:
            bm = mgr._buf[:rows]
            a = bm.numpy()
            hit = mgr._view_cache[rows] = (bm, a, a[:, -1] if mgr._tail_keep is not None else None)
        return hit
    if out.dtype != torch.int32 or out.device.type != "cpu" or out.dim() != 2 or not out.is_contiguous():
        raise ValueError(
            f"out: must be a contiguous 2-D int32 CPU tensor, got {out.dtype} {tuple(out.shape)}"
        )
    if out.shape[1] != mgr._words or out.shape[0] < rows:
        raise ValueError(f"out: shape {tuple(out.shape)}; needs at least [{rows}, {mgr._words}]")
    bm = out[:rows]
    a = bm.numpy()
    return bm, a, a[:, -1] if mgr._tail_keep is not None else None


def _finish_rows_numpy(a: np.ndarray, tail: np.ndarray | None, keep: np.int32 | None) -> list[int]:
    if tail is not None:
        assert keep is not None  # a tail to mask comes with its mask
        np.bitwise_and(tail, keep, out=tail)
    return np.flatnonzero(~a.any(axis=1)).tolist()


def _finish_rows(a: np.ndarray, tail: np.ndarray | None, keep: np.int32 | None, keep_c: int) -> list[int]:
    """Clear padding bits, return the all-zero rows: C++ (stops at each row's first set word) or numpy.

    ``keep`` is the valid-bit mask of the last word as int32 (None: no padding); ``keep_c`` the same as a
    non-negative int for the C++ pass (-1: no padding)."""
    if _C_FINISH_ROWS is None:
        return _finish_rows_numpy(a, tail, keep)
    return _C_FINISH_ROWS(a, keep_c)


try:  # the C++ pass is an optimisation; a tree whose extension predates it still works
    from deepinfer_core._C import structured as _C_structured

    _C_FINISH_ROWS: Any = _C_structured.finish_rows
except (ImportError, AttributeError):  # pragma: no cover - depends on the build
    _C_FINISH_ROWS = None
