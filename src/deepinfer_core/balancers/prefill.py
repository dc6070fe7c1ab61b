"""Prefill load balancer: four tiers by total context, engines shared out by each tier's compute demand.

The deployment Q&A: requests are split by total context into < 16K, 16-64K, 64-256K and >= 256K tokens;
engines are reassigned across tiers by each tier's share of compute demand in the previous round. A
request's demand is its predicted prefill time (the scheduler's cost model over its chunks), so a 200K
request weighs what it costs, not what it counts. Within a tier a request goes to the engine with the
least predicted unfinished work. There is no prefix-affinity routing: any engine hits any prefix
through the external KV store, so the cached-token count only lowers the predicted cost.

Why tiers: a short prompt queued behind a 256K prefill waits seconds for its first token; keeping
lengths apart bounds that wait per tier, and reassigning by demand keeps the throughput of one pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from deepinfer_core.balancers.costs import MAX_CHUNK, StepCost, prefill_request_ns

logger = logging.getLogger(__name__)

K = 1024
DEFAULT_TIER_BOUNDS = (16 * K, 64 * K, 256 * K)


def tier_of(total_tokens: int | np.ndarray, bounds: Sequence[int] = DEFAULT_TIER_BOUNDS) -> int | np.ndarray:
    """Tier index: 0 for < bounds[0], ..., len(bounds) for >= bounds[-1]."""
    out = np.searchsorted(np.asarray(bounds), np.asarray(total_tokens), side="right")
    return int(out) if np.ndim(out) == 0 else out


def apportion(n: int, demand: np.ndarray, min_active: int = 1) -> np.ndarray:
    """Split ``n`` engines over tiers in proportion to ``demand`` (largest remainders), giving every tier
    with demand at least ``min_active`` while engines last (the biggest demands first)."""
    d = np.asarray(demand, dtype=np.float64)
    if n < 0 or np.any(d < 0) or not np.all(np.isfinite(d)):
        raise ValueError("apportion: need n >= 0 and finite demand >= 0")
    out = np.zeros(d.size, dtype=np.int64)
    total = d.sum()
    if total <= 0 or n == 0:
        return out
    active = np.flatnonzero(d > 0)
    floor_left = n
    for t in active[np.argsort(-d[active], kind="stable")]:
        give = min(min_active, floor_left)
        out[t] = give
        floor_left -= give
    if floor_left == 0:
        return out
    # the rest in proportion to demand, counting the minimums already given
    ideal = d / total * n
    extra = np.maximum(ideal - out, 0.0)
    if extra.sum() > 0:
        share = extra / extra.sum() * floor_left
        base = np.floor(share).astype(np.int64)
        out += base
        rem = floor_left - int(base.sum())
        order = np.argsort(-(share - base), kind="stable")
        out[order[:rem]] += 1
    else:
        out[int(np.argmax(d))] += floor_left
    return out


class PrefillBalancer:
    """Routes prefill requests to ``num_engines`` engines by tier; ``end_round()`` reassigns engines.

    The caller reports finished work with ``done(engine, predicted_ns)`` (the value ``route`` returned),
    which is how the balancer's view of unfinished work per engine stays current.
    """

    name = "tiers"

    def __init__(
        self,
        num_engines: int,
        cost: StepCost,
        *,
        bounds: Sequence[int] = DEFAULT_TIER_BOUNDS,
        cap: int = MAX_CHUNK,
        carry_backlog: bool = True,
    ) -> None:
        if not (isinstance(num_engines, int) and num_engines >= 1):
            raise ValueError(f"PrefillBalancer.num_engines={num_engines!r}: must be an int >= 1")
        b = list(bounds)
        if not b or any(not isinstance(x, int) or x < 1 for x in b) or b != sorted(set(b)):
            raise ValueError(f"PrefillBalancer.bounds={bounds!r}: must be strictly increasing ints >= 1")
        if not isinstance(cost, StepCost):
            raise TypeError("PrefillBalancer.cost: needs base_ns and chunk_ns(q, c) (a scheduler.CostModel)")
        self.cost = cost
        self.bounds = tuple(b)
        self.cap = cap
        self.num_tiers = len(b) + 1
        self.num_engines = num_engines
        # start evenly: engine e in tier e * T // N (low tiers get the remainder last)
        self.engine_tier = (np.arange(num_engines) * self.num_tiers // num_engines).astype(np.int64)
        self.outstanding_ns = np.zeros(num_engines)
        self.round_demand_ns = np.zeros(self.num_tiers)
        self.rounds = 0
        self.carry_backlog = bool(carry_backlog)

    def predict_ns(self, total_tokens: int, cached_tokens: int = 0) -> float:
        if not (0 <= cached_tokens <= total_tokens):
            raise ValueError(f"cached_tokens={cached_tokens}: must be in [0, total_tokens={total_tokens}]")
        return prefill_request_ns(self.cost, total_tokens - cached_tokens, cached_tokens, self.cap)

    def route(self, total_tokens: int, cached_tokens: int = 0) -> tuple[int, float]:
        """(engine, predicted ns) for a request of ``total_tokens`` context, ``cached_tokens`` of it hit."""
        ns = self.predict_ns(total_tokens, cached_tokens)
        t = tier_of(total_tokens, self.bounds)
        self.round_demand_ns[t] += ns
        cand = np.flatnonzero(self.engine_tier == t)
        if cand.size == 0:  # no engine in this tier yet: the nearest tier that has one (next round fixes it)
            have = np.unique(self.engine_tier)
            near = have[np.argmin(np.abs(have - t) - 0.5 * (have > t))]
            cand = np.flatnonzero(self.engine_tier == near)
        e = int(cand[np.argmin(self.outstanding_ns[cand])])
        self.outstanding_ns[e] += ns
        return e, ns

    def done(self, engine: int, predicted_ns: float) -> None:
        self.outstanding_ns[engine] = max(0.0, self.outstanding_ns[engine] - predicted_ns)

    def end_round(self) -> list[tuple[int, int, int]]:
        """Reassign engines by the round's demand shares; returns the moves (engine, from tier, to tier).
        Engines leaving a tier are those with the least unfinished work; they finish their queue."""
        demand = self.round_demand_ns.copy()
        if self.carry_backlog:  # work still queued in a tier is demand the next round must serve too
            demand += np.bincount(self.engine_tier, weights=self.outstanding_ns, minlength=self.num_tiers)
        self.round_demand_ns[:] = 0.0
        self.rounds += 1
        if demand.sum() <= 0:
            return []
        target = apportion(self.num_engines, demand)
        count = np.bincount(self.engine_tier, minlength=self.num_tiers)
        free: list[int] = []
        for t in range(self.num_tiers):
            if count[t] > target[t]:
                mine = np.flatnonzero(self.engine_tier == t)
                free += mine[np.argsort(self.outstanding_ns[mine], kind="stable")][
                    : count[t] - target[t]
                ].tolist()
        moves = []
        for t in range(self.num_tiers):
            for _ in range(max(0, target[t] - count[t])):
                e = free.pop(0)
                moves.append((e, int(self.engine_tier[e]), t))
                self.engine_tier[e] = t
        if moves:
            logger.debug("prefill round %d: demand %s -> engines per tier %s", self.rounds, demand, target)
        return moves


class RoundRobinPrefill:
    """Baseline: requests to engines in turn."""

    name = "round_robin"

    def __init__(self, num_engines: int, cost: StepCost, cap: int = MAX_CHUNK) -> None:
        self.num_engines, self.cost, self.cap, self._next = num_engines, cost, cap, 0

    def route(self, total_tokens: int, cached_tokens: int = 0) -> tuple[int, float]:
        e = self._next
        self._next = (e + 1) % self.num_engines
        return e, prefill_request_ns(self.cost, total_tokens - cached_tokens, cached_tokens, self.cap)

    def done(self, engine: int, predicted_ns: float) -> None:
        pass

    def end_round(self) -> list:
        return []


class LeastWorkPrefill(PrefillBalancer):
    """Baseline: one pool, least predicted unfinished work (no tiers)."""

    name = "least_work"

    def __init__(self, num_engines: int, cost: StepCost, cap: int = MAX_CHUNK) -> None:
        super().__init__(num_engines, cost, bounds=(1 << 62,), cap=cap)
        self.engine_tier[:] = 0

    def end_round(self) -> list:
        self.round_demand_ns[:] = 0.0
        return []
