"""Memory planning: bytes per rank of Engram tables sharded over an engram-parallel group."""

from __future__ import annotations

import attrs

from deepinfer_core.engram.config import EngramConfig
from deepinfer_core.engram.sharded import rows_per_rank
from deepinfer_core.engram.tables import bytes_per_row


@attrs.frozen(slots=True)
class EngramMemoryPlan:
    """Bytes of one or more tables, in ``fmt``, row-block sharded over ``group_size`` ranks."""

    table_rows: tuple[int, ...]
    row_dim: int
    fmt: str
    group_size: int
    bytes_per_row: int
    rows_per_rank: tuple[int, ...]  # per table: rows of the largest shard
    bytes_per_rank: int  # the largest shard of every table, summed (what each rank must reserve)
    total_bytes: int
    scales_replicated: bool = False  # fp8 scale table copied to every rank (DeepEP's engram buffer)

    def summary(self) -> str:
        return (
            f"{len(self.table_rows)} table(s), {sum(self.table_rows):,} rows x {self.bytes_per_row} B ({self.fmt}) = "
            f"{self.total_bytes / 1e9:.2f} GB; over {self.group_size} rank(s): {self.bytes_per_rank / 1e9:.3f} GB per rank"
            + (" (fp8 scales replicated on every rank)" if self.scales_replicated else "")
        )


def plan_memory(
    table_rows: int | tuple[int, ...] | list[int],
    row_dim: int,
    fmt: str,
    group_size: int,
    scales_replicated: bool = False,
) -> EngramMemoryPlan:
    """Plan for tables of ``table_rows`` rows each (one int: one table). ``scales_replicated``: the fp8
    scales of every row live on every rank, as DeepEP's engram buffer keeps them (only values are fetched
    remotely); otherwise scales are sharded with their rows, as ``ShardedEngramTable`` does."""
    rows = (int(table_rows),) if isinstance(table_rows, int) else tuple(int(r) for r in table_rows)
    if not rows or min(rows) <= 0:
        raise ValueError(f"table_rows={table_rows}: need at least one table with a positive row count")
    if group_size <= 0:
        raise ValueError(f"group_size={group_size}: must be positive")
    bpr = bytes_per_row(row_dim, fmt)
    rpr = tuple(rows_per_rank(r, group_size) for r in rows)
    per_rank = sum(rpr) * bpr
    if scales_replicated and fmt == "fp8":
        scale_bytes = bpr - row_dim
        per_rank = sum(rpr) * row_dim + sum(rows) * scale_bytes
    return EngramMemoryPlan(
        table_rows=rows,
        row_dim=row_dim,
        fmt=fmt,
        group_size=group_size,
        bytes_per_row=bpr,
        rows_per_rank=rpr,
        bytes_per_rank=per_rank,
        total_bytes=sum(rows) * bpr,
        scales_replicated=scales_replicated and fmt == "fp8",
    )


def plan_for_config(
    config: EngramConfig, fmt: str, group_size: int, scales_replicated: bool = False
) -> EngramMemoryPlan:
    """Plan for every layer's table of ``config`` (primes derived as the hasher does)."""
    from deepinfer_core.engram.hashing import derive_primes

    primes = derive_primes(config)
    rows = tuple(int(x) for x in primes.reshape(primes.shape[0], -1).sum(axis=1))
    return plan_memory(rows, config.head_dim, fmt, group_size, scales_replicated)
