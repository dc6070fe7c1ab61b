"""Adapter to DeepEP's Engram buffer (``deep_ep.ElasticBuffer``), used only when deep_ep is importable.

Facts from DeepEP's public API: ``ElasticBuffer(group, ...)``; ``engram_write(storage, sf=None)`` takes
this rank's row block [rows_per_rank, hidden] (bf16, or fp8 with a scale table ``sf`` replicated on every
rank); ``engram_fetch(indices)`` launches the one-sided gets and returns a hook, and calling the hook
waits and returns the rows (or ``(rows, sf)`` for fp8), global row = rank * rows_per_rank + local row.
Constructor sizing arguments differ between DeepEP versions, so they are passed through unchanged.

Not exercised here: deep_ep needs NVSHMEM / NCCL GIN and GPUs to build. The torch
:class:`~deepinfer_core.engram.sharded.ShardedEngramTable` has the same layout and contract.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.engram.tables import check_row_ids
from deepinfer_kernels.ops.engram import dequantize_fp8


def deep_ep_available() -> bool:
    return importlib.util.find_spec("deep_ep") is not None


class DeepEPEngramTable:
    """A DeepEP engram buffer behind the ``EngramTable`` protocol (bf16, or fp8 with ue8m0 scales)."""

    def __init__(
        self,
        local_data: torch.Tensor,
        num_rows: int,
        group: dist.ProcessGroup,
        scales: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        **buffer_kwargs: Any,
    ) -> None:
        if not deep_ep_available():
            raise ImportError("DeepEPEngramTable: deep_ep is not importable; use ShardedEngramTable instead")
        import deep_ep

        self.buffer = deep_ep.ElasticBuffer(group, **buffer_kwargs)
        sf = scales.view(torch.float8_e8m0fnu) if scales is not None else None
        if sf is None:
            self.buffer.engram_write(local_data)
        else:
            self.buffer.engram_write(local_data, sf)
        self._num_rows = int(num_rows)
        self._row_dim = int(local_data.shape[1])
        self.out_dtype = out_dtype

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_dim(self) -> int:
        return self._row_dim

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        flat = check_row_ids(row_ids, self._num_rows)
        result = self.buffer.engram_fetch(flat.to(torch.int32))()
        if isinstance(result, tuple):
            data, sf = result
            rows = dequantize_fp8(data, sf.view(torch.uint8), self.out_dtype)
        else:
            rows = result.to(self.out_dtype)
        return rows.reshape(*row_ids.shape, self._row_dim)
