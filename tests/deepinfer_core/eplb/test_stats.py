"""ExpertLoadWindow against a brute-force sum, moe_lb against a slot-by-slot loop, placements, presets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.eplb import DECODE, PREFILL, EPLBConfig, ExpertLoadWindow, ExpertPlacement, moe_lb
from deepinfer_core.eplb.stats import moe_lb_steps


@given(st.integers(1, 7), st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=25))
def test_window_equals_sum_of_last_steps(window: int, seeds: list[int]) -> None:
    win = ExpertLoadWindow(2, 5, window_steps=window)
    history = []
    for s in seeds:
        counts = np.random.default_rng(s).integers(0, 1000, (2, 5))
        win.record(counts)
        history.append(counts)
        expect = np.sum(history[-window:], axis=0)
        assert np.array_equal(win.load(), expect)
    assert win.steps_recorded == len(seeds)
    assert win.full == (len(seeds) >= window)
    win.reset()
    assert win.steps_recorded == 0 and not win.load().any()


def test_window_rejects_bad_counts() -> None:
    win = ExpertLoadWindow(2, 3, window_steps=4)
    with pytest.raises(ValueError, match="shape"):
        win.record(np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="non-negative"):
        win.record(-np.ones((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="integer"):
        win.record(np.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="window_steps"):
        ExpertLoadWindow(2, 3, window_steps=0)
    win.record(np.ones((2, 3)))  # integral floats are accepted
    assert win.load().sum() == 6


def _loop_moe_lb(load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> tuple[float, list[float]]:
    per_gpu = phy2log.shape[1] // num_gpus
    maxes, means, ratios = 0.0, 0.0, []
    for ly in range(load.shape[0]):
        cnt = {}
        for e in phy2log[ly]:
            cnt[int(e)] = cnt.get(int(e), 0) + 1
        gpu = [0.0] * num_gpus
        for p, e in enumerate(phy2log[ly]):
            gpu[p // per_gpu] += float(load[ly, e]) / cnt[int(e)]
        mean = sum(gpu) / num_gpus
        maxes += max(gpu)
        means += mean
        ratios.append(max(gpu) / mean if mean > 0 else 1.0)
    return maxes / means, ratios


def test_moe_lb_matches_loop() -> None:
    rng = np.random.default_rng()
    load = rng.integers(0, 500, (3, 24)).astype(np.float64)
    plan_load = load * rng.uniform(0.5, 1.5, load.shape)  # planned on other counts: out of sample
    pl = ExpertPlacement.plan(plan_load, 32, 1, 1, 8)
    total, ratios = _loop_moe_lb(load, pl.phy2log, 8)
    assert moe_lb(load, pl) == pytest.approx(total, rel=1e-12)
    assert np.allclose(moe_lb(load, pl, per_layer=True), ratios, rtol=1e-12)
    assert moe_lb(np.zeros_like(load), pl) == 1.0
    with pytest.raises(ValueError, match="load must have shape"):
        moe_lb(load[:, :5], pl)


def test_from_phy2log_rebuilds_counts_and_inverse() -> None:
    rng = np.random.default_rng()
    pl = ExpertPlacement.plan(rng.integers(0, 100, (2, 12)), 16, 1, 1, 4)
    again = ExpertPlacement.from_phy2log(pl.phy2log, 12, 4)
    assert np.array_equal(again.logcnt, pl.logcnt)
    for ly in range(2):
        for e in range(12):
            k = again.logcnt[ly, e]
            assert sorted(again.log2phy[ly, e, :k]) == sorted(np.flatnonzero(pl.phy2log[ly] == e))
            assert (again.log2phy[ly, e, k:] == -1).all()
    with pytest.raises(ValueError, match="at least one replica"):
        ExpertPlacement.from_phy2log(np.zeros((1, 16), dtype=np.int64), 12, 4)


def test_presets_follow_the_seeds() -> None:
    assert (PREFILL.window_steps, PREFILL.replan_interval, PREFILL.redundant_per_gpu) == (100, 1000, 4)
    assert (DECODE.replan_interval, DECODE.redundant_per_gpu) == (10_000, 1)
    assert DECODE.num_replicas(384, 64) == 448  # "7 experts per GPU" at EP64
    assert PREFILL.num_replicas(384, 4) == 400
    with pytest.raises(ValueError, match="redundant_per_gpu"):
        EPLBConfig(window_steps=1, replan_interval=1, redundant_per_gpu=-1)


@given(st.integers(1, 6), st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_record_many_equals_recording_one_by_one(window: int, chunks: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = ExpertLoadWindow(2, 3, window_steps=window), ExpertLoadWindow(2, 3, window_steps=window)
    for n in chunks:
        counts = rng.integers(0, 100, (n, 2, 3))
        a.record_many(counts)
        for c in counts:
            b.record(c)
        assert np.array_equal(a.load(), b.load()) and a.steps_recorded == b.steps_recorded


def test_moe_lb_steps_equals_per_step_moe_lb() -> None:
    rng = np.random.default_rng()
    pl = ExpertPlacement.plan(rng.integers(0, 100, (3, 16)), 20, 1, 1, 4)
    counts = rng.integers(0, 50, (7, 3, 16))
    counts[2] = 0
    expect = [moe_lb(c, pl) for c in counts]
    assert np.allclose(moe_lb_steps(counts, pl), expect, rtol=1e-12)
