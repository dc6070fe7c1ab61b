"""Seam of the external KV block store (``deepinfer_core.kvstore``).

No torch here on purpose: the store moves bytes; only the swap-in helper touches device tensors.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KVBlockStore(Protocol):
    """Persistent blocks of KV by content hash (the prefix index's block keys), with a TTL per traffic class.

    Contract every backend keeps (tests/deepinfer_core/kvstore/ checks each one):

    - a block becomes visible only after a complete write whose checksum verifies; a reader sees the whole
      block or a miss, never a prefix of it;
    - a block put (or touched) at time t under class k is a hit strictly before ``t + ttl(k)`` and a miss
      from that instant on (backend clock resolution: ns for files and memory, ms for Redis);
    - concurrent writers of one key (threads or processes) are safe: the key ends holding one of the
      written blocks, whole;
    - a corrupt or truncated block is a miss, never wrong bytes.
    """

    def put(
        self, key: bytes, data: bytes | bytearray | memoryview, *, traffic_class: str = "chatbot"
    ) -> None:
        """Store ``data`` under ``key`` (16..64 bytes) with the TTL of ``traffic_class``; replaces any block there."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, or None on a miss (absent, expired, corrupt, truncated)."""
        ...

    def exists(self, key: bytes) -> bool:
        """Whether ``get`` would hit now (checksum included)."""
        ...

    def touch(self, key: bytes, *, traffic_class: str | None = None) -> bool:
        """Restart the block's TTL (its own class's, or ``traffic_class``'s); False on a miss. The block
        keeps the class it was put with: a later touch without a class uses that one again."""
        ...

    def delete(self, key: bytes) -> bool:
        """Remove the block; False if it was not there."""
        ...
