"""Seams of the KV memory component (``deepinfer_core.kv``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class KVBlockPool(Protocol):
    """Paged pool of fixed-size blocks (compressed main KV + indexer keys), reference counted.

    Sequences are named by integer ids chosen by the caller. Block 0 is a reserved null block that is
    never handed out; block tables are padded with it. Running out of blocks is a normal outcome
    reported by a ``False`` return, never an exception.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list now."""
        ...

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens would fit right now."""
        ...

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Give a new sequence blocks for ``num_tokens`` tokens. False (and no change) if they do not fit."""
        ...

    def append_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow a sequence by ``num_tokens`` tokens. False (and no change) if the blocks do not fit."""
        ...

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; blocks whose count reaches zero return to the free list."""
        ...

    def fork(self, seq_id: int, child_id: int) -> None:
        """Make ``child_id`` share all of ``seq_id``'s blocks (refcounts incremented).

        A shared, partially filled last block must not be written in place: ``kv.PagedKVPool`` gives the
        appending sequence a fresh block on its next ``append_slots`` and queues the data copy
        (``take_copy_ops``) for the caller to execute before the next forward.
        """
        ...

    def block_tables(self, seq_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """int32 array [len(seq_ids), max blocks among them], padded with the null block 0, in one call."""
        ...


@runtime_checkable
class StatePool(Protocol):
    """One fixed state slot (SWA rings + compressor accumulators) per running sequence."""

    @property
    def num_free_slots(self) -> int:
        """Slots not held by any sequence."""
        ...

    def acquire(self, seq_id: int) -> int | None:
        """Hold a slot for ``seq_id`` and return its index, or None when none is free."""
        ...

    def release(self, seq_id: int) -> None:
        """Return the sequence's slot to the pool."""
        ...


@runtime_checkable
class PrefixIndex(Protocol):
    """Content-addressed index of full KV blocks, shared with a :class:`KVBlockPool` by refcount."""

    def match(
        self, tokens: Sequence[int] | np.ndarray, extra_key: bytes | None = None
    ) -> tuple[int, list[int]]:
        """Longest cached prefix of ``tokens`` in whole blocks: (number of cached tokens, block ids).

        Hits must be exact: an implementation verifies tokens (or uses a 128-bit hash) so that a hash
        collision never returns another prefix's KV. ``kv.PrefixIndex`` verifies tokens, extra key and
        parent identity on every hit.
        """
        ...

    def insert(
        self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], extra_key: bytes | None = None
    ) -> None:
        """Record the full blocks of ``tokens`` (held in ``blocks``) so later requests can hit them."""
        ...
