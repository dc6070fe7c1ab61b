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
    ``decode_responses``); or pass ``url`` ("redis://host:port/db") and one is made with socket and
    connect timeouts of ``timeout_s`` (redis-py's default is 5 s, a whole step's budget many times over)
    and no client-side retries (the engine's ``StoreGuard`` decides when to try again). ``namespace``
    prefixes every key so several stores (models, versions) can share a server."""

    def __init__(
        self,
        client: Any = None,
        *,
        url: str | None = None,
        ttl: TTLPolicy | None = None,
        namespace: bytes = b"dkv:",
        clock: Clock = wall_clock_ns,
        timeout_s: float = 0.1,
    ) -> None:
        if (client is None) == (url is None):
            raise ValueError("RedisKVStore: pass exactly one of client= or url=")
        if not (
            isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool) and 0 < timeout_s <= 3600
        ):
            raise ValueError(f"timeout_s={timeout_s!r}: must be seconds in (0, 3600]")
        if client is None:
            from deepinfer_core.extras import require

            assert url is not None  # exactly one of the two was given
            # lazy: the client is only needed by this backend (the kvstore extra installs it)
            redis = require("redis", "the Redis KV store")
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
            )
        if getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}).get("decode_responses"):
            raise ValueError("client: must not use decode_responses=True (blocks are bytes)")
        if not isinstance(namespace, bytes):
            raise TypeError(f"namespace: must be bytes, got {type(namespace).__name__}")
        self.client = client
        self.ttl = ttl if ttl is not None else TTLPolicy()
        self.namespace = namespace
        self.clock = clock
        self.stats = StoreStats()

    @property
    def call_timeout_s(self) -> float | None:
        """The client's own bound on a call (its socket and connect timeouts; None: unbounded), which
        tells a ``StoreGuard`` whether it must add a deadline of its own."""
        kw = getattr(getattr(self.client, "connection_pool", None), "connection_kwargs", None)
        if not isinstance(kw, dict):
            return None
        t = [kw.get("socket_timeout"), kw.get("socket_connect_timeout")]
        bounds = [float(x) for x in t if x is not None]
        return None if len(bounds) < len(t) else max(bounds)

    def check(self) -> None:
        """At start (``StoreGuard.check_store``): the server answers and has ``PEXPIRETIME`` (>= 7.0).
        A refused password or an old server is a ValueError; a server that does not answer raises the
        client's ConnectionError / TimeoutError (the guard then starts with the store off and probes)."""
        import redis

        try:
            version = str(self.client.info("server").get("redis_version", "0"))
        except redis.AuthenticationError as e:
            raise ValueError(f"RedisKVStore: the server refused the credentials: {e}") from e
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e) or "NOPERM" in str(e):
                raise ValueError(f"RedisKVStore: the server refused the credentials: {e}") from e
            raise
        major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
        if major < 7:
            raise ValueError(f"RedisKVStore: the server is Redis {version}; it needs >= 7.0 (PEXPIRETIME)")

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
