"""KV block store on Redis (any server >= 7.0): one string value per block, expiry by ``PXAT``.

A put is one ``SET key record PXAT t`` (atomic on the server: a reader gets the old value, the new one or
nothing), so concurrent writers of one key are safe. The value is the same checksummed record as the
file store's, so a value damaged elsewhere (a proxy, ``SETRANGE``, a half-written replica) is a miss.
Expiry resolution is the millisecond: a block put at t expires at floor((t + ttl) / 1 ms); the server
drops it then, and ``get`` also reads ``PEXPIRETIME`` against this store's clock, so a client whose clock
is injected (tests) sees the same exact rule.
"""

from __future__ import annotations

from typing import Any

from deepinfer_core.kvstore import record
from deepinfer_core.kvstore.record import Clock, StoreStats, TTLPolicy, as_payload, check_key, wall_clock_ns


class RedisKVStore(record.RecordReads):
    """``KVBlockStore`` on a Redis server. ``client`` is a ``redis.Redis`` (binary mode, i.e. without
    ``decode_responses``); or pass ``url`` ("redis://host:port/db") and one is made. ``namespace``
    prefixes every key so several stores (models, versions) can share a server."""

    def __init__(
        self,
        client: Any = None,
        *,
        url: str | None = None,
        ttl: TTLPolicy | None = None,
        namespace: bytes = b"dkv:",
        clock: Clock = wall_clock_ns,
    ) -> None:
        if (client is None) == (url is None):
            raise ValueError("RedisKVStore: pass exactly one of client= or url=")
        if client is None:
            from deepinfer_core.extras import require

            assert url is not None  # exactly one of the two was given
            # lazy: the client is only needed by this backend (the kvstore extra installs it)
            redis = require("redis", "the Redis KV store")
            client = redis.Redis.from_url(url)
        if getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}).get("decode_responses"):
            raise ValueError("client: must not use decode_responses=True (blocks are bytes)")
        if not isinstance(namespace, bytes):
            raise TypeError(f"namespace: must be bytes, got {type(namespace).__name__}")
        self.client = client
        self.ttl = ttl if ttl is not None else TTLPolicy()
        self.namespace = namespace
        self.clock = clock
        self.stats = StoreStats()

    def _k(self, key: bytes) -> bytes:
        return self.namespace + check_key(key)

    def put(self, key: bytes, data, *, traffic_class: str = "chatbot") -> None:
        key = check_key(key)
        ttl = self.ttl.ttl_ns(traffic_class)
        value = b"".join(bytes(p) for p in record.encode(key, traffic_class, as_payload(data)))
        exp_ms = (self.clock() + ttl) // 1_000_000
        self.client.set(self._k(key), value, pxat=exp_ms)
        self.stats.puts += 1

    def _read(self, key: bytes) -> tuple[str, bytes] | None:
        pipe = self.client.pipeline(transaction=True)  # MULTI/EXEC: value and expiry of one version
        pipe.get(self._k(key))
        pipe.pexpiretime(self._k(key))
        value, exp_ms = pipe.execute()
        if value is None:
            return None
        if exp_ms is not None and exp_ms >= 0 and self.clock() >= exp_ms * 1_000_000:
            self.stats.expired += 1
            return None
        return self._decode(key, value, f"{key.hex()} in Redis")

    def touch(self, key: bytes, *, traffic_class: str | None = None) -> bool:
        key = check_key(key)
        exp = self._touch_expiry_ns(key, traffic_class)
        if exp is None:
            return False
        # XX-like: PEXPIREAT on a key deleted meanwhile returns 0 and creates nothing
        return bool(self.client.pexpireat(self._k(key), exp // 1_000_000))

    def delete(self, key: bytes) -> bool:
        return bool(self.client.delete(self._k(key)))
