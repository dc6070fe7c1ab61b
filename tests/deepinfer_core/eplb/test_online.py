"""OnlineBalancer: re-plans exactly on the seeds' schedule, and its moves turn each placement into the next."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.eplb import EPLBConfig, ExpertPlacement, OnlineBalancer


def test_replans_on_schedule_and_moves_chain() -> None:
    rng = np.random.default_rng()
    cfg = EPLBConfig(window_steps=5, replan_interval=20, redundant_per_gpu=2)
    bal = OnlineBalancer(3, 16, 4, cfg, expert_bytes=7)
    skew = rng.pareto(1.0, (3, 16)) + 0.1
    replanned = []
    for step in range(1, 50):
        before = bal.placement.phy2log.copy()
        plan = bal.record(rng.poisson(skew * 100))
        if plan is None:
            assert np.array_equal(bal.placement.phy2log, before)
            continue
        replanned.append(step)
        assert np.array_equal(plan.moves.apply(before), bal.placement.phy2log)
        assert plan.moves.moved_bytes == 7 * plan.moves.num_remote
        # The new plan is balanced (within tolerance of from scratch) on the window it was made from.
        assert (plan.balance <= plan.scratch_balance * 1.01 + 1e-9).all()
    assert replanned == [5, 25, 45] and bal.replans == 3


def test_initial_placement_is_checked() -> None:
    cfg = EPLBConfig(window_steps=5, replan_interval=20, redundant_per_gpu=2)
    wrong = ExpertPlacement.plan(np.ones((3, 16)), 16, 1, 1, 4)  # no redundant slots
    with pytest.raises(ValueError, match="initial placement"):
        OnlineBalancer(3, 16, 4, cfg, initial=wrong)
