"""Where an Engram table lives, for users that only know the ``EngramTable`` protocol (the executor).

:func:`place_tables` moves tables to a placement (one device, host memory, row shards over a group),
:func:`local_table` makes a one-device table from its storage, :func:`device_local` says whether a table
is a one-device table on a given device (a gather kernel, fetchable inside a CUDA graph) and
:func:`unchecked` wraps such a table so that its ``fetch`` skips the id range check (which reads the ids
back: a device synchronisation). The concrete table classes stay inside this component.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepinfer_core.engram.sharded import ShardedEngramTable, shard_range
from deepinfer_core.engram.tables import HostEngramTable, LocalEngramTable
from deepinfer_core.protocols.engram import EngramTable

PLACEMENTS = ("local", "host", "sharded")


def local_table(
    data: torch.Tensor, scales: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
) -> EngramTable:
    """A one-device table over ``data`` (bf16, or fp8 with ``scales``) on data's device."""
    return LocalEngramTable(data, scales, out_dtype=out_dtype)


def device_local(table: EngramTable, device: torch.device) -> bool:
    """Whether ``table`` is a one-device table on ``device`` (its fetch is one gather kernel there)."""
    return type(table) is LocalEngramTable and table.device == device


class _UncheckedRows:
    """A one-device table whose ``fetch`` skips the id range check (``LocalEngramTable.fetch(check=False)``):
    the check reads the ids' min / max back, a device synchronisation every decode step (with the overlap,
    a wait for the whole step in flight), and ids from the hasher are in range by construction (each
    column's modulus and offset)."""

    def __init__(self, table: LocalEngramTable) -> None:
        self.table = table

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    @property
    def row_dim(self) -> int:
        return self.table.row_dim

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        return self.table.fetch(row_ids, check=False)


def unchecked(table: EngramTable) -> EngramTable:
    """``table`` for row ids from the hasher: a one-device table skips the id checks; any other kind
    (host, sharded, a user's) keeps its own ``fetch``."""
    return _UncheckedRows(table) if type(table) is LocalEngramTable else table


def place_tables(
    tables: Mapping[int, EngramTable], placement: str, device: torch.device, group: Any = None
) -> dict[int, EngramTable]:
    """``tables`` in ``placement`` (same rows, same values): ``"local"`` keeps them, copying one-device
    tables to ``device`` (their rows are then one device gather per step, and the engine's overlap can
    fetch rows for ids hashed on the device); ``"host"`` holds them in host memory, copying the fetched
    rows to ``device``; ``"sharded"`` keeps this rank's row block of each over ``group`` (a
    torch.distributed group whose every rank runs the same fetches). Host and sharded tables are made
    from the storage of one-device tables and fetch float32 rows."""
    if placement not in PLACEMENTS:
        raise ValueError(f"engram_placement={placement!r}: must be 'local', 'host' or 'sharded'")
    if placement == "local":
        return {
            lid: t.to(device) if type(t) is LocalEngramTable and t.device != device else t
            for lid, t in tables.items()
        }
    out: dict[int, EngramTable] = {}
    for lid, t in tables.items():
        if not isinstance(t, LocalEngramTable | HostEngramTable):
            raise TypeError(
                f"tables[{lid}]: a {type(t).__name__} cannot be re-placed (give one-device tables)"
            )
        data, scales = t.data, t.scales
        if placement == "host":
            out[lid] = HostEngramTable(data, scales, device=device, out_dtype=torch.float32)
        else:
            import torch.distributed as dist

            world, rank = dist.get_world_size(group), dist.get_rank(group)
            a, z = shard_range(data.shape[0], world, rank)
            out[lid] = ShardedEngramTable(
                data[a:z],
                None if scales is None else scales[a:z],
                data.shape[0],
                group,
                out_dtype=torch.float32,
            )
    return out
