"""KV memory: paged block pool, per-sequence state pool, prefix index, byte-exact cache formats.

``formats`` (torch) is imported lazily so that the pools stay cheap to import (the scheduler only
needs the pools).
"""

from __future__ import annotations

import importlib
from typing import Any

from deepinfer_core.kv import planner, ring
from deepinfer_core.kv.planner import KVModelConfig, MemoryPlan, StateLayout, plan_memory
from deepinfer_core.kv.pool import PagedKVPool, compression_fires, num_compressed_entries
from deepinfer_core.kv.prefix import PrefixIndex
from deepinfer_core.kv.state import StatePool

__all__ = [
    "KVModelConfig",
    "MemoryPlan",
    "PagedKVPool",
    "PrefixIndex",
    "StateLayout",
    "StatePool",
    "compression_fires",
    "formats",
    "num_compressed_entries",
    "plan_memory",
    "planner",
    "ring",
]


def __getattr__(name: str) -> Any:
    if name == "formats":
        return importlib.import_module(f"deepinfer_core.kv.{name}")
    raise AttributeError(f"module 'deepinfer_core.kv' has no attribute {name!r}")
