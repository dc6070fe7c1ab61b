"""StatePool: one fixed StateBlock per running sequence (C++ slot bookkeeping + optional byte storage).

Slot bookkeeping (free list, owner map) is ``_C.kv.StatePool``. When built with a
:class:`~deepinfer_core.kv.planner.StateLayout`, the pool also owns the bytes, a uint8 tensor
``[num_slots, layout.bytes_per_seq]``, and hands out views of one layer's ring, an accumulator, or the
persisted prefix (one contiguous slice: the point of the layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from deepinfer_core import _C
from deepinfer_core.kv._checks import as_i64, check_int
from deepinfer_core.kv.planner import StateLayout

if TYPE_CHECKING:
    import torch


class StatePool:
    """``num_slots`` state slots; :meth:`acquire` returns a slot index or None when all are held."""

    def __init__(self, num_slots: int, layout: StateLayout | None = None, device: str | None = None) -> None:
        n = check_int("num_slots", num_slots, min_value=0)
        self.impl = _C.kv.StatePool(n)
        self.layout = layout
        self.storage: torch.Tensor | None = None
        if layout is not None:
            import torch  # only pools that own bytes need torch

            self.storage = torch.zeros((n, layout.bytes_per_seq), dtype=torch.uint8, device=device)

    @property
    def num_slots(self) -> int:
        """All slots."""
        return self.impl.num_slots

    @property
    def num_free_slots(self) -> int:
        """Slots not held by any sequence."""
        return self.impl.num_free_slots

    def acquire(self, seq_id: int) -> int | None:
        """Hold a slot for ``seq_id``; None when none is free. ValueError if it already holds one."""
        s = self.impl.acquire(check_int("seq_id", seq_id))
        return None if s < 0 else s

    def release(self, seq_id: int) -> None:
        """Return the sequence's slot (its bytes are not cleared: the next owner overwrites them)."""
        self.impl.release(check_int("seq_id", seq_id))

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds a slot."""
        return self.impl.contains(check_int("seq_id", seq_id))

    def slot(self, seq_id: int) -> int:
        """The slot ``seq_id`` holds (ValueError if none)."""
        return self.impl.slot(check_int("seq_id", seq_id))

    def slots(self, seq_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """int32 slot per sequence, in one call."""
        return self.impl.slots(as_i64("seq_ids", seq_ids))

    def check_invariants(self) -> None:
        """Raise RuntimeError if the C++ bookkeeping is inconsistent."""
        self.impl.check_invariants()

    # --- byte views (need a layout) ---
    def _bytes(self, seq_id: int) -> torch.Tensor:
        if self.storage is None or self.layout is None:
            raise RuntimeError("this StatePool was built without a layout: it holds no bytes")
        return self.storage[self.slot(seq_id)]

    def ring(self, seq_id: int, layer: int) -> torch.Tensor:
        """uint8 view [ring_tokens, token_bytes] of one layer's SWA ring (draft layers after the model's)."""
        row = self._bytes(seq_id)
        lay = self.layout
        assert lay is not None
        n = len(lay.ring_offsets)
        if not 0 <= layer < n:
            raise ValueError(f"layer must be in [0, {n}), got {layer}")
        off = lay.ring_offsets[layer]
        return row[off : off + lay.ring_bytes].view(lay.ring_tokens, lay.token_bytes)

    def accumulator(self, seq_id: int, layer: int) -> torch.Tensor:
        """uint8 view of a compressing layer's partial-window accumulator."""
        row = self._bytes(seq_id)
        lay = self.layout
        assert lay is not None
        if layer not in lay.accumulator_offsets:
            raise ValueError(
                f"layer {layer} has no accumulator; compressing layers: {sorted(lay.accumulator_offsets)}"
            )
        off = lay.accumulator_offsets[layer]
        return row[off : off + lay.accumulator_bytes[layer]]

    def persisted(self, seq_id: int) -> torch.Tensor:
        """uint8 view of the persisted prefix (the encoder-half rings): one contiguous slice."""
        row = self._bytes(seq_id)
        assert self.layout is not None
        return row[: self.layout.persisted_bytes]
