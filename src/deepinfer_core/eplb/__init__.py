"""Expert-parallel load balancing (EPLB): placement policy, load statistics, re-planning, weight migration.

Usable on its own: numpy only, except :mod:`deepinfer_core.eplb.transfer` (torch.distributed), which is
imported lazily.

- :func:`rebalance_experts`: DeepSeek EPLB's signature and outputs, vectorised over layers, plus swap passes.
- :class:`ExpertPlacement`, :func:`moe_lb`, :class:`ExpertLoadWindow`, :data:`PREFILL` / :data:`DECODE`.
- :func:`replan_with_migration`: a plan that keeps experts in place when that costs little balance, and
  the move list (layer, expert, from GPU, to GPU) that realises it.
- :func:`execute_moves` (in ``transfer``): carry the moves out over a torch.distributed group.
- :class:`OnlineBalancer`: the per-step loop an engine drives (window, schedule, migration-aware re-plan).
"""

from __future__ import annotations

from typing import Any

from deepinfer_core.eplb.policy import rebalance_experts
from deepinfer_core.eplb.stats import DECODE, PREFILL, EPLBConfig, ExpertLoadWindow, ExpertPlacement, moe_lb

__all__ = [
    "DECODE",
    "PREFILL",
    "EPLBConfig",
    "ExpertLoadWindow",
    "ExpertPlacement",
    "MovePlan",
    "OnlineBalancer",
    "execute_moves",
    "moe_lb",
    "rebalance_experts",
    "replan_with_migration",
]


def __getattr__(name: str) -> Any:
    # Lazy: migration pulls nothing heavy, but transfer imports torch.
    if name in ("MovePlan", "replan_with_migration", "diff_placements"):
        from deepinfer_core.eplb import migration

        return getattr(migration, name)
    if name == "OnlineBalancer":
        from deepinfer_core.eplb.online import OnlineBalancer

        return OnlineBalancer
    if name == "execute_moves":
        from deepinfer_core.eplb.transfer import execute_moves

        return execute_moves
    raise AttributeError(name)
