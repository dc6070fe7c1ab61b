"""Step planner: DeepInfer's per-step scheduler (C++ core), synchronous or one step ahead.

``Scheduler`` plans each step over a KV block pool; ``CostModel`` predicts prefill step time and is
fitted from measurements; ``LocalVote`` / ``DistributedVote`` agree the step type across a DP group.
"""

from deepinfer_core.scheduler.cost_model import CostModel
from deepinfer_core.scheduler.scheduler import Scheduler
from deepinfer_core.scheduler.types import (
    MAX_STEP_TOKENS,
    EngineType,
    FinishedRequest,
    FinishReason,
    Plan,
    PreemptionPolicy,
    Request,
    SchedulerConfig,
    StepType,
)
from deepinfer_core.scheduler.vote import DistributedVote, LocalVote

__all__ = [
    "MAX_STEP_TOKENS",
    "CostModel",
    "DistributedVote",
    "EngineType",
    "FinishReason",
    "FinishedRequest",
    "LocalVote",
    "Plan",
    "PreemptionPolicy",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "StepType",
]
