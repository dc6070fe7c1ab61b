"""SWA ring index arithmetic: pure functions of (number of tokens written, window, backtracking).

A layer's sliding-window KV lives in a ring of ``R = window + backtracking`` token slots (134 = 128 + 6
at the released shape). Token position ``p`` (0-based, absolute) is stored at ring index ``p % R``.
After ``n`` tokens the ring holds positions ``[max(0, n - R), n)``; attention reads only the last
``window`` of them, ``[max(0, n - window), n)``. The ``backtracking`` spare slots exist so that a rejected
speculative draft can be rolled back. A rollback writes nothing (the next writes overwrite the dropped
slots), so what is still intact depends on the *high-water mark* ``hw``, the largest token count ever
written since the slots were last valid: the ring holds positions ``[max(0, hw - R), n)``. Rolling back
``k`` more tokens keeps the whole window iff ``hw <= R`` (nothing overwritten yet) or
``k <= backtracking - (hw - n)``: rollbacks between two writes that reach a new high-water mark share one
budget of ``backtracking`` tokens. Functions take ``high_water`` (default: ``num_tokens``, i.e. no
outstanding rollback); callers keep ``hw = max(hw, n)`` after each write.
All functions take Python ints or int64 numpy arrays (vectorised over a batch).
"""

from __future__ import annotations

import numpy as np

from deepinfer_core.kv._checks import check_int

IntOrArray = int | np.ndarray


def _ring(window: int, backtracking: int) -> int:
    w = check_int("window", window, min_value=1)
    b = check_int("backtracking", backtracking, min_value=0)
    return w + b


def _nonneg(name: str, v: IntOrArray) -> IntOrArray:
    if isinstance(v, np.ndarray):
        if v.size and int(v.min()) < 0:
            raise ValueError(f"{name} must be >= 0 everywhere, got min {int(v.min())}")
        return v.astype(np.int64, copy=False)
    return check_int(name, v, min_value=0)


def ring_size(window: int, backtracking: int) -> int:
    """window + backtracking token slots."""
    return _ring(window, backtracking)


def write_index(num_tokens: IntOrArray, window: int, backtracking: int) -> IntOrArray:
    """Ring index where the next token (position ``num_tokens``) is written."""
    return _nonneg("num_tokens", num_tokens) % _ring(window, backtracking)


def ring_indices(start: int, count: int, window: int, backtracking: int) -> np.ndarray:
    """int64 ring indices of positions [start, start + count) (a write of ``count`` tokens).

    ``count`` may exceed the ring (a long prefill chunk): then only the last R positions survive, and
    the caller should write only those (see :func:`surviving_write`).
    """
    s = check_int("start", start, min_value=0)
    c = check_int("count", count, min_value=0)
    return np.arange(s, s + c, dtype=np.int64) % _ring(window, backtracking)


def surviving_write(start: int, count: int, window: int, backtracking: int) -> tuple[int, int]:
    """(first position, count) of a write of [start, start + count) that remains in the ring afterwards."""
    s = check_int("start", start, min_value=0)
    c = check_int("count", count, min_value=0)
    r = _ring(window, backtracking)
    first = max(s, s + c - r)
    return first, s + c - first


def _hw(num_tokens: IntOrArray, high_water: IntOrArray | None) -> IntOrArray:
    if high_water is None:
        return num_tokens
    hw = _nonneg("high_water", high_water)
    if np.asarray(hw < num_tokens).any():
        raise ValueError(f"high_water ({high_water}) must be >= num_tokens ({num_tokens})")
    return hw


def held_range(
    num_tokens: IntOrArray, window: int, backtracking: int, high_water: IntOrArray | None = None
) -> tuple[IntOrArray, IntOrArray]:
    """[lo, hi) of the valid positions physically present in the ring: [max(0, hw - R), n)."""
    n = _nonneg("num_tokens", num_tokens)
    hw = _hw(n, high_water)
    r = _ring(window, backtracking)
    return np.maximum(hw - r, 0) if isinstance(hw, np.ndarray) else max(hw - r, 0), n


def live_range(num_tokens: IntOrArray, window: int, backtracking: int = 0) -> tuple[IntOrArray, IntOrArray]:
    """[lo, hi) of the positions attention reads: the last ``window`` tokens."""
    n = _nonneg("num_tokens", num_tokens)
    w = check_int("window", window, min_value=1)
    check_int("backtracking", backtracking, min_value=0)
    return np.maximum(n - w, 0) if isinstance(n, np.ndarray) else max(n - w, 0), n


def live_ring_indices(num_tokens: int, window: int, backtracking: int) -> np.ndarray:
    """int64 ring indices of the live window, oldest first (what the SWA kernel gathers)."""
    lo, hi = live_range(num_tokens, window, backtracking)  # ints for an int num_tokens
    return np.arange(int(lo), int(hi), dtype=np.int64) % _ring(window, backtracking)


def ring_positions(
    num_tokens: int, window: int, backtracking: int, high_water: int | None = None
) -> np.ndarray:
    """int64 [R]: the valid position each ring slot holds (-1: empty, or stale after a rollback)."""
    n = check_int("num_tokens", num_tokens, min_value=0)
    hw = int(_hw(n, high_water))
    r = _ring(window, backtracking)
    idx = np.arange(r, dtype=np.int64)
    last = hw - 1 - ((hw - 1 - idx) % r)  # largest p < hw with p % r == idx: the last write there
    return np.where((idx < hw) & (last < n), last, -1)


def max_rollback(
    num_tokens: IntOrArray, window: int, backtracking: int, high_water: IntOrArray | None = None
) -> IntOrArray:
    """Largest k for which rolling back k tokens keeps the whole remaining window in the ring."""
    n = _nonneg("num_tokens", num_tokens)
    hw = _hw(n, high_water)
    r = _ring(window, backtracking)
    # While hw <= R nothing has been overwritten: any rollback (down to 0) keeps the window intact.
    budget = backtracking - (hw - n)
    if isinstance(n, np.ndarray) or isinstance(hw, np.ndarray):
        return np.where(hw <= r, n, np.clip(budget, 0, None))
    return n if hw <= r else max(budget, 0)


def rollback(
    num_tokens: IntOrArray,
    k: IntOrArray,
    window: int,
    backtracking: int,
    high_water: IntOrArray | None = None,
) -> IntOrArray:
    """New token count after dropping the last ``k`` tokens (rejected drafts); the high-water mark does
    not move. ValueError if the remaining window would need overwritten slots (``k > max_rollback``)."""
    n = _nonneg("num_tokens", num_tokens)
    kk = _nonneg("k", k)
    limit = max_rollback(n, window, backtracking, high_water)
    bad = np.asarray(kk > limit)
    if bad.any():
        raise ValueError(
            f"rollback of k={kk} tokens from num_tokens={n} (high_water={high_water}) exceeds the ring's "
            f"backtracking ({backtracking}): at most {limit} allowed"
        )
    return n - kk


def accumulator_fill(num_tokens: IntOrArray, ratio: int) -> IntOrArray:
    """Tokens in the compressor's open (partial) window: n % r. Ratio <= 1 layers keep none."""
    n = _nonneg("num_tokens", num_tokens)
    r = check_int("ratio", ratio, min_value=0)
    if r <= 1:
        return np.zeros_like(n) if isinstance(n, np.ndarray) else 0
    return n % r
