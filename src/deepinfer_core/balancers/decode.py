"""Decode load balancer: placement by running requests and held KV, draining with a grace period, and
the scale-in guard.

A decode step of an engine costs ``base + a * running + b * kv_tokens`` (the cost model with q = 1), and
the DP ranks of a wide-EP decode group step together, so the group runs at its slowest rank. The
balancer keeps both terms level across engines: it places a request where it lowers the spread of
(running / mean) and (KV / mean) the most. A short request barely moves KV, so it goes to an engine with
few requests (typically one holding much KV in a few long requests); a long one goes where KV is low.
That is the Q&A's rule, derived rather than hard-coded.

Draining (scale-in, maintenance): a draining engine takes no new requests; after ``grace_s`` (60 s)
its unfinished requests and their KV are forwarded to the other engines, placed by the same rule. Scale-in
is refused while quota utilisation (the larger of running / slots and KV / capacity over the engines
taking requests) is above 0.8.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from deepinfer_core.balancers.costs import StepCost, decode_step_ns

logger = logging.getLogger(__name__)


class ScaleInRefused(RuntimeError):
    """Draining was asked for while quota utilisation is above the limit."""


class DecodeBalancer:
    """Places decode requests on ``num_engines`` engines of ``max_running`` slots and ``kv_capacity``
    tokens each. Load is reported by the caller each step (``report``); ``place`` also counts the new
    request at once so several placements between two reports stay balanced."""

    name = "requests+kv"

    def __init__(
        self,
        num_engines: int,
        cost: StepCost,
        *,
        max_running: int,
        kv_capacity: int,
        grace_s: float = 60.0,
        max_scale_in_utilisation: float = 0.8,
    ) -> None:
        for field, v in (
            ("num_engines", num_engines),
            ("max_running", max_running),
            ("kv_capacity", kv_capacity),
        ):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"DecodeBalancer.{field}={v!r}: must be an int >= 1")
        if not (math.isfinite(grace_s) and grace_s >= 0):
            raise ValueError(f"DecodeBalancer.grace_s={grace_s!r}: must be finite and >= 0")
        if not 0 < max_scale_in_utilisation <= 1:
            raise ValueError(
                f"DecodeBalancer.max_scale_in_utilisation={max_scale_in_utilisation!r}: must be in (0, 1]"
            )
        if not isinstance(cost, StepCost):
            raise TypeError("DecodeBalancer.cost: needs base_ns and chunk_ns(q, c) (a scheduler.CostModel)")
        self.cost = cost
        self.num_engines = num_engines
        self.max_running = max_running
        self.kv_capacity = kv_capacity
        self.grace_s = float(grace_s)
        self.max_scale_in_utilisation = float(max_scale_in_utilisation)
        self.running = np.zeros(num_engines, dtype=np.int64)
        self.kv = np.zeros(num_engines, dtype=np.int64)
        self.alive = np.ones(num_engines, dtype=bool)
        self.drain_deadline = np.full(num_engines, np.inf)  # inf: not draining

    # ---- load
    @property
    def accepting(self) -> np.ndarray:
        return self.alive & ~np.isfinite(self.drain_deadline)

    def report(self, running: Sequence[int] | np.ndarray, kv_tokens: Sequence[int] | np.ndarray) -> None:
        """Current load per engine (requests running, context tokens held)."""
        self.running[:] = running
        self.kv[:] = kv_tokens

    def utilisation(self) -> float:
        acc = self.accepting
        n = int(acc.sum())
        if n == 0:
            return 1.0
        return max(
            self.running[acc].sum() / (n * self.max_running), self.kv[acc].sum() / (n * self.kv_capacity)
        )

    def step_ns(self) -> np.ndarray:
        """Predicted decode step time of each engine at the current load."""
        return decode_step_ns(self.cost, self.running, self.kv)

    # ---- placement
    def _score(self, cand: np.ndarray, tokens: int) -> np.ndarray:
        """Change of sum over engines of ((r / mean_r - 1)^2 + (k / mean_k - 1)^2) if the request went to
        each candidate (means over engines taking requests, after the placement)."""
        acc = self.accepting
        n = max(int(acc.sum()), 1)
        mr = (self.running[acc].sum() + 1) / n
        mk = max((self.kv[acc].sum() + tokens) / n, 1.0)
        r = self.running[cand] / mr
        k = self.kv[cand] / mk
        dr, dk = 1.0 / mr, tokens / mk
        return (2 * (r - 1) * dr + dr * dr) + (2 * (k - 1) * dk + dk * dk)

    def _fits(self, tokens: int, exclude: int | None = None) -> np.ndarray:
        ok = self.accepting & (self.running < self.max_running) & (self.kv + tokens <= self.kv_capacity)
        if exclude is not None:
            ok[exclude] = False
        return np.flatnonzero(ok)

    def place(self, tokens: int, *, exclude: int | None = None) -> int | None:
        """Engine for a request holding ``tokens`` of context, or None if no engine has room now."""
        if not (isinstance(tokens, int | np.integer) and tokens >= 0):
            raise ValueError(f"tokens={tokens!r}: must be an int >= 0")
        cand = self._fits(int(tokens), exclude)
        if cand.size == 0:
            return None
        s = self._score(cand, int(tokens))
        e = int(cand[np.lexsort((cand, s))[0]])
        self.running[e] += 1
        self.kv[e] += tokens
        return e

    # ---- draining and scale-in
    def drain(self, engine: int, now_s: float, *, force: bool = False) -> float:
        """Stop placing on ``engine``; returns the time its remaining requests get forwarded. Raises
        ``ScaleInRefused`` above the utilisation limit unless ``force`` (a failing engine must go)."""
        if not (0 <= engine < self.num_engines) or not self.alive[engine]:
            raise ValueError(f"engine={engine}: not a live engine of {self.num_engines}")
        if not force and self.utilisation() > self.max_scale_in_utilisation:
            raise ScaleInRefused(
                f"quota utilisation {self.utilisation():.3f} > {self.max_scale_in_utilisation}: scale-in blocked"
            )
        if not np.isfinite(self.drain_deadline[engine]):
            self.drain_deadline[engine] = now_s + self.grace_s
        return float(self.drain_deadline[engine])

    def due(self, now_s: float) -> list[int]:
        """Draining engines whose grace period is over (their requests must be forwarded now)."""
        return np.flatnonzero(self.alive & (self.drain_deadline <= now_s)).tolist()

    def forward(self, engine: int, request_tokens: Sequence[int]) -> list[int | None]:
        """Targets for the unfinished requests of a draining ``engine`` (their context sizes), longest
        first placed; None where no engine has room (the caller re-queues it). The engine is retired."""
        tokens = np.asarray(request_tokens, dtype=np.int64)
        out: list[int | None] = [None] * tokens.size
        self.alive[engine] = False
        self.running[engine] = 0
        self.kv[engine] = 0
        for i in np.argsort(-tokens, kind="stable"):
            out[i] = self.place(int(tokens[i]))
        logger.info("decode: engine %d forwarded %d requests", engine, tokens.size)
        return out


class _Baseline(DecodeBalancer):
    def _pick(self, cand: np.ndarray, tokens: int) -> int:
        """The engine among the candidates ``cand`` (engine ids with room) a request of ``tokens`` goes to."""
        raise NotImplementedError

    def place(self, tokens: int, *, exclude: int | None = None) -> int | None:
        cand = self._fits(int(tokens), exclude)
        if cand.size == 0:
            return None
        e = int(self._pick(cand, int(tokens)))
        self.running[e] += 1
        self.kv[e] += tokens
        return e


class RoundRobinDecode(_Baseline):
    name = "round_robin"
    _next = 0

    def _pick(self, cand, tokens):
        e = cand[np.searchsorted(cand, self._next % self.num_engines) % cand.size]
        self._next = e + 1
        return e


class LeastRequestsDecode(_Baseline):
    name = "least_requests"

    def _pick(self, cand, tokens):
        return cand[np.lexsort((cand, self.running[cand]))[0]]


class LeastKVDecode(_Baseline):
    name = "least_kv"

    def _pick(self, cand, tokens):
        return cand[np.lexsort((cand, self.kv[cand]))[0]]


class LeastStepTimeDecode(_Baseline):
    """One dimension: the predicted step time (a * running + b * kv) after placement."""

    name = "least_step_time"

    def _pick(self, cand, tokens):
        t = decode_step_ns(self.cost, self.running[cand] + 1, self.kv[cand] + tokens)
        return cand[np.lexsort((cand, t))[0]]
