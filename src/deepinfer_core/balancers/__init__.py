"""Prefill and decode load balancers and a discrete-event cluster simulator: what DeepInfer left out.

``PrefillBalancer`` (four tiers by total context, engines reassigned by compute-demand share),
``DecodeBalancer`` (placement by running requests and held KV, draining with a grace period, no
scale-in above 0.8 quota utilisation), baselines of each, documented synthetic traces, the simulator with
its perfectly balanced bounds, and the KV store's hit rate against TTL and capacity (``hitrate``).
Costs come from the scheduler's ``CostModel`` (passed in; this package imports neither it nor torch).
"""

from __future__ import annotations

from deepinfer_core.balancers.costs import StepCost, decode_step_ns, prefill_chunks, prefill_request_ns
from deepinfer_core.balancers.decode import (
    DecodeBalancer,
    LeastKVDecode,
    LeastRequestsDecode,
    LeastStepTimeDecode,
    RoundRobinDecode,
    ScaleInRefused,
)
from deepinfer_core.balancers.prefill import (
    DEFAULT_TIER_BOUNDS,
    LeastWorkPrefill,
    PrefillBalancer,
    RoundRobinPrefill,
    apportion,
    tier_of,
)
from deepinfer_core.balancers.simulator import (
    DecodeResult,
    PrefillResult,
    fluid_bound_s,
    simulate_decode,
    simulate_prefill,
)
from deepinfer_core.balancers.traces import DecodeTrace, PrefillTrace, decode_trace, prefill_trace

__all__ = [
    "DEFAULT_TIER_BOUNDS",
    "DecodeBalancer",
    "DecodeResult",
    "DecodeTrace",
    "LeastKVDecode",
    "LeastRequestsDecode",
    "LeastStepTimeDecode",
    "LeastWorkPrefill",
    "PrefillBalancer",
    "PrefillResult",
    "PrefillTrace",
    "RoundRobinDecode",
    "RoundRobinPrefill",
    "ScaleInRefused",
    "StepCost",
    "apportion",
    "decode_step_ns",
    "decode_trace",
    "fluid_bound_s",
    "prefill_chunks",
    "prefill_request_ns",
    "prefill_trace",
    "simulate_decode",
    "simulate_prefill",
    "tier_of",
]
