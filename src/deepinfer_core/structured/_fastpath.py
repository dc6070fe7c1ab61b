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
    EOS_ONLY: Any = _C_structured.eos_only_rows_ptr
except (ImportError, AttributeError):  # pragma: no cover - depends on the build
    FINISH_PTR = COUNT_DEAD = EOS_ONLY = None
_FastFill: Any  # None where the build predates it
try:  # round 3: the whole per-call path in C++ (csrc/structured/fastfill.cpp)
    from deepinfer_core._C.structured import FastFill as _FastFill
except (ImportError, AttributeError):  # pragma: no cover - depends on the build
    _FastFill = None

_KINDS = {"xgrammar": 0, "llguidance": 1}


def has_fast_path(backend: object) -> bool:
    return FINISH_PTR is not None and all(
        callable(getattr(backend, a, None)) for a in ("batch_key", "fill_keys", "accept_key")
    )


def make_fast_fill(
    mgr: Any, backend: Any, batch_mask_type: type, keys: dict | None = None, fallback: Any = None
) -> Any | None:
    """The C++ ``fill_bitmask`` for ``mgr`` (``FastFill.fill``), or None to keep the Python fast path.

    Only for the two backends whose library calls fastfill.cpp makes itself: the backend says so with
    ``fast_fill_kind`` ("xgrammar" when it has xgrammar's batch handle, "llguidance" when it fills one
    matcher at a time, i.e. without an LLExecutor). The object shares the manager's ``_keys`` and
    ``_fast_views`` dicts (never rebound, only mutated) and falls back to the class's Python
    ``fill_bitmask``. ``keys`` / ``fallback`` replace the key dict and the fallback method (the auto
    backend's second engine has its own keys and falls back to the general path).
    """
    kind = _KINDS.get(getattr(backend, "fast_fill_kind", None))  # type: ignore[arg-type]
    keys = mgr._keys if keys is None else keys
    if _FastFill is None or kind is None or keys is None:
        return None
    import numpy as np

    ff = _FastFill(
        kind,
        keys,
        mgr._fast_views,
        mgr,
        type(mgr).fill_bitmask if fallback is None else fallback,
        backend.fill_keys if kind == 0 else None,
        backend.accept_key if kind == 1 else None,
        batch_mask_type,
        np.empty,
        np.zeros,
        np.dtype(np.int64),
        np.dtype(np.bool_),
        mgr._words,
        mgr._vocab_size,
        mgr._tail_keep_c,
        int(backend.eos_token_id),
        sorted(getattr(backend, "key_refuse", ())),
    )
    return ff


def fill_drafts(
    backend: Any, keys: list[Any], bm: Any, offsets: list[int], drafts: list[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """Accept-draft-then-fill, one ``fill_keys`` call per draft depth across the batch; roll back.

    Returns (drafts accepted per request, flat (src, end) row copies for the C++ pass: rows after a
    request's last valid row repeat it). An accepted EOS draft ends its request's draft and its row
    repeats the previous one (nothing is sampled after EOS). Raises whatever the depth-0 fill raises
    before any state changed, or a TypeError after rolling every matcher back (the caller then takes
    the general path). ``offsets`` has ``n + 1`` entries.
    """
    n = len(keys)
    fill = backend.fill_keys
    fill(keys, bm, offsets[:n], False)
    accepted = [0] * n
    eos_at: set[int] = set()
    drafted = active = [i for i in range(n) if drafts[i]]
    # xgrammar's handles are stepped inline (its refusal set and EOS id from the backend): a Python
    # call per draft would be most of what the manager adds per draft. Other keys go through
    # backend.accept_key.
    refuse, eos = getattr(backend, "key_refuse", None), getattr(backend, "key_eos", None)
    accept = backend.accept_key
    llg_eos = getattr(backend, "key_inline_eos", None)
    depth = 0
    try:
        while active:
            depth += 1
            go, rows, nxt = [], [], []
            for i in active:
                d = drafts[i]
                t = d[depth - 1]  # ints (numpy ints too); anything else raises TypeError below
                key = keys[i]
                if refuse is not None:
                    if t in refuse or not key.accept_token(t, False):
                        continue
                    accepted[i] = depth
                    if t == eos:  # EOS: not filled; the copy pass repeats the previous row
                        eos_at.add(i)
                        continue
                elif llg_eos is not None and t != llg_eos and not key._terminated:
                    # llguidance, a non-EOS token on a live matcher: LLGuidanceMatcher.accept_token
                    # without its Python frame (the same two steps; fast == general tests hold it).
                    t = int(t)
                    if key._m.try_consume_tokens([t]) != 1:
                        continue
                    key._history.append(t)
                    accepted[i] = depth
                else:
                    r = accept(key, t)
                    if not r:
                        continue
                    accepted[i] = depth
                    if r == 2:
                        eos_at.add(i)
                        continue
                go.append(key)
                rows.append(offsets[i] + depth)
                if len(d) > depth:
                    nxt.append(i)
            if go:
                fill(go, bm, rows, False)
            active = nxt
    except Exception:  # e.g. a draft that is not an int: leave every matcher where it was
        for key, a in zip(keys, accepted):
            if a:
                key.rollback(a)
        raise
    copies: list[int] = []
    for i in drafted:
        a = accepted[i]
        if a:
            keys[i].rollback(a)  # xgrammar handles and our matchers both roll back this way
        end = offsets[i + 1]
        src = offsets[i] + a
        if i in eos_at:
            copies += (src - 1, end)
        elif src + 1 < end:
            copies += (src, end)
    return accepted, copies
