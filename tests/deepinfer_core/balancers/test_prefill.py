"""Prefill tiers, apportioning by demand, routing and reassignment, checked against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.balancers import (
    LeastWorkPrefill,
    PrefillBalancer,
    apportion,
    prefill_chunks,
    prefill_request_ns,
    tier_of,
)
from deepinfer_core.scheduler import CostModel

COST = CostModel(base_ns=5e6, token_ns=8000.0, quad_ns=0.05, ctx_ns=0.05)


def test_tier_boundaries():
    K = 1024
    got = [tier_of(x) for x in (1, 16 * K - 1, 16 * K, 64 * K - 1, 64 * K, 256 * K - 1, 256 * K, 10**7)]
    assert got == [0, 0, 1, 1, 2, 2, 3, 3]


@settings(max_examples=60)
@given(n=st.integers(0, 40), demand=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=4, max_size=4))
def test_apportion_quota_property(n, demand):
    d = np.array(demand)
    out = apportion(n, d)
    if d.sum() <= 0 or n == 0:
        assert out.sum() == 0
        return
    assert out.sum() == n and np.all(out >= 0)
    assert np.all(out[d == 0] == 0)
    active = d > 0
    if n >= active.sum():
        assert np.all(out[active] >= 1)
    ideal = d / d.sum() * n
    if np.all(ideal[active] >= 1):  # minimums do not bind: largest remainders stay within 1 of ideal
        assert np.all(np.abs(out - ideal) < 1 + 1e-9)
        # and no allocation with the same sum is closer in the max norm by a whole engine (brute force)
        if n <= 12:
            best = min(
                max(abs(np.array(c) - ideal))
                for c in itertools.product(range(n + 1), repeat=4)
                if sum(c) == n and all(c[t] == 0 for t in range(4) if not active[t])
            )
            assert max(abs(out - ideal)) < best + 1


@settings(max_examples=40)
@given(new=st.integers(0, 200_000), cached=st.integers(0, 300_000), cap=st.integers(1, 40_000))
def test_chunks_and_request_cost(new, cached, cap):
    q, c = prefill_chunks(new, cached, cap)
    assert q.sum() == new and np.all((q >= 1) & (q <= cap))
    # brute force: one chunk after another, each a full step of the scheduler's own model
    done, total = cached, 0.0
    for qi, ci in zip(q, c):
        assert ci == done
        total += COST.predict(int(qi), int(ci))
        done += qi
    assert prefill_request_ns(COST, new, cached, cap) == pytest.approx(total, rel=1e-12)


@settings(max_examples=40)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 600_000), st.floats(0, 0.95)), min_size=1, max_size=60),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_route_is_least_work_within_tier(reqs, n, seed):
    bal = PrefillBalancer(n, COST)
    rng = np.random.default_rng(seed)
    outstanding = np.zeros(n)
    for tot, hit in reqs:
        cached = int(tot * hit)
        t = tier_of(tot)
        tiers = bal.engine_tier.copy()
        e, ns = bal.route(tot, cached)
        assert ns == pytest.approx(prefill_request_ns(COST, tot - cached, cached))
        cand = np.flatnonzero(tiers == t)
        if cand.size == 0:  # the nearest tier that has engines (ties: the higher one)
            have = sorted(set(tiers.tolist()))
            near = min(have, key=lambda x: (abs(x - t), -x))
            cand = np.flatnonzero(tiers == near)
        assert e in cand and outstanding[e] == min(outstanding[cand])
        outstanding[e] += ns
        if rng.uniform() < 0.3:  # some work finishes
            f = int(rng.integers(n))
            bal.done(f, outstanding[f] / 2)
            outstanding[f] -= outstanding[f] / 2
        np.testing.assert_allclose(bal.outstanding_ns, outstanding)


@settings(max_examples=40)
@given(
    demand=st.lists(st.floats(0, 1e9, allow_nan=False), min_size=4, max_size=4),
    n=st.integers(1, 24),
    load=st.lists(st.floats(0, 1e9, allow_nan=False), min_size=24, max_size=24),
)
def test_end_round_reaches_the_apportioned_targets(demand, n, load):
    bal = PrefillBalancer(n, COST, carry_backlog=False)
    bal.outstanding_ns[:] = load[:n]
    bal.round_demand_ns[:] = demand
    before = bal.engine_tier.copy()
    moves = bal.end_round()
    d = np.array(demand)
    want = apportion(n, d) if d.sum() > 0 else np.bincount(before, minlength=4)
    assert np.array_equal(np.bincount(bal.engine_tier, minlength=4), want)
    moved = {e for e, _, _ in moves}
    assert (
        len(moved) == len(moves) == int(np.sum(before != bal.engine_tier))
    )  # each engine moves once, only if needed
    assert len(moves) == int(np.maximum(np.bincount(before, minlength=4) - want, 0).sum())  # the fewest moves
    for t in range(4):  # engines leaving a tier are its least loaded ones
        left = [e for e in moved if before[e] == t]
        stayed = [e for e in np.flatnonzero(before == t) if e not in moved]
        if left and stayed:
            assert max(bal.outstanding_ns[left]) <= min(bal.outstanding_ns[stayed])
    assert np.all(bal.round_demand_ns == 0)


def test_backlog_counts_as_demand():
    bal = PrefillBalancer(8, COST)
    bal.engine_tier[:] = [0, 0, 1, 1, 2, 2, 3, 3]
    bal.outstanding_ns[:] = [0, 0, 0, 0, 0, 0, 9e9, 9e9]  # long tier far behind, nothing new arrived
    bal.round_demand_ns[:] = [1e9, 1e9, 1e9, 0]
    bal.end_round()
    assert np.bincount(bal.engine_tier, minlength=4)[3] > 2


def test_least_work_baseline_ignores_tiers():
    bal = LeastWorkPrefill(3, COST)
    engines = [bal.route(t)[0] for t in (1000, 500_000, 1000, 1000)]
    assert engines[:3] == [0, 1, 2] and engines[3] == 0


def test_prefill_errors():
    with pytest.raises(ValueError, match=r"PrefillBalancer\.num_engines"):
        PrefillBalancer(0, COST)
    with pytest.raises(ValueError, match=r"PrefillBalancer\.bounds"):
        PrefillBalancer(2, COST, bounds=(64, 16))
    with pytest.raises(TypeError, match=r"PrefillBalancer\.cost"):
        PrefillBalancer(2, object())
    with pytest.raises(ValueError, match="cached_tokens=9"):
        PrefillBalancer(2, COST).route(5, 9)
