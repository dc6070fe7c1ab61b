"""Decode placement (brute-force objective), capacity, the Q&A's short/long rule, draining, scale-in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.balancers import DecodeBalancer, ScaleInRefused, decode_step_ns
from deepinfer_core.scheduler import CostModel

COST = CostModel(base_ns=10e6, token_ns=8e4, quad_ns=0.0, ctx_ns=1.6)


def _spread(r: np.ndarray, k: np.ndarray) -> float:
    return float(np.sum((r / r.mean() - 1) ** 2) + (np.sum((k / k.mean() - 1) ** 2) if k.mean() > 0 else 0.0))


@settings(max_examples=60)
@given(n=st.integers(1, 8), seed=st.integers(0, 2**31), steps=st.integers(1, 40))
def test_place_minimises_the_spread_brute_force(n, seed, steps):
    rng = np.random.default_rng(seed)
    bal = DecodeBalancer(n, COST, max_running=6, kv_capacity=400_000)
    bal.report(rng.integers(0, 6, n), rng.integers(0, 300_000, n))
    for _ in range(steps):
        tokens = int(rng.choice([int(rng.integers(0, 2000)), int(rng.integers(0, 150_000))]))
        r, k = bal.running.copy(), bal.kv.copy()
        ok = [e for e in range(n) if r[e] < 6 and k[e] + tokens <= 400_000]
        e = bal.place(tokens)
        if not ok:
            assert e is None
            assert np.array_equal(bal.running, r) and np.array_equal(bal.kv, k)
            continue
        assert e in ok
        # oracle: the spread after each possible placement, computed from scratch
        spreads = {}
        for c in ok:
            r2, k2 = r.copy(), k.copy()
            r2[c] += 1
            k2[c] += tokens
            spreads[c] = _spread(r2, k2)
        assert spreads[e] <= min(spreads.values()) + 1e-9 * max(1.0, abs(min(spreads.values())))
        assert bal.running[e] == r[e] + 1 and bal.kv[e] == k[e] + tokens


def test_short_to_few_requests_long_to_little_kv():
    """The Q&A's rule: engine 0 runs few requests holding much KV, engine 1 many requests with little."""
    bal = DecodeBalancer(2, COST, max_running=64, kv_capacity=10**8)
    bal.report([4, 40], [4_000_000, 400_000])
    assert bal.place(300) == 0  # short: few requests, although that engine holds much KV
    bal.report([4, 40], [4_000_000, 400_000])
    assert bal.place(200_000) == 1  # long: little KV


def test_step_time_is_the_cost_model_with_q_1():
    rng = np.random.default_rng(0)
    for _ in range(20):
        ctx = rng.integers(0, 100_000, int(rng.integers(1, 30)))
        want = COST.step_ns(np.ones(ctx.size, np.int64), ctx)
        assert decode_step_ns(COST, ctx.size, ctx.sum()) == pytest.approx(want, rel=1e-12)


def test_drain_grace_forward_and_scale_in_guard():
    bal = DecodeBalancer(4, COST, max_running=10, kv_capacity=1000, grace_s=60.0)
    bal.report([9, 9, 9, 9], [100, 100, 100, 100])  # 90% of slots in use
    with pytest.raises(ScaleInRefused, match=r"quota utilisation 0\.900 > 0\.8"):
        bal.drain(3, now_s=0.0)
    bal.report([8, 8, 8, 3], [100, 100, 100, 100])  # 67.5%
    assert bal.drain(3, now_s=10.0) == 70.0
    assert bal.drain(3, now_s=20.0) == 70.0  # asking again keeps the first deadline
    for _ in range(6):
        assert bal.place(5) != 3  # a draining engine takes nothing new
    assert bal.due(69.999) == [] and bal.due(70.0) == [3]
    bal.report([9, 9, 8, 3], [100, 100, 100, 100])
    targets = bal.forward(3, [40, 10, 300])
    assert None not in targets and 3 not in targets
    assert not bal.alive[3] and bal.due(1e9) == []
    assert bal.running.sum() == 26 + 3 and bal.running[3] == 0
    # a failing engine goes even above the limit
    bal.report([10, 10, 10, 0], [0, 0, 0, 0])
    assert bal.drain(0, now_s=0.0, force=True) == 60.0


def test_full_cluster_places_nothing():
    bal = DecodeBalancer(2, COST, max_running=1, kv_capacity=100)
    assert bal.place(50) is not None and bal.place(60) is not None
    assert bal.place(1) is None
    with pytest.raises(ValueError, match="tokens=-1"):
        bal.place(-1)


def test_decode_errors():
    with pytest.raises(ValueError, match=r"DecodeBalancer\.max_running"):
        DecodeBalancer(2, COST, max_running=0, kv_capacity=10)
    with pytest.raises(ValueError, match=r"DecodeBalancer\.grace_s"):
        DecodeBalancer(2, COST, max_running=1, kv_capacity=10, grace_s=-1.0)
    with pytest.raises(ValueError, match="max_scale_in_utilisation"):
        DecodeBalancer(2, COST, max_running=1, kv_capacity=10, max_scale_in_utilisation=1.5)
    with pytest.raises(ValueError, match="engine=5"):
        DecodeBalancer(2, COST, max_running=1, kv_capacity=10).drain(5, 0.0)
