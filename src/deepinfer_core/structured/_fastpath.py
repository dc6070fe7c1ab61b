"""The manager's fast path: draft rows over a backend's batch keys, and the C++ finishing pass.

A backend that offers ``batch_key`` / ``fill_keys`` / ``accept_key`` / ``rollback_key`` lets the manager
keep, per active request, the object the backend's batch call takes (xgrammar: its C++ matcher handle),
so a step costs one dict lookup per request plus one library call per draft depth. Masks are the same
as the general path's (``tests/deepinfer_core/structured/test_fast_path.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:  # the C++ pass is what makes the fast path cheap; without it the manager keeps the general path
    from deepinfer_core._C import structured as _C_structured

    FINISH_PTR: Any = _C_structured.finish_rows_ptr
    COUNT_DEAD: Any = _C_structured.count_dead_ptr
except (ImportError, AttributeError):  # pragma: no cover - depends on the build
    FINISH_PTR = COUNT_DEAD = None


def has_fast_path(backend: object) -> bool:
    return FINISH_PTR is not None and all(
        callable(getattr(backend, a, None)) for a in ("batch_key", "fill_keys", "accept_key", "rollback_key")
    )


def fill_drafts(
    backend: Any, keys: list[Any], bm: Any, offsets: list[int], drafts: list[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """Accept-draft-then-fill, one ``fill_keys`` call per draft depth across the batch; roll back.

    Returns (drafts accepted per request, flat (src, end) row copies for the C++ pass: rows after a
    request's last valid row repeat it). An accepted EOS draft ends its request's draft and its row
    repeats the previous one (nothing is sampled after EOS). Raises whatever the depth-0 fill raises
    before any state changed (the caller then takes the general path).
    """
    n = len(keys)
    fill, accept = backend.fill_keys, backend.accept_key
    fill(keys, bm, offsets[:n], False)
    accepted = [0] * n
    eos_at: set[int] = set()
    active = [i for i in range(n) if drafts[i]]
    depth = 0
    while active:
        depth += 1
        go, rows, nxt = [], [], []
        for i in active:
            d = drafts[i]
            r = accept(keys[i], int(d[depth - 1]))
            if not r:
                continue
            accepted[i] = depth
            if r == 2:  # EOS: not filled; the copy pass repeats the previous row
                eos_at.add(i)
                continue
            go.append(keys[i])
            rows.append(offsets[i] + depth)
            if len(d) > depth:
                nxt.append(i)
        if go:
            fill(go, bm, rows, False)
        active = nxt
    rollback, copies = backend.rollback_key, []
    for i in range(n):
        d = drafts[i]
        if d:
            a = accepted[i]
            if a:
                rollback(keys[i], a)
            src = offsets[i] + a - (i in eos_at)
            end = offsets[i] + 1 + len(d)
            if src + 1 < end:
                copies += (src, end)
    return accepted, copies
