"""Torch references of the KV cache device ops: paged store / load and the SWA ring.

The pool is a uint8 tensor ``[num_blocks, block_size, bytes_per_token]`` (or already flat
``[num_slots, bytes_per_token]``) holding each token in one of ``deepinfer_core.kv.formats``' byte formats
(``fp8``: 528 B, ``fp4``: 288 B at dim 512; ``mxfp4``: 68 B at dim 128 for indexer keys). Slot ``s`` is
block ``s // block_size``, offset ``s % block_size`` (vLLM's slot mapping); a negative slot marks a padding
token that is not stored.

- ``kv_store(pool, x, slot_mapping, fmt)``: quantise rows ``x [T, dim]`` and scatter them to their slots.
- ``kv_load(pool, block_table, seq_lens, fmt)``: gather every sequence's tokens through its block table
  and dequantise: ``[B, max_blocks * block_size, dim]``, zero past ``seq_lens``.
- ``swa_ring_write`` / ``swa_ring_read``: the per-sequence SWA ring ``[num_states, ring_len, bytes]``
  (ring_len = window + backtracking, 134 = 128 + 6 by default). Position ``p`` of a sequence lives in
  ring entry ``p % ring_len``. Rollback after rejected drafts moves no bytes: the caller shortens the
  sequence and the rejected entries are overwritten by the next writes; it is safe as long as no more
  than ``ring_len - window`` positions are rolled back, which ``swa_ring_read`` checks via ``window``.
"""

from __future__ import annotations

import torch

from deepinfer_core.kv.formats import CacheFormat, get_format
from deepinfer_kernels.registry import register


def resolve_format(fmt: str | CacheFormat, dim: int) -> CacheFormat:
    """A format object for ``fmt`` at ``dim`` (names as in ``deepinfer_core.kv.formats.get_format``)."""
    f = get_format(fmt, dim) if isinstance(fmt, str) else fmt
    if f.dim != dim:
        raise ValueError(f"fmt: format {f.name!r} has dim {f.dim} but the rows have dim {dim}")
    return f


def flat_pool(pool: torch.Tensor, bytes_per_token: int) -> torch.Tensor:
    """``pool`` viewed as ``[num_slots, bytes_per_token]`` (a view: writes reach the pool)."""
    if pool.dtype != torch.uint8:
        raise ValueError(f"pool: must be uint8, got {pool.dtype}")
    if pool.dim() not in (2, 3) or pool.shape[-1] != bytes_per_token:
        raise ValueError(
            f"pool: must be [blocks, block_size, {bytes_per_token}] or [slots, {bytes_per_token}], got {tuple(pool.shape)}"
        )
    if not pool.is_contiguous():
        raise ValueError("pool: must be contiguous")
    return pool.view(-1, bytes_per_token)


def check_slots(name: str, slots: torch.Tensor, n: int, num_slots: int) -> torch.Tensor:
    if slots.dtype not in (torch.int32, torch.int64) or slots.shape != (n,):
        raise ValueError(
            f"{name}: must be int32/int64 of shape ({n},), got {slots.dtype} {tuple(slots.shape)}"
        )
    if n and int(slots.max()) >= num_slots:
        raise IndexError(f"{name}: slot {int(slots.max())} is outside the pool's {num_slots} slots")
    return slots.to(torch.int64)


@register("kv_store")
def kv_store(
    pool: torch.Tensor,
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: str | CacheFormat = "fp8",
    check: bool = True,
) -> torch.Tensor:
    """Quantise ``x [T, dim]`` into ``fmt`` and write token ``i`` to slot ``slot_mapping[i]`` (skipped if < 0)."""
    if x.dim() != 2:
        raise ValueError(f"x: must be [tokens, dim], got shape {tuple(x.shape)}")
    f = resolve_format(fmt, x.shape[1])
    flat = flat_pool(pool, f.bytes_per_token)
    slots = check_slots("slot_mapping", slot_mapping, x.shape[0], flat.shape[0]).to(pool.device)
    keep = slots >= 0
    if bool(keep.any()):
        flat.index_copy_(0, slots[keep], f.quantize(x[keep.to(x.device)]).to(pool.device))
    return pool


@register("kv_load")
def kv_load(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str | CacheFormat = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """Dequantised tokens ``[B, max_blocks * block_size, dim]`` of each sequence, zero past ``seq_lens[b]``.

    ``check``: see ``kv_store`` (the reference always checks)."""
    f = resolve_format(fmt, dim)
    if pool.dim() != 3:
        raise ValueError(
            f"pool: must be [blocks, block_size, bytes] for kv_load, got shape {tuple(pool.shape)}"
        )
    num_blocks, bs, _ = pool.shape
    flat = flat_pool(pool, f.bytes_per_token)
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table: must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    b, m = block_table.shape
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens: must have shape ({b},), got {tuple(seq_lens.shape)}")
    if b and m and (int(block_table.min()) < 0 or int(block_table.max()) >= num_blocks):
        raise IndexError(f"block_table: block ids must be in [0, {num_blocks})")
    if b and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > m * bs):
        raise ValueError(f"seq_lens: must be in [0, max_blocks * block_size = {m * bs}]")
    t = torch.arange(m * bs, device=pool.device)
    slots = block_table.to(pool.device, torch.int64)[:, t // bs] * bs + t % bs  # [B, L]
    out = f.dequantize(flat[slots.reshape(-1)]).reshape(b, m * bs, dim)
    valid = t[None, :] < seq_lens.to(pool.device)[:, None]
    return torch.where(valid[..., None], out, torch.zeros((), device=pool.device)).to(out_dtype)


def ring_slots(ring: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat slot of (state, position) in a ring ``[num_states, ring_len, bytes]``: state * ring_len + p % ring_len."""
    if ring.dim() != 3:
        raise ValueError(f"ring: must be [num_states, ring_len, bytes], got shape {tuple(ring.shape)}")
    n, ring_len = ring.shape[0], ring.shape[1]
    if states.shape != positions.shape or states.dim() != 1:
        raise ValueError(
            f"states / positions: must be 1-D of one shape, got {tuple(states.shape)} and {tuple(positions.shape)}"
        )
    if states.numel() and (int(states.min()) < 0 or int(states.max()) >= n):
        raise IndexError(f"states: must be in [0, {n})")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("positions: must be >= 0")
    return states.to(torch.int64) * ring_len + positions.to(torch.int64) % ring_len


def last_writer_only(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` with every repeated slot but its last occurrence set to -1 (not stored).

    A prefill longer than the ring writes position p and p + ring_len in one call; the later token must
    win, and a scatter with duplicate indices has no defined winner on any backend.
    """
    if slots.numel() < 2:
        return slots
    order = torch.argsort(slots, stable=True)  # equal slots stay in token order
    s = slots[order]
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    keep = torch.empty_like(last)
    keep[order] = last
    return torch.where(keep, slots, -1)


@register("swa_ring_write")
def swa_ring_write(
    ring: torch.Tensor,
    x: torch.Tensor,
    states: torch.Tensor,
    positions: torch.Tensor,
    fmt: str | CacheFormat = "fp8",
    check: bool = True,
) -> torch.Tensor:
    """Quantise ``x [T, dim]`` and write token ``i`` at ring entry ``positions[i] % ring_len`` of ``states[i]``.

    When several tokens of one call land on one entry (a prefill longer than the ring), the last one wins.
    """
    return kv_store(ring, x, last_writer_only(ring_slots(ring, states, positions)), fmt)


def ring_window_slots(
    ring: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat slots [B, window], valid [B, window]) of positions ``lengths - window .. lengths - 1``."""
    ring_len = ring.shape[1]
    if not 0 < window <= ring_len:
        raise ValueError(f"window={window}: must be in [1, ring_len={ring_len}]")
    if lengths.shape != states.shape:
        raise ValueError(
            f"lengths: must have the shape of states {tuple(states.shape)}, got {tuple(lengths.shape)}"
        )
    j = torch.arange(window, device=ring.device)
    pos = lengths.to(ring.device, torch.int64)[:, None] - window + j[None, :]
    valid = pos >= 0
    slots = ring_slots(
        ring, states.to(ring.device)[:, None].expand_as(pos).reshape(-1), pos.clamp(min=0).reshape(-1)
    )
    return slots.view_as(pos), valid


@register("swa_ring_read")
def swa_ring_read(
    ring: torch.Tensor,
    states: torch.Tensor,
    lengths: torch.Tensor,
    window: int = 128,
    fmt: str | CacheFormat = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """The last ``window`` tokens ``[B, window, dim]`` before ``lengths[b]`` (oldest first; zero before position 0)."""
    f = resolve_format(fmt, dim)
    flat = flat_pool(ring, f.bytes_per_token)
    slots, valid = ring_window_slots(ring, states, lengths, window)
    out = f.dequantize(flat[slots.reshape(-1)]).reshape(*slots.shape, dim)
    return torch.where(valid[..., None], out, torch.zeros((), device=ring.device)).to(out_dtype)


def check_gather_out(out: torch.Tensor, slots: torch.Tensor, dim: int, col: int) -> None:
    """``out`` of ``kv_gather``: [rows, total, dim] with slots [rows, k] and col + k <= total (shapes only)."""
    if slots.dim() != 2:
        raise ValueError(f"slots: with out, must be [rows, k], got shape {tuple(slots.shape)}")
    rows, k = slots.shape
    if out.dim() != 3 or out.shape[0] != rows or out.shape[2] != dim:
        raise ValueError(f"out: must be [{rows}, total, {dim}], got {tuple(out.shape)}")
    if not (isinstance(col, int) and col >= 0 and col + k <= out.shape[1]):
        raise ValueError(f"col={col!r}: must be an int with 0 <= col and col + {k} <= {out.shape[1]}")


@register("kv_gather")
def kv_gather(
    pool: torch.Tensor,
    slots: torch.Tensor,
    fmt: str | CacheFormat = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    col: int = 0,
) -> torch.Tensor:
    """Rows ``slots`` (int64, any shape; < 0 gives zeros) of a paged pool or ring, dequantised to
    ``[*slots.shape, dim]``. No value checks: the executor's decode gathers, whose slots come from its
    validated tables (a device-side range check would synchronise). With ``out`` ([rows, total, dim],
    slots [rows, k]) the rows land in ``out[:, col : col + k]`` and ``out`` is returned: two gathers
    (say a window and a top-k set, from different pools) fill one key buffer without a concatenation."""
    f = resolve_format(fmt, dim)
    flat = flat_pool(pool, f.bytes_per_token)
    s = slots.reshape(-1).to(pool.device, torch.int64)
    got = f.dequantize(flat[s.clamp(min=0)]).to(out_dtype)
    got = torch.where((s >= 0)[:, None], got, torch.zeros((), dtype=out_dtype, device=got.device))
    if out is not None:
        check_gather_out(out, slots, dim, col)
        out[:, col : col + slots.shape[1]] = got.view(*slots.shape, dim)
        return out
    return got.view(*slots.shape, dim)
