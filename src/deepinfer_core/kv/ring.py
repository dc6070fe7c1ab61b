"""SWA ring index arithmetic: pure functions of (number of tokens written, window, backtracking).

A layer's sliding-window KV lives in a ring of ``R = window + backtracking`` token slots (134 = 128 + 6
at the released shape). Token position ``p`` (0-based, absolute) is stored at ring index ``p % R``.
After ``n`` tokens the ring holds positions ``[max(0, n - R), n)``; attention reads only the last
``window`` of them, ``[max(0, n - window), n)``. The ``backtracking`` spare slots exist so that a rejected
speculative draft can be rolled back: after dropping the last ``k`` tokens, the window of the shorter
sequence, ``[n - k - window, n - k)``, is still in the ring iff ``k <= backtracking`` (or the sequence is
shorter than the ring). A rollback writes nothing: the next writes simply overwrite the dropped slots.
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


def held_range(num_tokens: IntOrArray, window: int, backtracking: int) -> tuple[IntOrArray, IntOrArray]:
    """[lo, hi) of the positions physically present in the ring after ``num_tokens`` tokens."""
    n = _nonneg("num_tokens", num_tokens)
    r = _ring(window, backtracking)
    return np.maximum(n - r, 0) if isinstance(n, np.ndarray) else max(n - r, 0), n


def live_range(num_tokens: IntOrArray, window: int, backtracking: int = 0) -> tuple[IntOrArray, IntOrArray]:
    """[lo, hi) of the positions attention reads: the last ``window`` tokens."""
    n = _nonneg("num_tokens", num_tokens)
    w = check_int("window", window, min_value=1)
    check_int("backtracking", backtracking, min_value=0)
    return np.maximum(n - w, 0) if isinstance(n, np.ndarray) else max(n - w, 0), n


def live_ring_indices(num_tokens: int, window: int, backtracking: int) -> np.ndarray:
    """int64 ring indices of the live window, oldest first (what the SWA kernel gathers)."""
    lo, hi = live_range(num_tokens, window, backtracking)
    return np.arange(lo, hi, dtype=np.int64) % _ring(window, backtracking)


def ring_positions(num_tokens: int, window: int, backtracking: int) -> np.ndarray:
    """int64 [R]: the absolute position each ring slot holds after ``num_tokens`` tokens (-1: empty)."""
    n = check_int("num_tokens", num_tokens, min_value=0)
    r = _ring(window, backtracking)
    idx = np.arange(r, dtype=np.int64)
    # largest p < n with p % r == idx
    last = n - 1 - ((n - 1 - idx) % r)
    return np.where(idx < n, last, -1)


def max_rollback(num_tokens: IntOrArray, window: int, backtracking: int) -> IntOrArray:
    """Largest k for which rolling back k tokens keeps the whole remaining window in the ring."""
    n = _nonneg("num_tokens", num_tokens)
    r = _ring(window, backtracking)
    # While n <= R nothing has been overwritten yet: any rollback (to 0) keeps the window intact.
    if isinstance(n, np.ndarray):
        return np.where(n <= r, n, backtracking)
    return n if n <= r else backtracking


def rollback(num_tokens: IntOrArray, k: IntOrArray, window: int, backtracking: int) -> IntOrArray:
    """New token count after dropping the last ``k`` tokens (rejected drafts). ValueError if the remaining
    window would need overwritten slots (``k > max_rollback``) or ``k > num_tokens``."""
    n = _nonneg("num_tokens", num_tokens)
    kk = _nonneg("k", k)
    limit = max_rollback(n, window, backtracking)
    bad = np.asarray(kk > limit)
    if bad.any():
        raise ValueError(
            f"rollback of k={kk} tokens from num_tokens={n} exceeds the ring's backtracking "
            f"({backtracking}): at most {limit} allowed"
        )
    return n - kk


def accumulator_fill(num_tokens: IntOrArray, ratio: int) -> IntOrArray:
    """Tokens in the compressor's open (partial) window: n % r. Ratio <= 1 layers keep none."""
    n = _nonneg("num_tokens", num_tokens)
    r = check_int("ratio", ratio, min_value=0)
    if r <= 1:
        return np.zeros_like(n) if isinstance(n, np.ndarray) else 0
    return n % r
