"""Engram: n-gram hashing of token ids into prime-sized tables, and the tables themselves on one device,
in host memory, or row-sharded over an engram-parallel process group. Usable without the model.

>>> from deepinfer_core.engram import EngramConfig, EngramHasher
>>> hasher = EngramHasher(EngramConfig.tiny())
"""

from deepinfer_core.engram.canonical import CanonicalTokenMap, normalize_token_text
from deepinfer_core.engram.config import EngramConfig
from deepinfer_core.engram.deepep import DeepEPEngramTable, deep_ep_available
from deepinfer_core.engram.hashing import (
    EngramHasher,
    derive_multipliers,
    derive_primes,
    is_prime,
    next_prime,
)
from deepinfer_core.engram.memory import EngramMemoryPlan, plan_for_config, plan_memory
from deepinfer_core.engram.placement import PLACEMENTS, device_local, local_table, place_tables, unchecked
from deepinfer_core.engram.sharded import ShardedEngramTable, rows_per_rank, shard_range
from deepinfer_core.engram.tables import (
    FORMATS,
    HostEngramTable,
    LocalEngramTable,
    bytes_per_row,
    make_storage,
    quantize_fp8,
    random_values,
)

__all__ = [
    "FORMATS",
    "PLACEMENTS",
    "CanonicalTokenMap",
    "DeepEPEngramTable",
    "EngramConfig",
    "EngramHasher",
    "EngramMemoryPlan",
    "HostEngramTable",
    "LocalEngramTable",
    "ShardedEngramTable",
    "bytes_per_row",
    "deep_ep_available",
    "derive_multipliers",
    "derive_primes",
    "device_local",
    "is_prime",
    "local_table",
    "make_storage",
    "next_prime",
    "normalize_token_text",
    "place_tables",
    "plan_for_config",
    "plan_memory",
    "quantize_fp8",
    "random_values",
    "rows_per_rank",
    "shard_range",
    "unchecked",
]
