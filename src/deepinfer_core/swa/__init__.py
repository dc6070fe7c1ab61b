"""SWA bounded replay: rebuilding the sliding-window state after a prefix hit (docs/swa.md).

``plan``: the replay planner as plain data (:func:`plan_replay` -> :class:`ReplayPlan`: which tokens,
which layers, which masks; bounded or exact). ``store``: the host-memory store of the persisted
encoder rings (byte budget, LRU). Both are numpy-only; the executor side lives in
``deepinfer_core.model.executor`` (``decoder_floor``, ``replay_encoder``, ``restore_encoder``).
"""

from __future__ import annotations

from deepinfer_core.swa.plan import (
    BOUNDED,
    ENCODER_PREFILL,
    ENCODER_REPLAY,
    ENCODER_RESTORE,
    EXACT,
    MODES,
    PREFILL,
    TAIL,
    ReplayConfig,
    ReplayPlan,
    ReplayStep,
    plan_replay,
)
from deepinfer_core.swa.store import HostSWAStore, SWAEntry, prefix_digests

__all__ = [
    "BOUNDED",
    "ENCODER_PREFILL",
    "ENCODER_REPLAY",
    "ENCODER_RESTORE",
    "EXACT",
    "MODES",
    "PREFILL",
    "TAIL",
    "HostSWAStore",
    "ReplayConfig",
    "ReplayPlan",
    "ReplayStep",
    "SWAEntry",
    "plan_replay",
    "prefix_digests",
]
