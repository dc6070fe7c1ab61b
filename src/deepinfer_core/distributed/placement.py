"""Expert placement for the EP group: the size a restarted instance takes, an initial placement, and the
group-wide, migration-aware re-plans of online EPLB (collective), with the record of one re-plan.

The planning half of :mod:`deepinfer_core.distributed.engine`, which runs the re-plans inside its steps.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.distributed.ep import ExpertParallel
from deepinfer_core.eplb import EPLBConfig, ExpertPlacement
from deepinfer_core.eplb.migration import replan_with_migration
from deepinfer_core.eplb.transfer import execute_moves

__all__ = ["Replan", "plan_group", "plan_placement", "replan_ep", "restart_ep_size"]


def restart_ep_size(healthy_ranks: int, num_experts: int) -> int:
    """EP size a restarted instance takes: the largest size <= ``healthy_ranks`` dividing the expert count
    (every rank holds the same number of slots). DeepInfer restarts with the healthy GPUs it gets."""
    if isinstance(healthy_ranks, bool) or not isinstance(healthy_ranks, int) or healthy_ranks < 1:
        raise ValueError(f"healthy_ranks={healthy_ranks!r}: must be an int >= 1")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: must be an int >= 1")
    return max(g for g in range(1, healthy_ranks + 1) if num_experts % g == 0)


def plan_placement(
    num_layers: int, num_experts: int, ep_size: int, config: EPLBConfig, load: Any = None
) -> ExpertPlacement:
    """A placement for ``ep_size`` ranks: planned on ``load`` [layers, experts] (e.g. the window a failed
    bigger group left), or for uniform load when None."""
    reps = config.num_replicas(num_experts, ep_size)
    w = np.ones((num_layers, num_experts)) if load is None else np.asarray(load, dtype=np.float64)
    if w.shape != (num_layers, num_experts):
        raise ValueError(f"load: shape {w.shape}, expected [{num_layers} layers, {num_experts} experts]")
    return ExpertPlacement.plan(w + 1e-9, reps, 1, 1, ep_size)  # + eps: unseen experts keep a slot order


def plan_group(
    ep: ExpertParallel, local_load: Any, group: Any, device: Any, *, tolerance: float = 0.01
) -> tuple[Any, np.ndarray]:
    """The migration-aware plan for the group's load (``local_load`` summed over the EP group, so every
    rank gets the same plan). Collective. Returns (MigrationPlan, the group's load)."""
    load = torch.as_tensor(np.asarray(local_load, dtype=np.int64), device=device)
    dist.all_reduce(load, group=group)
    load_np = load.cpu().numpy()
    return replan_with_migration(
        ep.placement, load_np, tolerance=tolerance, expert_bytes=ep.expert_bytes
    ), load_np


def replan_ep(
    ep: ExpertParallel,
    local_load: Any,
    group: Any,
    device: Any,
    *,
    tolerance: float = 0.01,
    batch_size: int = 32,
) -> tuple[Any, Any, np.ndarray]:
    """:func:`plan_group`, then move the changed slots' weights over ``group`` at once and switch the
    routing. Collective. Returns (MigrationPlan, TransferReport, the group's load)."""
    plan, load_np = plan_group(ep, local_load, group, device, tolerance=tolerance)
    rep = execute_moves(plan.moves, ep.weights, group=group, batch_size=batch_size)
    ep.set_placement(plan.placement)
    return plan, rep, load_np


@attrs.define
class Replan:
    """One online re-plan: when, what moved, balance on the window before / after."""

    step: int
    live_requests: int
    moves: int
    remote_moves: int
    bytes_sent: int
    moe_lb_before: float
    moe_lb_after: float
    seconds: float
    commit_step: int = -1  # step after which the new placement took over (= step when moved at once)
    batches: int = 1  # steps the moves were spread over
