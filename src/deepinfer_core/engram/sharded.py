"""An Engram table sharded by row blocks over a torch.distributed group (the engram-parallel group).

Rank r of a group of size W owns global rows [r * rows_per_rank, (r + 1) * rows_per_rank) with
rows_per_rank = ceil(num_rows / W) (the last rank may own fewer): global row = rank * rows_per_rank +
local row, DeepEP's engram layout. A fetch is collective, every rank of the group calls it once per step
(with its own ids, possibly none):

1. deduplicate the ids (n-gram rows repeat within a batch) and sort them, which also groups them by owner;
2. exchange per-owner counts, then the ids themselves, with ``all_to_all_single``;
3. each owner gathers the requested local rows, still quantised, packed as bytes (values + scales);
4. a second ``all_to_all_single`` returns the rows; they are dequantised and scattered back to the
   caller's order and shape (duplicates included).

Works with gloo (CPU) and NCCL (GPU): the exchange runs on the shard's device. Only the split sizes cross
to the host (one small sync per fetch), because ``all_to_all_single`` needs them as Python ints.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from deepinfer_core.engram.tables import _check_storage, check_row_ids, make_storage
from deepinfer_kernels.ops.engram import dequantize_fp8

log = logging.getLogger(__name__)


def rows_per_rank(num_rows: int, world_size: int) -> int:
    """Rows owned by each rank (the last may own fewer)."""
    if num_rows <= 0 or world_size <= 0:
        raise ValueError(f"num_rows={num_rows}, world_size={world_size}: both must be positive")
    return -(-num_rows // world_size)


def shard_range(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the global rows that ``rank`` owns."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    rpr = rows_per_rank(num_rows, world_size)
    return min(rank * rpr, num_rows), min((rank + 1) * rpr, num_rows)


class ShardedEngramTable:
    """Row-block shard of one Engram table on this rank; ``fetch`` is collective over ``group``."""

    def __init__(
        self,
        local_data: torch.Tensor,
        local_scales: torch.Tensor | None,
        num_rows: int,
        group: dist.ProcessGroup | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedEngramTable: torch.distributed is not initialised; call init_process_group first"
            )
        self.fmt = _check_storage(local_data, local_scales)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._num_rows = int(num_rows)
        self.rows_per_rank = rows_per_rank(self._num_rows, self.world_size)
        start, stop = shard_range(self._num_rows, self.world_size, self.rank)
        if local_data.shape[0] != stop - start:
            raise ValueError(
                f"local_data: rank {self.rank} owns rows [{start}, {stop}) of {num_rows} "
                f"({stop - start} rows), got {local_data.shape[0]}"
            )
        self.row_start = start
        self.data = local_data.contiguous()
        self.scales = local_scales.contiguous() if local_scales is not None else None
        self.out_dtype = out_dtype
        self._row_dim = int(local_data.shape[1])
        # Byte layout of one packed row on the wire: the values, then the scale codes.
        self._value_bytes = self._row_dim * local_data.element_size()
        self._row_bytes = self._value_bytes + (self.scales.shape[1] if self.scales is not None else 0)

    @classmethod
    def from_full(
        cls,
        values: torch.Tensor,
        fmt: str = "bf16",
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> ShardedEngramTable:
        """Keep this rank's block of a full [num_rows, dim] table (tests and demos; a server loads only
        its own block from the checkpoint)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        start, stop = shard_range(values.shape[0], world, rank)
        data, scales = make_storage(values[start:stop], fmt)
        if device is not None:
            data = data.to(device)
            scales = scales.to(device) if scales is not None else None
        return cls(data, scales, values.shape[0], group)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_dim(self) -> int:
        return self._row_dim

    @property
    def device(self) -> torch.device:
        return self.data.device

    def _pack(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = self.data.view(torch.uint8).index_select(0, local_ids)  # [n, value_bytes]: any dtype as bytes
        if self.scales is None:
            return rows
        return torch.cat([rows, self.scales.index_select(0, local_ids)], dim=1)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        values = packed[:, : self._value_bytes].contiguous().view(self.data.dtype)
        if self.scales is None:
            return values.to(self.out_dtype)
        return dequantize_fp8(values, packed[:, self._value_bytes :], self.out_dtype)

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Collective: every rank of the group must call it (with its own ids, possibly empty)."""
        dev = self.data.device
        error: Exception | None = None
        try:
            flat = check_row_ids(row_ids, self._num_rows).to(dev)
        except (IndexError, TypeError) as e:
            # Take part in the exchange with an empty request so the other ranks do not hang, then raise:
            # a bad fetch on one rank fails that caller only.
            error, flat = e, torch.empty(0, dtype=torch.int64, device=dev)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        owner = torch.div(uniq, self.rows_per_rank, rounding_mode="floor")
        send_counts = torch.bincount(owner, minlength=self.world_size).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        want = torch.empty(sum(recv_split), dtype=torch.int64, device=dev)
        dist.all_to_all_single(want, uniq, recv_split, send_split, group=self.group)
        packed = self._pack(want - self.row_start)
        got = torch.empty((uniq.numel(), self._row_bytes), dtype=torch.uint8, device=dev)
        dist.all_to_all_single(got, packed, send_split, recv_split, group=self.group)
        if error is not None:
            raise error
        rows = self._unpack(got)
        return rows.index_select(0, inverse).reshape(*row_ids.shape, self._row_dim)
