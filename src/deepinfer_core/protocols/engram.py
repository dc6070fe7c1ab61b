"""Seams of the Engram component (``deepinfer_core.engram``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
        """Rows for int ``row_ids`` of any shape, returned [*row_ids.shape, row_dim] in the caller's order
        on the caller's device. Ids outside [0, num_rows) raise ``IndexError``."""
        ...
