"""External KV block store: what DeepInfer left out (its deployment Q&A describes 3FS-backed block KV).

Backends of the ``protocols.kvstore.KVBlockStore`` seam: ``InMemoryKVStore`` (tests, simulator),
``FileKVStore`` (any POSIX directory; a 3FS FUSE mount in production), ``RedisKVStore`` (a real Redis
server). ``TTLPolicy`` sets the time to live per traffic class (agent 3 days, chatbot 7 days),
``block_keys`` gives the chained 128-bit content hashes of a token sequence's blocks, ``Prefetcher``
fetches asynchronously into host memory and ``LayerwiseSwapIn`` (torch, imported lazily) copies layer
by layer into the device cache. ``StoreGuard`` isolates a store's faults (a miss or a skipped write,
counted, logged once per cause, a circuit breaker per side). Nothing here imports torch at import time.
"""

from __future__ import annotations

from deepinfer_core.kvstore.engine_link import BlockCodec, StoreLink, config_key
from deepinfer_core.kvstore.file import FileKVStore
from deepinfer_core.kvstore.guard import KINDS, GuardStats, StoreGuard, StoreGuardConfig, classify
from deepinfer_core.kvstore.memory import InMemoryKVStore, StoreStats
from deepinfer_core.kvstore.prefetch import PrefetchBatch, Prefetcher
from deepinfer_core.kvstore.record import DEFAULT_TTLS_S, TTLPolicy, block_keys
from deepinfer_core.kvstore.redis_store import RedisKVStore
from deepinfer_core.kvstore.swapin import LayerwiseSwapIn, pack_layers, stage

__all__ = [
    "DEFAULT_TTLS_S",
    "KINDS",
    "BlockCodec",
    "FileKVStore",
    "GuardStats",
    "InMemoryKVStore",
    "LayerwiseSwapIn",
    "PrefetchBatch",
    "Prefetcher",
    "RedisKVStore",
    "StoreGuard",
    "StoreGuardConfig",
    "StoreLink",
    "StoreStats",
    "TTLPolicy",
    "block_keys",
    "classify",
    "config_key",
    "pack_layers",
    "stage",
]
