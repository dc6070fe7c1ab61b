"""The engine-facing loop: record each step's expert counts, re-plan on schedule, hand back the moves."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from deepinfer_core.eplb.migration import MigrationPlan, replan_with_migration
from deepinfer_core.eplb.policy import _check_int
from deepinfer_core.eplb.stats import DECODE, EPLBConfig, ExpertLoadWindow, ExpertPlacement

logger = logging.getLogger(__name__)


class OnlineBalancer:
    """Sliding-window statistics plus periodic migration-aware re-planning, for one EP group.

    The engine calls :meth:`record` once per step with that step's routed token counts [layers, experts].
    The first re-plan happens when the window first fills, then every ``config.replan_interval`` steps;
    on those steps :meth:`record` returns the :class:`MigrationPlan` (new placement, moves, bytes), which the
    engine carries out (e.g. :func:`deepinfer_core.eplb.transfer.execute_moves`) before routing with
    ``plan.placement.log2phy``. Until then the placement is ``initial`` or, by default, the plan for
    uniform load (replicas spread by count).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_gpus: int,
        config: EPLBConfig = DECODE,
        *,
        tolerance: float = 0.01,
        expert_bytes: int = 0,
        initial: ExpertPlacement | None = None,
    ) -> None:
        self.num_gpus = _check_int("num_gpus", num_gpus)
        self.config = config
        self.tolerance = tolerance
        self.expert_bytes = _check_int("expert_bytes", expert_bytes, minimum=0)
        reps = config.num_replicas(num_experts, num_gpus)
        if initial is None:
            initial = ExpertPlacement.plan(np.ones((num_layers, num_experts)), reps, 1, 1, num_gpus)
        elif (initial.num_layers, initial.num_experts, initial.num_replicas, initial.num_gpus) != (
            num_layers,
            num_experts,
            reps,
            num_gpus,
        ):
            raise ValueError(
                f"initial placement must be {num_layers} layers x {num_experts} experts on {reps} slots / "
                f"{num_gpus} GPUs, got {initial.num_layers} x {initial.num_experts} on {initial.num_replicas} / "
                f"{initial.num_gpus}"
            )
        self.placement = initial
        self.window = ExpertLoadWindow(num_layers, num_experts, config.window_steps)
        self.replans = 0

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self.window.steps_recorded

    def due(self) -> bool:
        """Whether the step just recorded ends a re-plan interval."""
        s, w = self.window.steps_recorded, self.config.window_steps
        return s >= w and (s - w) % self.config.replan_interval == 0

    def record(self, counts: Any) -> MigrationPlan | None:
        """Record one step; on a re-plan step, adopt and return the new plan (moves from the old one)."""
        self.window.record(counts)
        if not self.due():
            return None
        plan = replan_with_migration(
            self.placement, self.window.load(), tolerance=self.tolerance, expert_bytes=self.expert_bytes
        )
        self.placement = plan.placement
        self.replans += 1
        logger.info(
            "EPLB re-plan %d at step %d: %d moves (%.2f GB), from scratch would move %.2f GB; "
            "balance %.4f (from scratch %.4f)",
            self.replans,
            self.steps,
            len(plan.moves),
            plan.moves.moved_bytes / 1e9,
            plan.scratch_moves.moved_bytes / 1e9,
            float(plan.balance.mean()),
            float(plan.scratch_balance.mean()),
        )
        return plan
