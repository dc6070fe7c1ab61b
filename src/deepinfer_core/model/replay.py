"""The executor's SWA bounded-replay side (``deepinfer_core.swa``): ring snapshots, restores, replays.

A mixin of :class:`~deepinfer_core.model.executor.ModelExecutor` (kept apart so the executor stays
readable): the per-slot floors and snapshot requests it reads are set up in ``ModelExecutor.__init__`` /
``execute``; ``_attend`` assembles in-chunk snapshots and ``_compress`` honours ``_no_block_writes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer_core.model.batch import BatchError, ForwardBatch


class ReplayMixin:
    """Restore / replay / snapshot of the encoder SWA rings, block copies (docs/swa.md)."""

    # provided by ModelExecutor
    cfg: Any
    fmt: Any
    device: torch.device
    num_slots: int
    num_blocks: int
    swa_ring: int
    tok_ring: int
    min_ratio: int
    swa: list[torch.Tensor]
    kv: dict[int, torch.Tensor]
    index_keys: dict[int, torch.Tensor]
    spec: Any
    model: Any
    _tokens: np.ndarray
    _slot_end: np.ndarray
    _encoder_only: np.ndarray
    _floor: np.ndarray
    _min_start: np.ndarray
    _no_block_writes: bool
    _snap_at: dict[int, int]
    _snaps: dict[int, list[torch.Tensor]]

    if TYPE_CHECKING:  # ModelExecutor's methods

        def blocks_needed(self, num_tokens: int) -> int: ...

        def _engram_rows(self, b: ForwardBatch, tokens: torch.Tensor) -> dict[int, torch.Tensor]: ...

        def _attend(self, lid: int, a: Any, x: torch.Tensor, positions: torch.Tensor, reqs: list,
                    sel: dict, pools: dict) -> torch.Tensor: ...

    def _take_snapshots(self, b: ForwardBatch) -> dict[int, torch.Tensor]:
        """The encoder rings at each requested snapshot position (captured in _attend for prefill
        steps; for row-path steps the rings after the step, which still hold [X - w + 1, X))."""
        e = self.cfg.encoder_layers
        out = {}
        for i in self._snap_at:
            got = self._snaps.get(i)
            if got is None or len(got) != e:
                got = [self.swa[lid][int(b.state_slots[i])].clone() for lid in range(e)]
            out[i] = torch.stack(got)
        self._snap_at, self._snaps = {}, {}
        return out

    @torch.no_grad()
    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks (main KV and indexer keys of every source layer): a prefix hit's cached
        blocks into a sequence's own blocks when they cannot be shared (docs/swa.md)."""
        s = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.device)
        d = torch.as_tensor(np.asarray(dst, dtype=np.int64), device=self.device)
        if s.shape != d.shape or s.dim() != 1:
            raise BatchError(None, "block_tables", f"src {tuple(s.shape)} and dst {tuple(d.shape)}: need equal 1-D")
        if s.numel() and (min(int(s.min()), int(d.min())) < 1 or max(int(s.max()), int(d.max())) >= self.num_blocks):
            raise BatchError(None, "block_tables", f"block ids must be in [1, {self.num_blocks})")
        for t in (*self.kv.values(), *self.index_keys.values()):
            t[d] = t[s]

    def encoder_rings(self, slot: int) -> torch.Tensor:
        """A copy of the slot's encoder SWA rings, uint8 [encoder layers, ring, bytes]."""
        return torch.stack([self.swa[lid][slot].clone() for lid in range(self.cfg.encoder_layers)])

    def _seed_slot(self, slot: int, pos: int, context: np.ndarray) -> None:
        """The slot now holds a prefix of ``pos`` tokens whose last tokens are ``context`` (Engram n-gram
        context), nothing in its decoder rings, and may not roll back below ``pos``."""
        ctx = np.asarray(context, dtype=np.int64)[-min(len(context), self.tok_ring):] if len(context) else np.zeros(0, np.int64)
        p = np.arange(pos - ctx.shape[0], pos)
        self._tokens[slot] = -1
        self._tokens[slot, p % self.tok_ring] = ctx
        self._slot_end[slot] = pos
        self._encoder_only[slot] = True
        self._floor[slot, 1] = pos
        self._min_start[slot] = pos
        if self.spec is not None:
            self.spec.restart(slot)

    def _check_seed(self, slot: int, pos: int, context: np.ndarray) -> None:
        if not 0 <= slot < self.num_slots:
            raise BatchError(None, "state_slots", f"{slot}: must be in [0, {self.num_slots})")
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 1:
            raise BatchError(None, "start_pos", f"{pos!r}: must be an int >= 1")
        ctx = np.asarray(context)
        if ctx.ndim != 1 or (ctx.size and (ctx.min() < 0 or ctx.max() >= self.cfg.vocab_size)):
            raise BatchError(None, "token_ids", f"context must be 1-D token ids in [0, {self.cfg.vocab_size})")
        if self.cfg.encoder_layers >= self.cfg.num_hidden_layers:
            raise BatchError(None, "encoder_only", "needs a model with a decoder (CED split)")

    @torch.no_grad()
    def restore_encoder(self, slot: int, pos: int, rings: torch.Tensor | np.ndarray, context: np.ndarray) -> None:
        """Put persisted encoder rings (from ``snapshots`` / :meth:`encoder_rings` at ``pos``) into ``slot``:
        it then holds an encoder-only prefix of ``pos`` tokens (continue with encoder_only steps or a step
        with decoder_floor = pos). ``context``: the tokens before ``pos`` (at least the n-gram order - 1)."""
        self._check_seed(slot, pos, context)
        r = torch.as_tensor(rings, device=self.device)
        want = (self.cfg.encoder_layers, self.swa_ring, self.fmt.swa.bytes_per_token)
        if r.dtype != torch.uint8 or tuple(r.shape) != want:
            raise BatchError(None, "rings", f"uint8 {tuple(r.shape)} {r.dtype}, expected uint8 {want}")
        for lid in range(want[0]):
            self.swa[lid][slot] = r[lid]
        self._seed_slot(slot, pos, context)
        self._floor[slot, 0] = max(0, pos - self.cfg.sliding_window + 1)

    @torch.no_grad()
    def replay_encoder(self, slot: int, token_ids: np.ndarray, start: int, block_table: np.ndarray,
                       context: np.ndarray) -> None:
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
        self._check_seed(slot, start + n, context)
        b = ForwardBatch(token_ids=toks, query_lens=[n], start_pos=[start], block_tables=np.asarray(block_table)[None],
                         state_slots=[slot], num_logits=[0], encoder_only=True)
        if toks.min() < 0 or toks.max() >= self.cfg.vocab_size:
            raise BatchError(0, "token_ids", f"values must be in [0, vocab_size={self.cfg.vocab_size})")
        if self.min_ratio and (b.block_tables.shape[1] < self.blocks_needed(start + n)
                               or (b.block_tables[0, : self.blocks_needed(start + n)] <= 0).any()):
            raise BatchError(0, "block_tables", f"needs {self.blocks_needed(start + n)} valid blocks for {start + n} tokens")
        if start > 0:
            self._seed_slot(slot, start, context)
        self._floor[slot, 0] = start
        dev = self.device
        tokens, positions = torch.as_tensor(toks, device=dev), torch.as_tensor(b.positions, device=dev)
        reqs = [(0, n, start, slot, torch.as_tensor(b.block_tables[0], dtype=torch.long, device=dev))]
        sel: dict = {}
        pools: dict = {}
        engram_rows = self._engram_rows(b, tokens)
        self._no_block_writes = True
        try:
            self.model.run_layers(tokens, lambda lid, a, x: self._attend(lid, a, x, positions, reqs, sel, pools),
                                  source_only=lambda lid, a, x: x, engram_rows=engram_rows)
        finally:
            self._no_block_writes = False
        self._seed_slot(slot, start + n, np.concatenate((np.asarray(context, np.int64), toks)))

