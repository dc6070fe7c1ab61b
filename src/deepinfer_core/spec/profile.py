"""Step time as a function of query tokens per rank: the curve the MTPVarlen greedy trades against."""

from __future__ import annotations

import logging

import attrs
import numpy as np

log = logging.getLogger(__name__)

__all__ = ["PUBLISHED_DECODE_CURVE", "StepTimeProfile"]

# DeepInfer's published decode chart (EP64, 131K context, fixed three-draft verification) read back as
# milliseconds per step: (query tokens per rank, ms). From the seed code-reading.txt ("reasoned").
PUBLISHED_DECODE_CURVE: tuple[tuple[float, float], ...] = (
    (32.0, 9.99),
    (256.0, 13.20),
    (512.0, 18.21),
    (1024.0, 31.53),
)


def _as_knots(name: str, v: object) -> np.ndarray:
    a = np.array(v, dtype=np.float64, copy=True)  # a private copy: it is made read-only below
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name}: must be a non-empty 1-D sequence, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: must be finite")
    return a


def _pava(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) least-squares fit, pool-adjacent-violators."""
    vals: list[float] = []
    wts: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, s2 = vals.pop(), wts.pop(), sizes.pop()
            v1, w1, s1 = vals.pop(), wts.pop(), sizes.pop()
            vals.append((v1 * w1 + v2 * w2) / (w1 + w2))
            wts.append(w1 + w2)
            sizes.append(s1 + s2)
    return np.repeat(np.array(vals), sizes)


@attrs.frozen(eq=False)
class StepTimeProfile:
    """Piecewise-linear, monotone step time (ms) over query tokens per rank.

    Between knots: linear. Past the last knot: the last segment extended (linear extrapolation). Below the
    first knot: flat at the first value, since a tiny step is dominated by fixed costs (weight reads,
    collectives) and extrapolating the first slope downwards could reach zero or below. The same rule is
    evaluated in C++ by ``_C.spec`` (the greedy) and here in numpy (tests, simulations).
    """

    knots_x: np.ndarray = attrs.field(converter=lambda v: _as_knots("knots_x", v))
    knots_y: np.ndarray = attrs.field(converter=lambda v: _as_knots("knots_y", v))

    def __attrs_post_init__(self) -> None:
        x, y = self.knots_x, self.knots_y
        if x.shape != y.shape:
            raise ValueError(f"knots_x ({x.size}) and knots_y ({y.size}): must have the same length")
        if np.any(np.diff(x) <= 0):
            raise ValueError(f"knots_x: must be strictly increasing, got {x.tolist()}")
        if np.any(y <= 0):
            raise ValueError(f"knots_y: every step time must be > 0 ms, got {y.tolist()}")
        if np.any(np.diff(y) < 0):
            raise ValueError(
                f"knots_y: must be non-decreasing (step time is monotone in tokens), got {y.tolist()}"
            )
        x.flags.writeable = False
        y.flags.writeable = False

    @classmethod
    def published(cls) -> StepTimeProfile:
        """The shipped curve: 9.99 ms @ 32 tokens/rank, 13.20 @ 256, 18.21 @ 512, 31.53 @ 1,024."""
        xs, ys = zip(*PUBLISHED_DECODE_CURVE)
        return cls(xs, ys)

    @classmethod
    def fit(cls, tokens: object, ms: object, max_knots: int = 16) -> StepTimeProfile:
        """Fit a monotone piecewise-linear profile from measured ``(tokens, ms)`` samples.

        Samples are grouped by token count (or, with more than ``max_knots`` distinct counts, into
        ``max_knots`` quantile bins); each group gives a knot at its median tokens and median ms (the
        median shrugs off the occasional inflated step, e.g. a profiler-perturbed one), and a weighted
        isotonic regression over the knots makes the curve non-decreasing. Knots with equal x after
        binning are merged.
        """
        t = np.asarray(tokens, dtype=np.float64).ravel()
        y = np.asarray(ms, dtype=np.float64).ravel()
        if t.size != y.size:
            raise ValueError(f"tokens ({t.size}) and ms ({y.size}): must have the same number of samples")
        if t.size == 0:
            raise ValueError("tokens: at least one (tokens, ms) sample is required")
        if not (np.all(np.isfinite(t)) and np.all(np.isfinite(y))):
            raise ValueError("tokens, ms: samples must be finite")
        if np.any(t < 0) or np.any(y <= 0):
            raise ValueError("tokens must be >= 0 and ms > 0 in every sample")
        if max_knots < 1:
            raise ValueError(f"max_knots={max_knots}: must be >= 1")
        order = np.argsort(t, kind="stable")
        t, y = t[order], y[order]
        uniq = np.unique(t)
        if uniq.size <= max_knots:
            groups = np.searchsorted(uniq, t)
        else:
            edges = np.quantile(t, np.linspace(0, 1, max_knots + 1)[1:-1])
            groups = np.searchsorted(edges, t, side="right")
        kx, ky, kw = [], [], []
        for g in np.unique(groups):
            sel = groups == g
            kx.append(float(np.median(t[sel])))
            ky.append(float(np.median(y[sel])))
            kw.append(float(sel.sum()))
        kx_a, ky_a, kw_a = np.array(kx), np.array(ky), np.array(kw)
        # Equal medians of neighbouring bins would make x non-increasing: merge them.
        ux, inv = np.unique(kx_a, return_inverse=True)
        wy = np.bincount(inv, weights=ky_a * kw_a)
        ww = np.bincount(inv, weights=kw_a)
        fitted = _pava(wy / ww, ww)
        log.debug("fitted step-time profile with %d knots from %d samples", ux.size, t.size)
        return cls(ux, fitted)

    def __call__(self, tokens: object) -> np.ndarray:
        """Step time in ms at each token count (array in, array out)."""
        n = np.asarray(tokens, dtype=np.float64)
        x, y = self.knots_x, self.knots_y
        out = np.interp(n, x, y)  # flat outside [x0, x_last]
        if x.size > 1:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            out = np.where(n > x[-1], y[-1] + slope * (n - x[-1]), out)
        return out

    def step_ms(self, tokens: float) -> float:
        """Step time in ms for one token count."""
        return float(self(tokens))

    def scaled(self, factor: float) -> StepTimeProfile:
        """The same shape with every time multiplied by ``factor`` (e.g. another machine)."""
        if not factor > 0:
            raise ValueError(f"factor={factor}: must be > 0")
        return StepTimeProfile(self.knots_x, self.knots_y * factor)
