"""Quadratic prefill step-time model cost(q, c), its least-squares fit, and the chunk-size solver.

A prefill step computing chunks (q_i new tokens of a request with c_i tokens already computed) takes
``base_ns + sum_i(token_ns*q_i + quad_ns*q_i**2 + ctx_ns*q_i*c_i)``: a per-step constant, linear work
per token (GEMMs, MoE), attention of a chunk to itself (~q^2) and to the request's cached prefix (q*c).
The solver (in C++, used by the scheduler every step) returns the largest q that fits a budget.
"""

from __future__ import annotations

import itertools
import logging

import attrs
import numpy as np

from deepinfer_core import _C

logger = logging.getLogger(__name__)

_NAMES = ("base_ns", "token_ns", "quad_ns", "ctx_ns")


def _nonneg(inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not (np.isfinite(value) and value >= 0.0):
        raise ValueError(f"CostModel.{attribute.name}={value}: must be finite and >= 0")


@attrs.frozen
class CostModel:
    """Predicted prefill step time in nanoseconds. All coefficients >= 0 (cost never falls as q grows)."""

    base_ns: float = attrs.field(default=0.0, converter=float, validator=_nonneg)
    token_ns: float = attrs.field(default=0.0, converter=float, validator=_nonneg)
    quad_ns: float = attrs.field(default=0.0, converter=float, validator=_nonneg)
    ctx_ns: float = attrs.field(default=0.0, converter=float, validator=_nonneg)

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.base_ns, self.token_ns, self.quad_ns, self.ctx_ns)

    def chunk_ns(self, q: np.ndarray | int, c: np.ndarray | int) -> np.ndarray | float:
        """Variable cost of chunks (no per-step base); same evaluation order as the C++ core."""
        qd = np.asarray(q, dtype=np.float64)
        cd = np.asarray(c, dtype=np.float64)
        out = self.token_ns * qd + self.quad_ns * qd * qd + self.ctx_ns * qd * cd
        return float(out) if out.ndim == 0 else out

    def predict(self, q: np.ndarray | int, c: np.ndarray | int) -> np.ndarray | float:
        """Time of a step that computes one chunk of q tokens after c computed ones."""
        out = self.base_ns + np.asarray(self.chunk_ns(q, c))
        return float(out) if out.ndim == 0 else out

    def step_ns(self, q: np.ndarray, c: np.ndarray) -> float:
        """Time of a step with several chunks (arrays of the same length); 0 for an empty step."""
        q = np.asarray(q)
        if q.size == 0:
            return 0.0
        return self.base_ns + float(np.sum(self.chunk_ns(q, c)))

    def max_chunk(self, c: int, budget_ns: float, *, spent_ns: float | None = None, cap: int = 32768) -> int:
        """Largest q in [0, cap] with spent + chunk_ns(q, c) <= budget; ``spent`` defaults to base_ns
        (the chunk opens the step)."""
        spent = self.base_ns if spent_ns is None else float(spent_ns)
        return int(_C.scheduler.max_chunk(*self.as_tuple(), int(c), spent, float(budget_ns), int(cap)))

    @classmethod
    def fit(cls, q: np.ndarray, c: np.ndarray, ns: np.ndarray, *, relative: bool = True) -> CostModel:
        """Least-squares fit from measured single-chunk prefill steps (q new tokens, c cached, ns time).

        Non-negative least squares, solved exactly: with four coefficients we solve the ordinary
        least-squares problem on every subset of columns and keep the best one whose coefficients are
        all >= 0 (the NNLS optimum is the unconstrained optimum on its own support). Columns are scaled
        to unit norm first because q^2 and q*c are many orders of magnitude larger than 1.

        ``relative=True`` (default) minimises relative error, sum(((pred - ns) / ns)^2): step-time noise
        grows with the step, so a plain fit would let the longest steps drown the short ones.
        """
        qa = np.asarray(q, dtype=np.float64).reshape(-1)
        ca = np.asarray(c, dtype=np.float64).reshape(-1)
        ya = np.asarray(ns, dtype=np.float64).reshape(-1)
        if not (qa.shape == ca.shape == ya.shape):
            raise ValueError(
                f"CostModel.fit: q, c, ns must have the same length, got {qa.size}, {ca.size}, {ya.size}"
            )
        if qa.size < 4:
            raise ValueError(f"CostModel.fit: need >= 4 samples for 4 coefficients, got {qa.size}")
        if not (np.all(qa >= 1) and np.all(ca >= 0) and np.all(np.isfinite(ya)) and np.all(ya >= 0)):
            raise ValueError("CostModel.fit: need q >= 1, c >= 0 and finite ns >= 0 in every sample")
        a = np.stack([np.ones_like(qa), qa, qa * qa, qa * ca], axis=1)
        if relative:
            w = 1.0 / np.maximum(ya, np.finfo(np.float64).tiny)
            a = a * w[:, None]
            ya = ya * w
        norms = np.linalg.norm(a, axis=0)
        norms[norms == 0] = 1.0
        an = a / norms
        best: tuple[float, np.ndarray] | None = None
        for k in range(1, 5):
            for cols in itertools.combinations(range(4), k):
                sol, *_ = np.linalg.lstsq(an[:, cols], ya, rcond=None)
                if np.any(sol < 0):
                    continue
                coef = np.zeros(4)
                coef[list(cols)] = sol
                res = float(np.sum((an @ coef - ya) ** 2))
                if best is None or res < best[0]:
                    best = (res, coef)
        coef = np.zeros(4) if best is None else best[1] / norms
        model = cls(*[float(max(x, 0.0)) for x in coef])
        logger.debug("fitted %s from %d samples (relative=%s)", model, qa.size, relative)
        return model
