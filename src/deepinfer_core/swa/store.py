"""Host-memory SWA store: the persisted half of the state block (the encoder's SWA rings), one copy per
prefix, under a byte budget with LRU eviction.

DeepSeek keeps three cache lifecycles (release-news seed): in-flight block and state KV on the GPU, the
SWA state in host memory (a single copy), the block KV in a persistent store. This is the middle one.
An entry is the encoder rings of one sequence at a position ``pos`` that ends a prefix (at the released
shape ``20 layers x 134 tokens x 528 B = 1,415,040 B``), keyed by the prefix's chained digest
(:func:`prefix_digests`); the decoder half is never stored (bounded replay rebuilds it).

Keys are 16-byte BLAKE2b digests chained block by block (digest_i = H(digest_{i-1} || tokens of block
i)), so a key names the whole prefix; an entry also records its length and an extra key (e.g. the
model / format) which a lookup must match. numpy only (no torch), so another engine can use it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence

import attrs
import numpy as np

log = logging.getLogger(__name__)


def prefix_digests(
    tokens: Sequence[int] | np.ndarray, block: int, start: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained digests of every whole ``block`` of ``tokens``: element i names tokens [0, (i+1) block).

    ``start`` continues an earlier call's list (only the blocks after it are hashed), so a growing
    sequence hashes each block once.
    """
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block: {block!r}: must be an int >= 1")
    t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    if t.ndim != 1:
        raise ValueError(f"tokens: must be 1-D, got shape {t.shape}")
    out = list(start)
    prev = out[-1] if out else b""
    for i in range(len(out), t.shape[0] // block):
        prev = hashlib.blake2b(prev + t[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@attrs.define
class StoreStats:
    puts: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # entries bigger than the whole budget


@attrs.frozen
class SWAEntry:
    pos: int
    extra_key: bytes
    rings: np.ndarray  # uint8 [encoder layers, ring, bytes per token], ring index = position % ring


class HostSWAStore:
    """LRU map prefix digest -> :class:`SWAEntry`, at most ``byte_budget`` bytes of ring data."""

    def __init__(self, byte_budget: int) -> None:
        if isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0:
            raise ValueError(f"byte_budget: {byte_budget!r}: must be an int >= 0")
        self.byte_budget = byte_budget
        self._d: OrderedDict[bytes, SWAEntry] = OrderedDict()
        self.nbytes = 0
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: bytes) -> bool:
        return key in self._d

    def put(self, key: bytes, pos: int, rings: np.ndarray, extra_key: bytes = b"") -> bool:
        """Store (or refresh) the rings for prefix ``key`` of ``pos`` tokens; evicts least recently used
        entries to fit. Returns False when the entry alone exceeds the budget (nothing stored)."""
        if not isinstance(key, bytes) or not key:
            raise ValueError("key: must be non-empty bytes (a prefix digest)")
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 1:
            raise ValueError(f"pos: {pos!r}: must be an int >= 1")
        a = np.asarray(rings)
        if a.dtype != np.uint8 or a.ndim != 3:
            raise ValueError(f"rings: must be uint8 [layers, ring, bytes], got {a.dtype} {a.shape}")
        if a.nbytes > self.byte_budget:
            self.stats.rejected += 1
            return False
        old = self._d.pop(key, None)
        if old is not None:
            self.nbytes -= old.rings.nbytes
        while self._d and self.nbytes + a.nbytes > self.byte_budget:
            _, ev = self._d.popitem(last=False)
            self.nbytes -= ev.rings.nbytes
            self.stats.evictions += 1
        self._d[key] = SWAEntry(pos, bytes(extra_key), np.array(a, copy=True))
        self.nbytes += a.nbytes
        self.stats.puts += 1
        return True

    def get(self, key: bytes, pos: int, extra_key: bytes = b"") -> np.ndarray | None:
        """The rings of prefix ``key`` if stored for exactly ``pos`` tokens and ``extra_key`` (marks it most
        recently used), else None."""
        e = self._d.get(key)
        if e is None or e.pos != pos or e.extra_key != bytes(extra_key):
            self.stats.misses += 1
            return None
        self._d.move_to_end(key)
        self.stats.hits += 1
        return e.rings

    def has(self, key: bytes, pos: int, extra_key: bytes = b"") -> bool:
        """Whether :meth:`get` would hit (does not touch the LRU order or the counters)."""
        e = self._d.get(key)
        return e is not None and e.pos == pos and e.extra_key == bytes(extra_key)

    def clear(self) -> None:
        self._d.clear()
        self.nbytes = 0
