"""Independent oracles for the spec tests: brute force over prefix-closed selections, float64 numpy."""

from __future__ import annotations

import itertools

import numpy as np


def curve_ms(xs: np.ndarray, ys: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The documented step-time rule, written out directly: flat below the first knot, linear between
    knots, the last segment extended past the last knot."""
    n = np.asarray(n, dtype=np.float64)
    out = np.empty_like(n)
    for idx, v in np.ndenumerate(n):
        if len(xs) == 1 or v <= xs[0]:
            out[idx] = ys[0]
            continue
        j = len(xs) - 1
        for t in range(1, len(xs)):
            if v < xs[t]:
                j = t
                break
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        out[idx] = y0 + (y1 - y0) * (v - x0) / (x1 - x0)
    return out


def cumulative_rates(acceptance: np.ndarray) -> np.ndarray:
    return np.cumprod(np.asarray(acceptance, dtype=np.float64), axis=1)


def brute_force(acceptance: np.ndarray, num_drafts: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> float:
    """Best expected tokens per ms over every prefix-closed selection (every l with 0 <= l_i <= n_i)."""
    R = acceptance.shape[0]
    c = cumulative_rates(acceptance)
    # prefix[i, l] = expected tokens of request i when its first l drafts are verified
    prefix = np.concatenate([np.ones((R, 1)), 1.0 + np.cumsum(c, axis=1)], axis=1)
    combos = np.array(list(itertools.product(*[range(int(n) + 1) for n in num_drafts])), dtype=np.int64)
    e = prefix[np.arange(R)[None, :], combos].sum(axis=1)
    t = curve_ms(xs, ys, R + combos.sum(axis=1))
    return float((e / t).max())


def expected_tokens(acceptance: np.ndarray, lengths: np.ndarray) -> float:
    c = cumulative_rates(acceptance)
    return float(acceptance.shape[0] + sum(c[i, : int(k)].sum() for i, k in enumerate(lengths)))


def top_total_lengths(acceptance: np.ndarray, num_drafts: np.ndarray, total: int) -> np.ndarray:
    """Lengths keeping the `total` drafts of highest cumulative rate; ties by (request, position)."""
    c = cumulative_rates(acceptance)
    items = [(-c[i, k], i, k) for i in range(c.shape[0]) for k in range(int(num_drafts[i]))]
    items.sort()
    out = np.zeros(c.shape[0], dtype=np.int64)
    for _, i, _k in items[:total]:
        out[i] += 1
    return out
