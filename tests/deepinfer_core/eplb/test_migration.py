"""Migration-aware re-planning: moves reproduce the new placement exactly, balance stays within tolerance
of a from-scratch plan, and fewer experts move."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.eplb import ExpertPlacement
from deepinfer_core.eplb.migration import align_within_gpus, diff_placements, replan_with_migration


@st.composite
def drifts(draw: st.DrawFn) -> tuple[ExpertPlacement, np.ndarray, float]:
    gpus = draw(st.sampled_from([2, 4, 8]))
    experts = gpus * draw(st.integers(1, 5))
    reps = experts + gpus * draw(st.integers(0, 3))
    layers = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w0 = rng.integers(1, 1000, (layers, experts)).astype(np.float64)
    old = ExpertPlacement.plan(w0, reps, 1, 1, gpus)
    sigma = draw(st.sampled_from([0.0, 0.1, 0.5, 2.0]))
    w1 = np.round(w0 * rng.lognormal(0.0, sigma, w0.shape)) if sigma else w0
    return old, w1, draw(st.sampled_from([0.0, 0.01, 0.05]))


def _per_gpu(tab: np.ndarray, gpus: int) -> list[list[Counter]]:
    per = tab.shape[1] // gpus
    return [[Counter(row[g * per : (g + 1) * per].tolist()) for g in range(gpus)] for row in tab]


@given(drifts())
def test_moves_reproduce_plan_and_respect_tolerance(case: tuple[ExpertPlacement, np.ndarray, float]) -> None:
    old, w1, tol = case
    m = replan_with_migration(old, w1, tolerance=tol, expert_bytes=10)
    assert np.array_equal(m.moves.apply(old.phy2log), m.placement.phy2log)
    assert np.array_equal(m.scratch_moves.apply(old.phy2log), m.scratch.phy2log)
    # The new plan keeps the from-scratch replica counts and is balanced within tolerance.
    assert np.array_equal(m.placement.logcnt, m.scratch.logcnt)
    assert (m.balance <= m.scratch_balance * (1 + tol) + 1e-9).all()
    assert len(m.moves) <= len(m.scratch_moves)
    # One move per changed slot, never a no-op; bytes count only cross-GPU moves.
    assert np.unique(m.moves.layer * 10_000 + m.moves.dst_slot).size == len(m.moves)
    assert (old.phy2log[m.moves.layer, m.moves.dst_slot] != m.moves.expert).all()
    assert m.moves.moved_bytes == 10 * int((m.moves.src_gpu != m.moves.dst_gpu).sum())


def test_unchanged_load_moves_nothing() -> None:
    rng = np.random.default_rng()
    w = rng.integers(1, 10_000, (4, 64)).astype(np.float64)
    old = ExpertPlacement.plan(w, 80, 1, 1, 16)
    m = replan_with_migration(old, w, expert_bytes=1)
    assert len(m.moves) == 0 and np.array_equal(m.placement.phy2log, old.phy2log)


def test_drift_moves_far_fewer_bytes_than_from_scratch() -> None:
    rng = np.random.default_rng()
    layers, experts, reps, gpus = 4, 384, 448, 64
    base = (1.0 / np.arange(1, experts + 1) ** 0.8)[np.argsort(rng.random((layers, experts)), axis=1)]
    old = ExpertPlacement.plan(rng.poisson(base * 1e5), reps, 1, 1, gpus)
    w1 = rng.poisson(base * rng.lognormal(0.0, 0.2, base.shape) * 1e5)
    m = replan_with_migration(old, w1, tolerance=0.01, expert_bytes=1)
    assert (m.balance <= m.scratch_balance * 1.01 + 1e-9).all()
    assert m.moves.moved_bytes * 3 < m.scratch_moves.moved_bytes


def test_align_keeps_every_expert_a_gpu_already_had() -> None:
    rng = np.random.default_rng()
    old = np.stack([rng.permutation(np.r_[np.arange(12), rng.integers(0, 12, 4)]) for _ in range(3)])
    new = np.stack([rng.permutation(np.r_[np.arange(12), rng.integers(0, 12, 4)]) for _ in range(3)])
    out = align_within_gpus(old, new, 4)
    assert _per_gpu(out, 4) == _per_gpu(new, 4)  # same experts per GPU
    kept = int((out == old).sum())
    best = sum(
        sum((a & b).values()) for ra, rb in zip(_per_gpu(old, 4), _per_gpu(new, 4)) for a, b in zip(ra, rb)
    )
    assert kept == best
    moves = diff_placements(old, out, 4)
    assert np.array_equal(moves.apply(old), out)


def test_bad_arguments() -> None:
    old = ExpertPlacement.plan(np.ones((1, 8)), 8, 1, 1, 2)
    with pytest.raises(ValueError, match="tolerance"):
        replan_with_migration(old, np.ones((1, 8)), tolerance=1.5)
    with pytest.raises(ValueError, match="load must have shape"):
        replan_with_migration(old, np.ones((2, 8)))
    with pytest.raises(TypeError, match="ExpertPlacement"):
        replan_with_migration(old.phy2log, np.ones((1, 8)))
