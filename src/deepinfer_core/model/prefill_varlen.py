"""The varlen prefill (``ModelExecutor`` with ``prefill_path="varlen"``): every request of a prefill step at
once, with a number of kernel launches per layer that does not grow with the number of requests.

The per-request paths (:mod:`~deepinfer_core.model.prefill`, "tiled" and "dense") run each layer's ring
writes, compression, indexer top-k and attention once per request: ~50-100 small ops per request and
layer, which on a GPU are launches the device waits for. Here the index arithmetic of the whole step is
done once on the host (:mod:`~deepinfer_core.model.prefill_plan`, one copy to the device) and each layer
runs a fixed sequence of batched ops over all of the step's rows:

- **window**: one gather of every request's ring history, one ring write of every request's last ``ring``
  rows, one gather + one scatter for the snapshots; the attention in query tiles that never cross a
  request (a request's last tile padded; tiles of min(tile, n) rows rounded up to a power of two, so at
  most log2(tile) + 1 buckets of tile sizes, whatever the requests), each tile's window keys gathered from
  ``cat(history, chunk keys)`` with the plan's masks, all tiles as one batched GEMM
  (:func:`~deepinfer_core.model.layers.window_attention.window_sink_attention`, the tiled path's maths);
- **compression**: one gather of the compressor rings' partial groups, one gather of every new entry's
  group, one pooling of all new entries, one store per cache;
- **indexer**: every request's entries dequantised with one gather (per source layer, shared by the
  layers that read it), then per piece of whole tiles one batched GEMM of each tile's queries against its
  own request's entries (padded to the piece's widest, masked), and one top-k;
- **compressed attention**: each row's top-k keys gathered from those dequantised entries.

Memory stays bounded as on the tiled path: the indexer scores and the attention run in pieces of whole
tiles (possibly from several requests) whose intermediates fit ``prefill_budget``; the number of pieces grows
with the step's rows, not with its requests. Every row's maths is the per-request paths' (float64 tests
hold the logits, caches and snapshots to 1e-9 of the tiled and dense paths): the selections are identical
(ids and validity over each request's width, candidate pools included; the widths past it are invalid),
only the summation order of GEMMs differs. In float32 / bf16 that order can flip a top-k choice at a
near-tie, as it can between the tiled and dense paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from deepinfer_core.model.attend import attend_layer
from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.attention import Attention
from deepinfer_core.model.layers.indexer import (
    index_scores,
    mask_scores,
    select_topk,
    select_topk_keyed,
)
from deepinfer_core.model.layers.window_attention import window_sink_attention, window_width
from deepinfer_core.model.prefill_plan import (
    ATTENTION_RANGE,
    INDEXER_RANGE,
    LAYER_RANGE,
    Compression,
    Entries,
    Piece,
    VarlenPlan,
)
from deepinfer_core.model.prefill_tiled import pick_scored, rows_per_piece
from deepinfer_core.model.state import ExecutorState

Selected = tuple[torch.Tensor, torch.Tensor]  # (ids [T * tile, k], valid [T * tile, k]) in the tile layout
POOL_KEY = "varlen"


class VarlenAttention:
    """One layer's attention for every request of a varlen prefill step (an ``attend.AttendPath``);
    ``rows``: the layer's products for all rows (``prefill.layer_rows``)."""

    keys: torch.Tensor  # cat(every request's ring history, the chunk's keys), set by write_window

    def __init__(
        self, st: ExecutorState, lid: int, a: Attention, plan: VarlenPlan, rows: dict[str, torch.Tensor]
    ) -> None:
        self.st, self.lid, self.a, self.plan, self.rows = st, lid, a, plan, rows
        self.cfg = st.cfg
        self.enc = lid < self.cfg.encoder_layers
        self.win = plan.windows[0 if self.enc else 1]
        self.ent = plan.entries.get(a.ratio)

    def write_window(self) -> None:
        st, p, rows = self.st, self.plan, self.rows
        ring = st.swa[self.lid]
        kswa = rows["kswa"]
        if self.win.n_hist:  # read before the writes below (a long chunk overwrites its history)
            self.keys = torch.cat((st.gather(ring, self.win.hist, "swa", self.cfg.head_dim), kswa))
        else:
            self.keys = kswa
        if p.snap_reqs and self.enc:
            self.snapshot(ring)
        raw, raw_bytes = rows["swa"], rows["swa_bytes"]
        if p.ring_keep is not None:
            raw, raw_bytes = raw[p.ring_keep], raw_bytes[p.ring_keep]
        st.ring_store(ring, raw, raw_bytes, p.ring_slot, p.ring_pos)

    def snapshot(self, ring: torch.Tensor) -> None:
        """The encoder ring of each snapshot request as it is at its position X: the ring before this
        step's writes with the chunk's bytes of positions [max(s, X - ring), X) put in."""
        p = self.plan
        assert p.snap_slots is not None and p.snap_dst is not None and p.snap_src is not None
        snap = ring[p.snap_slots]  # a copy
        snap.view(-1, snap.shape[-1])[p.snap_dst] = self.rows["swa_bytes"][p.snap_src]
        for j, i in enumerate(p.snap_reqs):
            self.st.snaps.setdefault(i, []).append(snap[j])

    def attend_window(self) -> torch.Tensor:
        return self.attend(None)

    def compress(self) -> None:
        assert self.ent is not None
        compress_rows(self.st, self.ent.comp, self.lid, self.a, self.rows["cstate"])

    def select(self) -> None:
        st, cfg, ent, p = self.st, self.cfg, self.ent, self.plan
        src = cfg.kv_source_of(self.lid)
        assert ent is not None and src is not None
        with record_function(INDEXER_RANGE):
            ik = p.once(
                ("index", src), lambda: _entry_keys(st, st.index_keys[src], ent, "index", cfg.index_head_dim)
            )
            p.sel[self.lid] = select_tiles(
                cfg, self.lid, self.rows["qi"], self.rows["wi"], ik, ent, p, score_op=st.index_score_op()
            )

    def attend_compressed(self) -> torch.Tensor:
        st, cfg, ent, p = self.st, self.cfg, self.ent, self.plan
        src, isrc = cfg.kv_source_of(self.lid), cfg.index_source_of(self.lid)
        assert ent is not None and src is not None and isrc is not None
        assert cfg.ratio(isrc) == self.a.ratio  # config validation: an index source is in its layer's group
        ids, valid = p.sel[isrc]
        if ids.shape[1] == 0:  # no request has an entry yet
            return self.attend(None)
        # ids count each request's own entries: offset them into the concatenation (masked ones clamped)
        gid = p.once(("gid", isrc), lambda: (ids + ent.first_row[:, None]).clamp_(max=ent.total - 1))
        keys = p.once(("main", src), lambda: _entry_keys(st, st.kv[src], ent, "main", cfg.head_dim))
        return self.attend((keys, gid, valid))

    def attend(self, compressed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The window (+ the compressed keys: (entry keys [E, d], global ids and validity [tile rows, k]))
        attention of every row, bucket by bucket in pieces of whole tiles: [N, H, d]."""
        p = self.plan
        h, d = self.rows["q"].shape[1:]
        with record_function(ATTENTION_RANGE):
            outs = [
                o.view(-1, h, d) for i in range(len(p.buckets)) for o in self.attend_bucket(i, compressed)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            return out if p.identity else out[p.out_slot]

    def attend_bucket(
        self, i: int, compressed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ) -> list[torch.Tensor]:
        st, p, a, t = self.st, self.plan, self.a, self.plan.buckets[i]
        q = self.rows["q"]
        _, h, d = q.shape
        k = 0 if compressed is None else compressed[1].shape[1]
        width = window_width(t.tile, self.cfg.sliding_window)
        per_row = q.element_size() * (4 * h * (width + k + 1) + 2 * k * d)  # the tiled path's estimate
        step = rows_per_piece(per_row, st.prefill_budget, t.tile) // t.tile
        outs = []
        for ta in range(0, t.count, step):
            tb = min(t.count, ta + step)
            r0, r1 = t.base + ta * t.tile, t.base + tb * t.tile
            kb = vb = None
            if compressed is not None:
                keys, gid, valid = compressed
                kb = keys[gid[r0:r1]].view(tb - ta, t.tile, k, d)
                vb = valid[r0:r1].view(tb - ta, t.tile, k)
            kw = self.keys[self.win.idx[i][ta:tb]]
            qt = p.tile_rows_of(q, i, ta, tb)
            outs.append(window_sink_attention(qt, kw, self.win.mask[i][ta:tb], kb, vb, a.attn_sink, a.scale))
        return outs


def _entry_keys(st: ExecutorState, pool: torch.Tensor, ent: Entries, kind: str, dim: int) -> torch.Tensor:
    """Every request's entries of a source layer's cache, dequantised once: [E, dim] (the codec is per
    entry, so these are the values a per-row gather would give)."""
    if ent.total == 0:
        return torch.zeros(0, dim, dtype=st.dtype, device=st.device)
    return st.gather(pool, ent.slots, kind, dim)


def compress_rows(st: ExecutorState, c: Compression, lid: int, a: Attention, state: torch.Tensor) -> None:
    """Pool the groups the step completes (every request) into the paged caches of source layer ``lid``
    and keep each request's newest per-token states in its compressor ring. ``state``: the compressor
    state of every row [N, width] (``compressor.project`` then ``index_compressor.project``)."""
    if c.old is not None:
        assert c.ring_put is not None and c.ring_rows is not None
        flat = st.comp_state[lid].view(-1, state.shape[-1])
        buf = torch.cat((flat[c.old], state))  # the partial groups' states, read before the ring writes
        flat[c.ring_put] = state[c.ring_rows]
    else:
        buf = state
    if c.n_new == 0 or st.no_block_writes:  # a replay: these entries are in the (shared) cached blocks
        return
    groups = buf[c.group]  # [C, r, width]
    dm = a.compressor.state_dim
    st.store(st.kv[lid], a.compressor.pool_groups(groups[..., :dm], c.entry, a.inv_freq), c.put, "main")
    st.store(
        st.index_keys[lid],
        a.index_compressor.pool_groups(groups[..., dm:], c.entry, a.inv_freq),
        c.put,
        "index",
    )


@fusable
def tile_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Indexer scores [T * t, E] of tiles of queries q [T, t, heads, d] with head weights w [T, t, heads]
    against each tile's own keys [T, E, d]: ``index_scores`` per tile, as two batched GEMMs."""
    n_t, t, h, d = q.shape
    lg = torch.relu(torch.matmul(q.reshape(n_t, t * h, d), keys.transpose(1, 2)))  # [T, t * h, E]
    return torch.matmul(w.reshape(n_t * t, 1, h), lg.view(n_t * t, h, -1)).view(n_t * t, -1)


def select_tiles(
    cfg: ModelConfig,
    lid: int,
    qi: torch.Tensor,
    wi: torch.Tensor,
    ik: torch.Tensor,
    ent: Entries,
    plan: VarlenPlan,
    keyed: bool = True,
    score_op: Callable[..., torch.Tensor] | None = None,
) -> Selected:
    """Layer ``lid``'s top-k entries of every row of the step, in the tile layout: (ids [T * tile, k], valid),
    ids counting each row's own request's entries. qi [N, heads, d] / wi [N, heads]: the rows' indexer
    queries and weights; ik [E, d]: every request's index keys (``ent``'s concatenation). Per request, the
    first min(index_topk, e_i) columns equal ``pick_entries`` over that request's whole [n_i, e_i] score
    matrix (ids, validity, the candidate pool it stores in ``plan.pools``); later columns are invalid."""
    make_pool = lid == cfg.candidate_source_layer_id
    candidates = plan.pools[POOL_KEY] if cfg.uses_candidates(lid) else None
    sel = select_topk_keyed if keyed else select_topk
    parts = [
        _select_piece(cfg, qi, wi, ik, ent, plan, candidates, make_pool, sel, score_op, pc)
        for pc in ent.pieces
    ]
    if make_pool:
        plan.pools[POOL_KEY] = torch.cat([pool for _, _, pool in parts if pool is not None])
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    return torch.cat([ids for ids, _, _ in parts]), torch.cat([valid for _, valid, _ in parts])


def _select_piece(
    cfg: ModelConfig,
    qi: torch.Tensor,
    wi: torch.Tensor,
    ik: torch.Tensor,
    ent: Entries,
    plan: VarlenPlan,
    candidates: torch.Tensor | None,
    make_pool: bool,
    sel: Callable[[torch.Tensor, int], Selected],
    score_op: Callable[..., torch.Tensor] | None,
    piece: Piece,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tiles ta .. tb - 1 of :func:`select_tiles`: (ids, valid, their candidate pool [rows, width] when
    ``make_pool``), each row scoring the ``e_p`` entries the piece's rows can see at most."""
    i, ta, tb, e_p, lo, hi, one = piece
    t = plan.buckets[i]
    r0, r1 = t.base + ta * t.tile, t.base + tb * t.tile
    m, dev = r1 - r0, qi.device
    vis = ent.vis[r0:r1]
    if e_p == 0:  # no entry visible yet: the stable sort lists the masked entries in index order
        pool = torch.zeros(m, ent.width, dtype=torch.bool, device=dev) if make_pool else None
        return ent.arange[: ent.k].expand(m, -1), torch.zeros(m, ent.k, dtype=torch.bool, device=dev), pool
    ar = ent.arange[:e_p]
    q_t, w_t = plan.tile_rows_of(qi, i, ta, tb), plan.tile_rows_of(wi, i, ta, tb)
    if score_op is not None:  # the backend's op over one key range of the concatenation, then each row's
        start = ent.first_row[r0:r1] - lo
        full = score_op(q_t.flatten(0, 1), w_t.flatten(0, 1), ik[lo:hi], start, start + vis)
        sc = full.gather(1, (start[:, None] + ar[None, :]).clamp_(max=hi - lo - 1))  # own columns
    elif one:  # one request's tiles: its entries are one slice of keys for every row (no gather)
        sc = index_scores(q_t.flatten(0, 1), w_t.flatten(0, 1), ik[lo : lo + e_p])
    else:
        # each tile's own request's entries 0 .. e_p - 1 (past its last one: clamped, masked below)
        kidx = torch.minimum(ar[None, :], ent.last[i][ta:tb, None]) + ent.first[i][ta:tb, None]
        sc = tile_scores(q_t, w_t, ik[kidx])
    sc = mask_scores(sc, ar[None, :] < vis[:, None])
    cand = None if candidates is None else candidates[r0:r1, :e_p]
    return pick_scored(cfg, sc, vis, cand, make_pool, sel, ent.arange, ent.width, ent.k)


def varlen_attend(
    st: ExecutorState, plan: VarlenPlan, rows_of: Callable[[Attention, torch.Tensor], dict[str, torch.Tensor]]
) -> Callable[[int, Attention, torch.Tensor], torch.Tensor]:
    """The step's ``attend`` (``model.run_layers``): ``rows_of(a, x)`` gives a layer's products."""

    def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        with record_function(LAYER_RANGE):
            return attend_layer(a.kind, VarlenAttention(st, lid, a, plan, rows_of(a, x)))

    return attend


def varlen_source(st: ExecutorState, plan: VarlenPlan) -> Callable[[int, Attention, torch.Tensor], Any]:
    """An encoder-only step's ``source_only``: the first decoder layer's compressed KV of every request."""

    def source(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        cstate = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
        compress_rows(st, plan.entries[a.ratio].comp, lid, a, cstate)
        return x

    return source
