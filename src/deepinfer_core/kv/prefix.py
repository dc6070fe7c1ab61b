"""PrefixIndex: content-addressed index of full KV blocks, sharing blocks with a PagedKVPool by refcount.

The index lives inside the C++ block pool (``_C.kv.BlockPool``), because eviction is part of
allocation: a cached block whose last user has gone stays matchable on an LRU list and counts as free;
when the plain free list is empty the least recently released cached block is evicted and reused.

Keys: a chained 64-bit content hash of (parent block's hash, the block's tokens, the extra key). A hit
is returned only after verifying the stored tokens, the extra key and the parent's unique, never-reused
node id, so hash collisions and evicted-then-reused parents can never return wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer_core.kv._checks import as_key, as_tokens, check_int
from deepinfer_core.kv.pool import PagedKVPool


class PrefixIndex:
    """Prefix cache over ``pool``'s blocks (the pool and the index share one C++ object)."""

    def __init__(self, pool: PagedKVPool) -> None:
        if not isinstance(pool, PagedKVPool):
            raise TypeError(f"pool must be a PagedKVPool, got {type(pool).__name__}")
        self.pool = pool
        self._impl = pool.impl

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a cache entry (in use or evictable)."""
        return self._impl.num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence holds: reusable on demand, matchable until then."""
        return self._impl.num_evictable_blocks

    def match(
        self, tokens: Sequence[int] | np.ndarray, extra_key: bytes | None = None
    ) -> tuple[int, list[int]]:
        """Longest cached prefix of ``tokens`` in whole blocks: (number of cached tokens, block ids).

        Changes nothing; pass the blocks straight to ``PagedKVPool.allocate(..., prefix_blocks=...)``
        before any other allocation (which could evict them), or use :meth:`allocate` which does both.
        """
        n, blocks = self._impl.match(as_tokens("tokens", tokens), as_key(extra_key))
        return n, blocks.tolist()

    def insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Sequence[int] | np.ndarray,
        extra_key: bytes | None = None,
    ) -> None:
        """Record the full blocks of ``tokens`` held in ``blocks`` (blocks must be in use, their KV written).

        A block whose content is already cached elsewhere is skipped; the partial last block is never cached.
        """
        self._impl.cache_blocks(as_tokens("tokens", tokens), as_tokens("blocks", blocks), as_key(extra_key))

    def insert_seq(
        self, seq_id: int, tokens: Sequence[int] | np.ndarray, extra_key: bytes | None = None
    ) -> int:
        """:meth:`insert` with the sequence's own block table; returns the number of new entries."""
        return self._impl.cache_seq(
            check_int("seq_id", seq_id), as_tokens("tokens", tokens), as_key(extra_key)
        )

    def allocate(
        self, seq_id: int, tokens: Sequence[int] | np.ndarray, extra_key: bytes | None = None
    ) -> int | None:
        """Match and allocate in one C++ call: the new sequence reuses the cached prefix blocks and gets
        fresh blocks for the rest. Returns the number of cached tokens (KV to skip), or None if the
        fresh blocks do not fit (no change)."""
        n = self._impl.allocate_cached(
            check_int("seq_id", seq_id), as_tokens("tokens", tokens), as_key(extra_key)
        )
        return None if n < 0 else n

    def evict_all(self) -> int:
        """Drop every evictable entry (e.g. after weights change); returns how many."""
        return self._impl.evict_all_cached()

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` has a cache entry."""
        return self._impl.is_cached(check_int("block", block))
