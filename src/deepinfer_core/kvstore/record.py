"""What every backend shares: keys, the TTL policy per traffic class, and the checksummed record format.

A stored record is ``header | class name | payload``. The header holds a magic, a version, the payload
length and a BLAKE2b-256 digest of every other byte of the record plus the key. A reader trusts a
record only when all of it checks out, so a torn write, a truncated file, a flipped bit or a record
filed under another key is a miss, never wrong KV. Expiry is kept outside the record (file mtime, Redis PXAT, a dict
field) so that ``touch`` never rewrites the block.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np

MAGIC = b"DKVS"
VERSION = 1
# magic, version, class-name length, reserved, payload length, digest
_HEADER = struct.Struct("<4sBBHQ32s")
HEADER_SIZE = _HEADER.size
_PRE = HEADER_SIZE - 32  # header bytes before the digest
MIN_KEY, MAX_KEY = 16, 64
DAY_S = 86400
# The deployment Q&A: 3 days for agent traffic, 7 for chatbot traffic (chatbot hits have a long tail).
DEFAULT_TTLS_S: dict[str, float] = {"agent": 3 * DAY_S, "chatbot": 7 * DAY_S}

Clock = Callable[[], int]


def wall_clock_ns() -> int:
    """The default clock: wall time in ns (file mtimes and Redis PXAT are wall-clock based)."""
    return time.time_ns()


def check_key(key: object) -> bytes:
    """A store key: bytes of 16..64 (a 128-bit content hash or longer)."""
    if not isinstance(key, bytes | bytearray):
        raise TypeError(f"key: must be bytes (a block content hash), got {type(key).__name__}")
    if not MIN_KEY <= len(key) <= MAX_KEY:
        raise ValueError(f"key: must be {MIN_KEY}..{MAX_KEY} bytes long (a >= 128-bit hash), got {len(key)}")
    return bytes(key)


def as_payload(data: object) -> memoryview:
    """Bytes-like (or a C-contiguous numpy array) as a flat byte view, without copying."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("data: numpy array must be C-contiguous")
        return data.data.cast("B")  # the array's buffer, no copy
    if isinstance(data, bytes | bytearray | memoryview):
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    raise TypeError(f"data: must be bytes, bytearray, memoryview or a numpy array, got {type(data).__name__}")


def _digest(head: bytes | memoryview, key: bytes, cls: bytes | memoryview, payload: memoryview) -> bytes:
    # covers every header byte before the digest itself (so no bit of a record goes unchecked), the key
    # (a whole record filed under another key's name is a miss), the class name and the payload
    h = hashlib.blake2b(digest_size=32)
    h.update(head)
    h.update(key)
    h.update(cls)
    h.update(payload)
    return h.digest()


def encode(key: bytes, traffic_class: str, payload: memoryview) -> list[bytes | memoryview]:
    """The record as pieces to write in order (the payload is not copied)."""
    cls = traffic_class.encode()
    pre = _HEADER.pack(MAGIC, VERSION, len(cls), 0, len(payload), b"")[:_PRE]
    return [pre + _digest(pre, key, cls, payload) + cls, payload]


def decode(key: bytes, record: bytes | memoryview) -> tuple[str, bytes] | None:
    """(traffic class, payload) when the record is whole and belongs to ``key``; None otherwise."""
    mv = memoryview(record)
    if len(mv) < HEADER_SIZE:
        return None
    magic, version, nlen, _, plen, digest = _HEADER.unpack_from(mv)
    if magic != MAGIC or version != VERSION or len(mv) != HEADER_SIZE + nlen + plen:
        return None
    cls = bytes(mv[HEADER_SIZE : HEADER_SIZE + nlen])
    payload = mv[HEADER_SIZE + nlen :]
    if _digest(mv[:_PRE], key, cls, payload) != digest:
        return None
    try:
        name = cls.decode()
    except UnicodeDecodeError:
        return None
    return name, bytes(payload)


def header_class(record_head: bytes) -> str | None:
    """Traffic class from the first bytes of a record (no checksum: only used to pick a TTL)."""
    if len(record_head) < HEADER_SIZE or record_head[:4] != MAGIC:
        return None
    nlen = record_head[5]
    cls = record_head[HEADER_SIZE : HEADER_SIZE + nlen]
    if len(cls) != nlen:
        return None
    try:
        return cls.decode()
    except UnicodeDecodeError:
        return None


@attrs.frozen
class TTLPolicy:
    """Time to live per traffic class, in seconds. Default: agent 3 days, chatbot 7 days."""

    ttls_s: Mapping[str, float] = attrs.field(factory=lambda: dict(DEFAULT_TTLS_S), converter=dict)

    def __attrs_post_init__(self) -> None:
        if not self.ttls_s:
            raise ValueError("TTLPolicy.ttls_s: needs at least one traffic class")
        for name, ttl in self.ttls_s.items():
            if not isinstance(name, str) or not 1 <= len(name.encode()) <= 255:
                raise ValueError(f"TTLPolicy.ttls_s: class name {name!r} must be a str of 1..255 bytes")
            if not (isinstance(ttl, int | float) and np.isfinite(ttl) and ttl > 0):
                raise ValueError(
                    f"TTLPolicy.ttls_s[{name!r}]={ttl!r}: must be a finite number of seconds > 0"
                )

    def ttl_ns(self, traffic_class: str) -> int:
        """TTL of ``traffic_class`` in ns; ValueError naming the known classes otherwise."""
        try:
            return round(self.ttls_s[traffic_class] * 1e9)
        except (KeyError, TypeError):
            raise ValueError(
                f"traffic_class={traffic_class!r}: must be one of {sorted(self.ttls_s)}"
            ) from None


_log = logging.getLogger(__name__)


@attrs.define
class StoreStats:
    """Counters every backend keeps (reads by outcome; writes)."""

    hits: int = 0
    misses: int = 0
    expired: int = 0
    corrupt: int = 0
    puts: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class RecordReads:
    """``get`` / ``exists`` and ``touch``'s new expiry for a backend that stores checksummed records:
    the backend gives ``_read(key) -> (traffic class, payload) | None`` (a missing, expired, corrupt or
    truncated block is None), ``stats``, ``ttl`` and ``clock``."""

    stats: StoreStats
    ttl: TTLPolicy
    clock: Clock

    def _read(self, key: bytes) -> tuple[str, bytes] | None:  # pragma: no cover - each backend's own
        raise NotImplementedError

    def _decode(self, key: bytes, data: bytes, where: str) -> tuple[str, bytes] | None:
        """:func:`decode` of a stored record; a corrupt or truncated one is counted, logged (``where``:
        which block) and read as a miss."""
        rec = decode(key, data)
        if rec is None:
            self.stats.corrupt += 1
            _log.warning("kvstore: corrupt or truncated block %s (treated as a miss)", where)
        return rec

    def get(self, key: bytes) -> bytes | None:
        rec = self._read(check_key(key))
        if rec is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return rec[1]

    def exists(self, key: bytes) -> bool:
        return self._read(check_key(key)) is not None

    def _touch_expiry_ns(self, key: bytes, traffic_class: str | None) -> int | None:
        """The expiry a ``touch`` sets (now + the TTL of ``traffic_class``, else of the block's own class),
        or None when the block is not there. A bad class is refused before anything is read."""
        if traffic_class is not None:
            self.ttl.ttl_ns(traffic_class)
        rec = self._read(key)
        if rec is None:
            return None
        return self.clock() + self.ttl.ttl_ns(rec[0] if traffic_class is None else traffic_class)


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    extra_key: bytes | None = None,
    *,
    digest_size: int = 16,
) -> list[bytes]:
    """Chained content hashes of the full blocks of ``tokens``: key_i = H(key_{i-1}, extra_key, block_i).

    128-bit BLAKE2b by default, so equal keys mean equal prefixes (and extra keys: LoRA, model version)
    with collision odds the store can ignore; the partial last block has no key.
    """
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"block_size={block_size!r}: must be an int >= 1")
    if not MIN_KEY <= digest_size <= MAX_KEY:
        raise ValueError(f"digest_size={digest_size}: must be in [{MIN_KEY}, {MAX_KEY}]")
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    if arr.ndim != 1:
        raise ValueError(f"tokens: must be 1-D, got shape {arr.shape}")
    extra = b"" if extra_key is None else bytes(extra_key)
    parent = b"\x00" * digest_size
    out = []
    for i in range(arr.size // block_size):
        h = hashlib.blake2b(digest_size=digest_size, person=b"deepinfer-kvblk")
        h.update(parent)
        h.update(struct.pack("<Q", len(extra)))
        h.update(extra)
        h.update(arr[i * block_size : (i + 1) * block_size].tobytes())
        parent = h.digest()
        out.append(parent)
    return out
