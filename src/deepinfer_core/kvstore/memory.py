"""In-memory KV block store: a dict under a lock, with optional LRU capacity in bytes (tests, simulator)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from deepinfer_core.kvstore.record import Clock, StoreStats, TTLPolicy, as_payload, check_key, wall_clock_ns


class InMemoryKVStore:
    """``KVBlockStore`` in process memory. ``capacity_bytes`` (None: unbounded) evicts least recently used
    blocks (a get or touch counts as a use), which is how the simulator models a finite store."""

    call_timeout_s = 0.0  # no call waits on I/O: a StoreGuard calls it inline, without a deadline thread

    def __init__(
        self, ttl: TTLPolicy | None = None, *, capacity_bytes: int | None = None, clock: Clock = wall_clock_ns
    ) -> None:
        if capacity_bytes is not None and not (isinstance(capacity_bytes, int) and capacity_bytes > 0):
            raise ValueError(f"capacity_bytes={capacity_bytes!r}: must be None or an int > 0")
        self.ttl = ttl if ttl is not None else TTLPolicy()
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        self.stats = StoreStats()
        self._lock = threading.Lock()
        # key -> (traffic class, payload, expires_ns); order = LRU (oldest first)
        self._blocks: OrderedDict[bytes, tuple[str, bytes, int]] = OrderedDict()
        self._bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def _live(self, key: bytes, now: int) -> tuple[str, bytes, int] | None:
        ent = self._blocks.get(key)
        if ent is None:
            return None
        if now >= ent[2]:
            self._drop(key)
            self.stats.expired += 1
            return None
        return ent

    def _drop(self, key: bytes) -> None:
        ent = self._blocks.pop(key)
        self._bytes -= len(ent[1])

    def put(self, key: bytes, data, *, traffic_class: str = "chatbot") -> None:
        key = check_key(key)
        ttl = self.ttl.ttl_ns(traffic_class)
        payload = bytes(as_payload(data))  # a private copy: the caller may reuse its buffer
        if self.capacity_bytes is not None and len(payload) > self.capacity_bytes:
            raise ValueError(f"data: {len(payload)} bytes exceed capacity_bytes={self.capacity_bytes}")
        with self._lock:
            now = self.clock()
            if key in self._blocks:
                self._drop(key)
            self._blocks[key] = (traffic_class, payload, now + ttl)
            self._bytes += len(payload)
            self.stats.puts += 1
            if self.capacity_bytes is not None:
                while self._bytes > self.capacity_bytes:
                    old = next(iter(self._blocks))
                    self._drop(old)
                    self.stats.evicted += 1

    def get(self, key: bytes) -> bytes | None:
        key = check_key(key)
        with self._lock:
            ent = self._live(key, self.clock())
            if ent is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            return ent[1]

    def exists(self, key: bytes) -> bool:
        key = check_key(key)
        with self._lock:
            return self._live(key, self.clock()) is not None

    def touch(self, key: bytes, *, traffic_class: str | None = None) -> bool:
        key = check_key(key)
        with self._lock:
            now = self.clock()
            ent = self._live(key, now)
            if ent is None:
                return False
            # the block keeps the class it was put with (as the file and Redis records do: a touch never
            # rewrites a record); ``traffic_class`` sets only this TTL
            ttl_cls = ent[0] if traffic_class is None else traffic_class
            self._blocks[key] = (ent[0], ent[1], now + self.ttl.ttl_ns(ttl_cls))
            self._blocks.move_to_end(key)
            return True

    def delete(self, key: bytes) -> bool:
        key = check_key(key)
        with self._lock:
            if key not in self._blocks:
                return False
            self._drop(key)
            return True

    def expires_at_ns(self, key: bytes) -> int | None:
        """When the block expires (None if absent); for tests and the simulator."""
        ent = self._blocks.get(check_key(key))
        return None if ent is None else ent[2]
