"""Seams of the Engram component (``deepinfer_core.engram``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocols stay importable without torch
    import torch


@runtime_checkable
class EngramTable(Protocol):
    """Rows of a (possibly sharded or host-resident) Engram table, fetched by global row id."""

    @property
    def num_rows(self) -> int:
        """Global number of rows."""
        ...

    @property
    def row_dim(self) -> int:
        """Values per row."""
        ...

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows for int ``row_ids`` of any shape (duplicates allowed), returned [*row_ids.shape, row_dim]
        in the caller's order, dequantised (bf16 by default), on the device the table serves (host tables:
        the device they copy to). Ids outside [0, num_rows) raise ``IndexError`` naming the id; a sharded
        table still takes part in the collective before raising, so one bad fetch fails alone."""
        ...
