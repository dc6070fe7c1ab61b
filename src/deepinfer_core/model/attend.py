"""The one SWA / FULL / REINDEX attention dispatch of the executor's paths.

A layer's attention over the caches is the same sequence of steps on every path of the executor: write
the new sliding-window keys, then (SWA) attend the window alone, or (FULL) pool the groups the step
completes into the paged caches, (FULL / REINDEX) score the indexer and pick the top-k compressed entries,
and attend the window plus those entries. :func:`attend_layer` is that sequence, once; a path supplies the
steps as an :class:`AttendPath`: the row path (``decode_step.RowAttention``: every row of a decode /
verify step at once) and the per-request path (``prefill.RequestAttention``: one request's chunk, tiled
or dense).

The float64 references keep their own dispatch on purpose: ``DeepSeekV41.forward_full`` (model.py) and
the training forward (training.py) attend over complete in-memory matrices with no cache, no rings and no
byte formats, so they stay an independent oracle of this code rather than another caller of it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA


class AttendPath(Protocol):
    """The steps of one layer's attention on one path of the executor (see the module docstring)."""

    def write_window(self) -> None:
        """Write this step's sliding-window keys into the layer's SWA ring."""
        ...

    def attend_window(self) -> torch.Tensor:
        """Attention over the window alone (an SWA layer): [N, H, d]."""
        ...

    def compress(self) -> None:
        """Pool the groups this step completes into the paged main KV and indexer keys (a FULL layer)."""
        ...

    def select(self) -> None:
        """Score the indexer and keep each row's top-k compressed entries (FULL / REINDEX layers)."""
        ...

    def attend_compressed(self) -> torch.Tensor:
        """Attention over the window and the index source's top-k entries: [N, H, d]."""
        ...


def attend_layer(kind: str, path: AttendPath) -> torch.Tensor:
    """One layer's attention on ``path``; ``kind``: the layer's ``cfg.layer_kind`` (SWA, FULL, REINDEX or REUSE:
    a REUSE layer reads its source's KV and the top-k of its index source)."""
    path.write_window()
    if kind == LAYER_SWA:
        return path.attend_window()
    if kind == LAYER_FULL:
        path.compress()
    if kind in (LAYER_FULL, LAYER_REINDEX):
        path.select()
    return path.attend_compressed()
