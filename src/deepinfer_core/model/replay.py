"""The executor's SWA bounded-replay side (``deepinfer_core.swa``): ring snapshots, restores, replays,
block copies (docs/swa.md).

Functions of the executor's :class:`~deepinfer_core.model.state.ExecutorState`: the per-slot floors and
snapshot requests they read are set by ``ModelExecutor.execute``; the prefill path assembles in-chunk
snapshots and writes no block while ``no_block_writes`` is set (a replay reads shared blocks only).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.model.batch import BatchError, ForwardBatch
from deepinfer_core.model.engram_context import engram_rows
from deepinfer_core.model.prefill import step_attention
from deepinfer_core.model.state import ExecutorState

# the per-slot host arrays a slot's state includes (ExecutorState fields)
SLOT_ARRAYS = ("tokens", "slot_end", "encoder_only", "floor", "min_start")


def slot_state(st: ExecutorState, slot: int) -> dict[str, torch.Tensor]:
    """Copies of everything the executor keeps per state slot (its SWA rings, compressor rings and host
    arrays), by name: what a prompt engine hands a completion engine with the slot's blocks."""
    out = {f"swa.{i}": r[slot].clone() for i, r in enumerate(st.swa)}
    out.update({f"comp.{k}": v[slot].clone() for k, v in st.comp_state.items()})
    for name in SLOT_ARRAYS:
        out[name] = torch.from_numpy(np.array(getattr(st, name)[slot], copy=True).reshape(-1))
    return out


def load_slot_state(st: ExecutorState, slot: int, state: dict[str, torch.Tensor]) -> None:
    """Put a :func:`slot_state` (of an executor of the same model and sizes) into ``slot``."""
    want = set(slot_state(st, slot))
    if set(state) != want:
        raise ValueError(f"slot state: fields {sorted(state)}, this executor keeps {sorted(want)}")
    for i, r in enumerate(st.swa):
        r[slot].copy_(state[f"swa.{i}"].to(r.device))
    for k, v in st.comp_state.items():
        v[slot].copy_(state[f"comp.{k}"].to(v.device))
    for name in SLOT_ARRAYS:
        arr = getattr(st, name)
        arr[slot] = state[name].cpu().numpy().reshape(np.shape(arr[slot]))


@torch.no_grad()
def copy_blocks(st: ExecutorState, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy whole blocks (main KV and indexer keys of every source layer): a prefix hit's cached
    blocks into a sequence's own blocks when they cannot be shared (docs/swa.md)."""
    s = torch.as_tensor(np.asarray(src, dtype=np.int64), device=st.device)
    d = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=st.device)
    if s.shape != d.shape or s.dim() != 1:
        raise BatchError(
            None, "block_tables", f"src {tuple(s.shape)} and dst {tuple(d.shape)}: need equal 1-D"
        )
    if s.numel() and (
        min(int(s.min()), int(d.min())) < 1 or max(int(s.max()), int(d.max())) >= st.num_blocks
    ):
        raise BatchError(None, "block_tables", f"block ids must be in [1, {st.num_blocks})")
    for t in (*st.kv.values(), *st.index_keys.values()):
        t[d] = t[s]


def encoder_rings(st: ExecutorState, slot: int) -> torch.Tensor:
    """A copy of the slot's encoder SWA rings, uint8 [encoder layers, ring, bytes]."""
    return torch.stack([st.swa[lid][slot].clone() for lid in range(st.cfg.encoder_layers)])


def seed_slot(st: ExecutorState, slot: int, pos: int, context: np.ndarray) -> None:
    """The slot now holds a prefix of ``pos`` tokens whose last tokens are ``context`` (Engram n-gram
    context), nothing in its decoder rings, and may not roll back below ``pos``."""
    ctx = (
        np.asarray(context, dtype=np.int64)[-min(len(context), st.tok_ring) :]
        if len(context)
        else np.zeros(0, np.int64)
    )
    p = np.arange(pos - ctx.shape[0], pos)
    st.tokens[slot] = -1
    st.tokens[slot, p % st.tok_ring] = ctx
    st.slot_end[slot] = pos
    st.encoder_only[slot] = True
    st.floor[slot, 1] = pos
    st.min_start[slot] = pos
    if st.spec is not None:
        st.spec.restart(slot)


def check_seed(st: ExecutorState, slot: int, pos: int, context: np.ndarray) -> None:
    if not 0 <= slot < st.num_slots:
        raise BatchError(None, "state_slots", f"{slot}: must be in [0, {st.num_slots})")
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 1:
        raise BatchError(None, "start_pos", f"{pos!r}: must be an int >= 1")
    ctx = np.asarray(context)
    if ctx.ndim != 1 or (ctx.size and (ctx.min() < 0 or ctx.max() >= st.cfg.vocab_size)):
        raise BatchError(None, "token_ids", f"context must be 1-D token ids in [0, {st.cfg.vocab_size})")
    if st.cfg.encoder_layers >= st.cfg.num_hidden_layers:
        raise BatchError(None, "encoder_only", "needs a model with a decoder (CED split)")


@torch.no_grad()
def restore_encoder(
    st: ExecutorState, slot: int, pos: int, rings: torch.Tensor | np.ndarray, context: np.ndarray
) -> None:
    """Put persisted encoder rings (from ``snapshots`` / :meth:`encoder_rings` at ``pos``) into ``slot``:
    it then holds an encoder-only prefix of ``pos`` tokens (continue with encoder_only steps or a step
    with decoder_floor = pos). ``context``: the tokens before ``pos`` (at least the n-gram order - 1)."""
    check_seed(st, slot, pos, context)
    r = torch.as_tensor(rings, device=st.device)
    want = (st.cfg.encoder_layers, st.swa_ring, st.fmt.swa.bytes_per_token)
    if r.dtype != torch.uint8 or tuple(r.shape) != want:
        raise BatchError(None, "rings", f"uint8 {tuple(r.shape)} {r.dtype}, expected uint8 {want}")
    for lid in range(want[0]):
        st.swa[lid][slot] = r[lid]
    seed_slot(st, slot, pos, context)
    st.floor[slot, 0] = max(0, pos - st.cfg.sliding_window + 1)


@torch.no_grad()
def replay_encoder(
    st: ExecutorState,
    slot: int,
    token_ids: np.ndarray,
    start: int,
    block_table: np.ndarray,
    context: np.ndarray,
) -> None:
    """Rebuild ``slot``'s encoder rings at ``start + len(token_ids)`` by running those tokens through the
    encoder with every window truncated to them (bounded replay of the encoder; exact when the span
    is the whole dependency span). Reads the cached block KV of ``block_table``, writes no block.
    ``context``: the tokens before ``start`` (Engram n-grams)."""
    toks = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    n = int(toks.shape[0])
    if n < 1:
        raise BatchError(None, "token_ids", "replay needs at least one token")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BatchError(None, "start_pos", f"{start!r}: must be an int >= 0")
    check_seed(st, slot, start + n, context)
    b = ForwardBatch(
        token_ids=toks,
        query_lens=[n],
        start_pos=[start],
        block_tables=np.asarray(block_table)[None],
        state_slots=[slot],
        num_logits=[0],
        encoder_only=True,
    )
    if toks.min() < 0 or toks.max() >= st.cfg.vocab_size:
        raise BatchError(0, "token_ids", f"values must be in [0, vocab_size={st.cfg.vocab_size})")
    if st.min_ratio and (
        b.block_tables.shape[1] < st.blocks_needed(start + n)
        or (b.block_tables[0, : st.blocks_needed(start + n)] <= 0).any()
    ):
        raise BatchError(
            0, "block_tables", f"needs {st.blocks_needed(start + n)} valid blocks for {start + n} tokens"
        )
    if start > 0:
        seed_slot(st, slot, start, context)
    st.floor[slot, 0] = start
    dev = st.device
    tokens, positions = torch.as_tensor(toks, device=dev), torch.as_tensor(b.positions, device=dev)
    attend, _ = step_attention(st, b, positions)  # the executor's prefill path
    rows = engram_rows(st, b, tokens)
    st.no_block_writes = True
    try:
        st.model.run_layers(
            tokens,
            attend,
            source_only=lambda lid, a, x: x,
            engram_rows=rows,
        )
    finally:
        st.no_block_writes = False
    seed_slot(st, slot, start + n, np.concatenate((np.asarray(context, np.int64), toks)))
