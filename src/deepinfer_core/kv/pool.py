"""PagedKVPool: Python face of the C++ paged block pool (``_C.kv.BlockPool``).

All bookkeeping runs in C++; this wrapper validates arguments and converts to numpy. The C++ object is
exposed as :attr:`PagedKVPool.impl` so C++ components (the scheduler) can drive the same pool.
Running out of blocks is reported as ``False``; only caller bugs (unknown or duplicate ids, negative
counts) raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer_core import _C
from deepinfer_core.kv._checks import as_i64, as_tokens, check_int


def num_compressed_entries(num_tokens: int, ratio: int) -> int:
    """Complete compressed entries held by ``num_tokens`` tokens at compression ``ratio``: floor(n / r).

    An entry is emitted when its window closes, i.e. at token position ``pos`` with ``(pos + 1) % r == 0``
    (ratio 2 fires on positions 1, 3, 5, ...); a trailing partial window lives in the compressor's
    accumulator (StatePool), not in the paged pool.
    """
    n = check_int("num_tokens", num_tokens, min_value=0)
    r = check_int("ratio", ratio, min_value=1)
    return n // r


def compression_fires(pos: int | np.ndarray, ratio: int) -> bool | np.ndarray:
    """Whether the token at position ``pos`` (0-based) closes a compression window: (pos + 1) % r == 0."""
    r = check_int("ratio", ratio, min_value=1)
    if isinstance(pos, np.ndarray):
        return (pos + 1) % r == 0
    return (check_int("pos", pos, min_value=0) + 1) % r == 0


class PagedKVPool:
    """Reference-counted pool of ``num_blocks`` blocks of ``block_size`` token slots (block 0 = null).

    Fork shares every block; the pool does copy-on-write of a shared, partially filled last block on the
    next append and queues the data copy for the caller (:meth:`take_copy_ops`).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        nb = check_int("num_blocks", num_blocks, min_value=1)
        bs = check_int("block_size", block_size, min_value=1)
        if nb > np.iinfo(np.int32).max:
            raise ValueError(f"num_blocks must fit int32, got {nb}")
        self.impl = _C.kv.BlockPool(nb, bs)

    # --- sizes ---
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.impl.block_size

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return self.impl.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free + evictable prefix-cached)."""
        return self.impl.num_free_blocks

    @property
    def num_seqs(self) -> int:
        """Live sequences."""
        return self.impl.num_seqs

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""
        return self.impl.blocks_for_tokens(check_int("num_tokens", num_tokens, min_value=0))

    # --- lifecycle ---
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now."""
        return self.impl.can_allocate(check_int("num_tokens", num_tokens, min_value=0))

    def allocate(
        self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] | np.ndarray | None = None
    ) -> bool:
        """New sequence with blocks for ``num_tokens`` tokens; False (no change) if they do not fit.

        ``prefix_blocks`` (from :meth:`PrefixIndex.match`) become the first table entries, shared by
        refcount; only the remaining blocks are taken from the free list.
        """
        sid = check_int("seq_id", seq_id)
        n = check_int("num_tokens", num_tokens, min_value=0)
        if prefix_blocks is None or len(prefix_blocks) == 0:
            return self.impl.allocate(sid, n)
        return self.impl.allocate_with_prefix(sid, n, as_tokens("prefix_blocks", prefix_blocks))

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``append_slots(seq_id, num_tokens)`` would succeed (copy-on-write block included)."""
        return self.impl.can_append(
            check_int("seq_id", seq_id), check_int("num_tokens", num_tokens, min_value=0)
        )

    def append_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow a sequence by ``num_tokens``; False (no change) if the blocks do not fit."""
        return self.impl.append_slots(
            check_int("seq_id", seq_id), check_int("num_tokens", num_tokens, min_value=0)
        )

    def free(self, seq_id: int) -> None:
        """Drop the sequence; blocks reaching refcount 0 go back (prefix-cached ones stay matchable)."""
        self.impl.free(check_int("seq_id", seq_id))

    def fork(self, seq_id: int, child_id: int) -> None:
        """``child_id`` shares all of ``seq_id``'s blocks (refcounts incremented)."""
        self.impl.fork(check_int("seq_id", seq_id), check_int("child_id", child_id))

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is live."""
        return self.impl.contains(check_int("seq_id", seq_id))

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence holds."""
        return self.impl.num_tokens(check_int("seq_id", seq_id))

    # --- batch forms (one C++ call per engine step) ---
    def allocate_many(
        self, seq_ids: Sequence[int] | np.ndarray, num_tokens: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """bool per sequence, in order (each one independent, as if allocate were called in a loop)."""
        return self.impl.allocate_many(as_i64("seq_ids", seq_ids), as_i64("num_tokens", num_tokens))

    def append_slots_many(self, seq_ids: Sequence[int] | np.ndarray, num_tokens: int) -> np.ndarray:
        """bool per sequence, in order (each one independent)."""
        return self.impl.append_slots_many(
            as_i64("seq_ids", seq_ids), check_int("num_tokens", num_tokens, min_value=0)
        )

    def free_many(self, seq_ids: Sequence[int] | np.ndarray) -> None:
        """Free each sequence in order (stops at the first unknown id, earlier ones stay freed)."""
        self.impl.free_many(as_i64("seq_ids", seq_ids))

    # --- tables and slots ---
    def block_table(self, seq_id: int) -> np.ndarray:
        """int32 copy of one sequence's block table."""
        return self.impl.block_table(check_int("seq_id", seq_id))

    def block_tables(self, seq_ids: Sequence[int] | np.ndarray, width: int | None = None) -> np.ndarray:
        """int32 [len(seq_ids), width or longest table], padded with the null block 0, in one call."""
        w = -1 if width is None else check_int("width", width, min_value=0)
        return self.impl.block_tables(as_i64("seq_ids", seq_ids), w)

    def slot(self, seq_id: int, pos: int) -> int:
        """Flat KV slot of token ``pos``: table[pos // block_size] * block_size + pos % block_size."""
        return self.impl.slot(check_int("seq_id", seq_id), check_int("pos", pos, min_value=0))

    def slot_mapping(self, seq_id: int, start: int, count: int, ratio: int = 1) -> np.ndarray:
        """int64 flat slots of positions [start, start + count) of one sequence (ratio 1), or of compressed
        entries [start, start + count) at compression ``ratio`` (a block holds block_size / ratio entries)."""
        return self.batch_slot_mapping([seq_id], [start], [count], ratio)

    def batch_slot_mapping(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        starts: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        ratio: int = 1,
    ) -> np.ndarray:
        """Concatenated int64 slots of ``[starts[i], starts[i] + counts[i])`` of each sequence, one C++ call.

        With ``ratio`` r > 1 the ranges are compressed-entry indices, valid below floor(num_tokens / r).
        """
        return self.impl.slot_mapping(
            as_i64("seq_ids", seq_ids),
            as_i64("starts", starts),
            as_i64("counts", counts),
            check_int("ratio", ratio, min_value=1),
        )

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink a sequence to ``num_tokens`` (e.g. rejected drafts), releasing whole trailing blocks."""
        self.impl.truncate(check_int("seq_id", seq_id), check_int("num_tokens", num_tokens, min_value=0))

    def refcount(self, block: int) -> int:
        """References held on ``block`` by live sequences."""
        return self.impl.refcount(check_int("block", block))

    def take_copy_ops(self) -> np.ndarray:
        """Pending copy-on-write copies, int32 rows (src_block, dst_block, num_tokens); clears them.

        Execute them on the KV memory before the next forward reads the destination blocks.
        """
        return self.impl.take_copy_ops()

    def check_invariants(self) -> None:
        """Full consistency check of the C++ state; raises RuntimeError naming the broken invariant."""
        self.impl.check_invariants()

    def __repr__(self) -> str:
        return (
            f"PagedKVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, seqs={self.num_seqs})"
        )
