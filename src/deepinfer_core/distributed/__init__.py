"""Distributed serving over torch.distributed (gloo on CPU, NCCL on GPU): DP attention, EP MoE with
online EPLB, Engram tables sharded over the engram-parallel group, and the failure rules.

- :func:`init_groups` / :class:`ParallelGroups`: the DP, EP and engram groups of an instance;
- :class:`ExpertParallel`: the EP MoE (all-to-all dispatch / combine over an EPLB placement);
- :class:`DistributedEngine` / :class:`DistConfig`: one DP rank wrapping ``LLMEngine``;
- :func:`spawn`: start an N-rank instance from Python (``torchrun`` works with :func:`init_groups`);
- :class:`PromptEngine` / :class:`CompletionEngine` / :class:`Handoff`: P/D disaggregation, in process or
  with :func:`send_handoff` / :func:`recv_handoff` over torch.distributed.

See docs/distributed.md.
"""

from deepinfer_core.distributed.engine import DistConfig, DistributedEngine, GroupFailedError
from deepinfer_core.distributed.ep import ExpertParallel, ProtocolError, StepSync
from deepinfer_core.distributed.groups import ParallelGroups, init_groups, shutdown
from deepinfer_core.distributed.launch import free_port, spawn
from deepinfer_core.distributed.pd import CompletionEngine, Handoff, PromptEngine, recv_handoff, send_handoff
from deepinfer_core.distributed.placement import Replan, plan_placement, restart_ep_size

__all__ = [
    "CompletionEngine",
    "DistConfig",
    "DistributedEngine",
    "ExpertParallel",
    "GroupFailedError",
    "Handoff",
    "ParallelGroups",
    "PromptEngine",
    "ProtocolError",
    "Replan",
    "StepSync",
    "free_port",
    "init_groups",
    "plan_placement",
    "recv_handoff",
    "restart_ep_size",
    "send_handoff",
    "shutdown",
    "spawn",
]
