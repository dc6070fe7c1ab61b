"""The prefill's attention maths in bounded pieces (``ModelExecutor`` with ``prefill_path="tiled"``).

The plain per-request path materialises, for a chunk of n tokens, the window logits of every query
against every chunk key ([n, H, n]), the indexer's per-head scores of every query against every
compressed entry ([n, index_heads, E]) and a full sort of [n, E], and gathers the top-k compressed keys of
all n rows at once ([n, top-k, d]). Here:

- the window attention runs in query tiles (:mod:`~deepinfer_core.model.layers.window_attention`);
- rows are processed in pieces whose intermediates fit a memory ``budget`` (bytes): indexer scores,
  masks, the candidate pool and the top-k of one piece of rows at a time, then the attention of one piece
  at a time with only that piece's compressed keys gathered;
- a piece of indexer rows scores only the entries its last row can see ((s + c1) // ratio: the causal
  half of the matrix is never computed), and its selection is padded to the dense width exactly as the
  stable sort over all E entries orders it (masked entries follow in index order), so ids and validity
  equal :func:`~deepinfer_core.model.layers.indexer.pick_entries` on the whole matrix;
- ``keyed`` picks the top-k with ``torch.topk`` over distinct int64 keys
  (:func:`~deepinfer_core.model.layers.indexer.select_topk_keyed`, identical to the stable sort).

Every row's maths is the dense path's; only the summation order of GEMMs differs (float64 tests hold it to
1e-9 of the dense path and of ``DeepSeekV41.forward_full``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from torch.profiler import record_function

from deepinfer_core.device_tokens import TokenFeed
from deepinfer_core.model.attend import attend_layer
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, ModelConfig
from deepinfer_core.model.engram_context import engram_rows
from deepinfer_core.model.fusion import fused_glue
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import (
    candidate_pool,
    index_scores,
    mask_scores,
    pick_entries,
    select_topk,
    select_topk_keyed,
)
from deepinfer_core.model.layers.window_attention import window_attention, window_width
from deepinfer_core.model.model import AttendFn
from deepinfer_core.model.state import DEFAULT_BUDGET, DEFAULT_TILE, ExecutorState, last_rows

# profiler ranges around the prefill's attention and indexer work (benchmarks/model_cuda.py splits the GPU
# time by them); a record_function outside a profiler costs about a microsecond
ATTENTION_RANGE = "prefill.attention"
INDEXER_RANGE = "prefill.indexer"
__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_TILE",
    "attend_prefill",
    "attend_request",
    "execute_requests",
    "select_entries",
]


def rows_per_piece(per_row_bytes: int, budget: int, multiple: int = 1) -> int:
    """Rows whose intermediates fit ``budget`` (at least ``multiple``, and a multiple of it)."""
    rows = max(1, budget // max(1, per_row_bytes))
    return max(multiple, rows // multiple * multiple)


def select_entries(
    cfg: ModelConfig,
    lid: int,
    qi: torch.Tensor,
    wi: torch.Tensor,
    ik: torch.Tensor,
    s: int,
    ratio: int,
    pools: dict,
    key: Any,
    budget: int = DEFAULT_BUDGET,
    keyed: bool = True,
    score_op: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``lid``'s top-k compressed entries for one request's rows: (ids [n, k'], valid [n, k']).

    qi [n, heads, d] / wi [n, heads]: the indexer queries and head weights of rows at positions
    s .. s + n - 1; ik [E, d]: the request's visible index keys (E = (s + n) // ratio). Equal to
    ``pick_entries(cfg, lid, mask_scores(index_scores(qi, wi, ik), ent < visible), visible, pools, key)``,
    including the candidate pool it stores at ``pools[key]`` (the candidate source layer) and reads (a
    layer that uses candidates), with rows scored ``budget`` bytes at a time.

    ``score_op``: a backend's ``indexer_scores`` (q, weights, keys, key_start, key_end) -> float32 masked
    scores, e.g. the cuda backend's TileLang kernel (one GEMM per query and key block, relu and the head
    sum in registers: no [rows, heads, E] intermediate, fp32 accumulation); None: ``index_scores`` in the
    model's dtype. The selection rules after the scores are the same either way.
    """
    n, heads, _ = qi.shape
    e_all = ik.shape[0]
    k_out = min(cfg.index_topk, e_all)
    dev = qi.device
    es = 4 if score_op is not None else qi.element_size()  # the op's scores (and its torch fallback) are fp32
    # per row: the [heads, E] products and their relu, then the [E] scores, mask, pool and sort keys
    rows = rows_per_piece(e_all * (2 * heads * es + 4 * es + 3 * 8), budget)
    restrict, make_pool = cfg.uses_candidates(lid), lid == cfg.candidate_source_layer_id
    sel = select_topk_keyed if keyed else select_topk
    ent = torch.arange(e_all, device=dev)
    ids_l, valid_l, pool_l = [], [], []
    for c0 in range(0, n, rows):
        c1 = min(n, c0 + rows)
        e_c = min(e_all, (s + c1) // ratio)  # the piece's last row sees the most entries
        vis = (s + c0 + 1 + torch.arange(c1 - c0, device=dev)) // ratio
        if e_c == 0:  # no entry visible yet: the dense sort lists the masked entries in index order
            ids_l.append(ent[:k_out].expand(c1 - c0, -1))
            valid_l.append(torch.zeros(c1 - c0, k_out, dtype=torch.bool, device=dev))
            if make_pool:
                pool_l.append(torch.zeros(c1 - c0, e_all, dtype=torch.bool, device=dev))
            continue
        if score_op is None:
            sc = mask_scores(index_scores(qi[c0:c1], wi[c0:c1], ik[:e_c]), ent[None, :e_c] < vis[:, None])
        else:
            sc = score_op(qi[c0:c1], wi[c0:c1], ik[:e_c], torch.zeros_like(vis), vis)
        if restrict:
            sc = mask_scores(sc, pools[key][c0:c1, :e_c])
        if make_pool:
            pool = candidate_pool(sc, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            pool_l.append(torch.cat((pool, pool.new_zeros(c1 - c0, e_all - e_c)), 1))
        ids, valid = sel(sc, cfg.index_topk)
        if ids.shape[1] < k_out:
            # entries e_c .. E - 1 are masked for these rows; the stable sort puts them after the piece's
            # own masked entries, in index order
            tail = ent[e_c : e_c + k_out - ids.shape[1]].expand(c1 - c0, -1)
            ids = torch.cat((ids, tail), 1)
            valid = torch.cat((valid, torch.zeros_like(tail, dtype=torch.bool)), 1)
        ids_l.append(ids)
        valid_l.append(valid)
    if make_pool:
        pools[key] = torch.cat(pool_l)
    return torch.cat(ids_l), torch.cat(valid_l)


def attend_request(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_pos0: int,
    s: int,
    window: int,
    floor: int,
    sink: torch.Tensor,
    scale: float,
    compressed: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    n_compressed: int = 0,
    tile: int = DEFAULT_TILE,
    budget: int = DEFAULT_BUDGET,
) -> torch.Tensor:
    """One request's attention, rows at positions s .. s + n - 1: the window over ``keys`` [K, d] (positions
    key_pos0 + arange(K), visible from ``floor``) and, when ``compressed`` is given, each row's
    ``n_compressed`` compressed keys, gathered a piece at a time by ``compressed(r0, r1)`` ->
    (keys [r1 - r0, B, d], valid [r1 - r0, B])."""
    n, h, d = q.shape
    es = q.element_size()
    width = window_width(tile, window)
    # per row: logits, masked logits, their concatenation with the sink, the softmax; the gathered keys
    per_row = es * (4 * h * (width + n_compressed + 1) + 2 * n_compressed * d)
    rows = rows_per_piece(per_row, budget, tile)
    outs = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        kb, vb = compressed(r0, r1) if compressed is not None else (None, None)
        outs.append(
            window_attention(q[r0:r1], keys, key_pos0, s + r0, window, floor, sink, scale, kb, vb, tile)
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# (first row, end row, start position, state slot, block table)
Request = tuple[int, int, int, int, torch.Tensor]


class RequestAttention:
    """One layer's attention for one request of a prefill step (an ``attend.AttendPath``): queries, window
    keys from the ring history + the chunk, ring writes and snapshots, compression, the indexer's selection
    and the attention; ``tiled`` picks this module's tiled maths or the dense path's (``sink_attention``
    over dense masks, ``pick_entries`` on whole matrices). ``rows``: the layer's products for all of the
    step's rows (:func:`layer_rows`)."""

    # the window's keys: ring history then the chunk's (set by write_window, which runs first)
    keys_a: torch.Tensor
    mask_a: torch.Tensor  # the dense path's window mask (idem)

    def __init__(
        self,
        st: ExecutorState,
        lid: int,
        a: Attention,
        i: int,
        req: Request,
        positions: torch.Tensor,
        rows: dict[str, torch.Tensor],
        sel: dict,
        pools: dict,
        tiled: bool,
    ) -> None:
        self.st, self.lid, self.a, self.i, self.rows, self.sel, self.pools, self.tiled = (
            st,
            lid,
            a,
            i,
            rows,
            sel,
            pools,
            tiled,
        )
        self.cfg = st.cfg
        self.r0, self.r1, self.s, self.slot, self.table = req
        self.n = self.r1 - self.r0
        self.qp = positions[self.r0 : self.r1]
        self.q = rows["q"][self.r0 : self.r1]
        self.src = self.cfg.kv_source_of(lid)
        self.floor = int(st.floor[self.slot, int(lid >= self.cfg.encoder_layers)])
        # the first history position the ring can serve
        self.h0 = max(0, self.s - (self.cfg.sliding_window - 1), min(self.floor, self.s))

    def write_window(self) -> None:
        st, cfg, r0, r1, s, slot = self.st, self.cfg, self.r0, self.r1, self.s, self.slot
        w = cfg.sliding_window
        ring = st.swa[self.lid]
        hist = torch.arange(self.h0, s, device=st.device)
        k_hist = st.fmt.swa.dequantize(ring[slot, hist % st.swa_ring]).to(st.dtype)
        self.keys_a = torch.cat((k_hist, self.rows["kswa"][r0:r1]))
        if not self.tiled:
            kp, qp = torch.cat((hist, self.qp)), self.qp
            self.mask_a = (
                (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - w) & (kp[None, :] >= self.floor)
            )
        swa_bytes = self.rows["swa_bytes"][r0:r1]
        if self.i in st.snap_at and self.lid < cfg.encoder_layers:  # the ring as it is at position X
            x_at = st.snap_at[self.i]
            snap = ring[slot].clone()
            sp = torch.arange(max(s, x_at - st.swa_ring), x_at, device=st.device)
            snap[sp % st.swa_ring] = swa_bytes[sp - s]
            st.snaps.setdefault(self.i, []).append(snap)
        keep = slice(max(0, self.n - st.swa_ring), self.n)
        st.ring_store(
            ring,
            self.rows["swa"][r0:r1][keep],
            swa_bytes[keep],
            torch.full_like(self.qp[keep], slot),
            self.qp[keep],
        )

    def attend(
        self,
        compressed: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        n_compressed: int = 0,
    ) -> torch.Tensor:
        a, st = self.a, self.st
        with record_function(ATTENTION_RANGE):
            if self.tiled:
                return attend_request(
                    self.q,
                    self.keys_a,
                    self.h0,
                    self.s,
                    self.cfg.sliding_window,
                    self.floor,
                    a.attn_sink,
                    a.scale,
                    compressed,
                    n_compressed,
                    st.prefill_tile,
                    st.prefill_budget,
                )
            kb, valid = compressed(0, self.n) if compressed is not None else (None, None)
            return sink_attention(self.q, self.keys_a, self.mask_a, kb, valid, a.attn_sink, a.scale)

    def attend_window(self) -> torch.Tensor:
        return self.attend()

    def compress(self) -> None:
        compress(
            self.st,
            self.lid,
            self.a,
            self.rows["cstate"][self.r0 : self.r1],
            self.s,
            self.n,
            self.slot,
            self.table,
        )

    def select(self) -> None:
        st, cfg, a, r0, r1, src = self.st, self.cfg, self.a, self.r0, self.r1, self.src
        assert src is not None
        e_total = (self.s + self.n) // a.ratio
        with record_function(INDEXER_RANGE):
            ent = torch.arange(e_total, device=st.device)
            flat = st.index_keys[src].view(-1, st.fmt.index.bytes_per_token)
            ik = st.fmt.index.dequantize(flat[st.entry_slots(self.table, ent, a.ratio)]).to(st.dtype)
            qi, wi = self.rows["qi"][r0:r1], self.rows["wi"][r0:r1]
            if self.tiled:
                self.sel[(self.lid, self.i)] = select_entries(
                    cfg,
                    self.lid,
                    qi,
                    wi,
                    ik,
                    self.s,
                    a.ratio,
                    self.pools,
                    self.i,
                    st.prefill_budget,
                    score_op=st.index_score_op(),
                )
            else:
                visible = (self.qp + 1) // a.ratio
                sc = mask_scores(index_scores(qi, wi, ik), ent[None, :] < visible[:, None])
                self.sel[(self.lid, self.i)] = pick_entries(cfg, self.lid, sc, visible, self.pools, self.i)

    def attend_compressed(self) -> torch.Tensor:
        st, cfg, a, src = self.st, self.cfg, self.a, self.src
        assert src is not None
        isrc = cfg.index_source_of(self.lid)
        assert isrc is not None
        ids, valid = self.sel[(isrc, self.i)]
        flat = st.kv[src].view(-1, st.fmt.main.bytes_per_token)
        gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
        if self.tiled and cfg.ratio(isrc) == a.ratio:  # ids index this layer's entries
            # dequantise the request's entries once, then gather rows of keys: the same values as
            # dequantising each gathered row (the codec is per entry), ~512x fewer codec passes at top-k 512
            e_total = (self.s + self.n) // a.ratio
            slots = st.entry_slots(self.table, torch.arange(e_total, device=st.device), a.ratio)
            table_keys = st.fmt.main.dequantize(flat[slots]).to(st.dtype)
            gather = functools.partial(_pick_keys, table_keys, ids, valid)
        else:
            gather = functools.partial(_gather_compressed, st, flat, self.table, ids, valid, a.ratio)
        return self.attend(gather, ids.shape[1])


def layer_rows(
    st: ExecutorState, a: Attention, x: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A layer's products for all rows of a prefill step: queries and their latent, the SWA keys (raw, as
    ring bytes, and as the ring will read them back), the compressor state (Full) and the indexer's
    queries and weights (Full / Reindex)."""
    q, lat = a.queries(x, positions)
    raw_swa = a.swa_kv(x, positions)
    swa_bytes = st.fmt.swa.quantize(raw_swa)
    rows = {
        "q": q,
        "swa": raw_swa,
        "swa_bytes": swa_bytes,
        "kswa": st.fmt.swa.dequantize(swa_bytes).to(st.dtype),
    }  # attend to exactly what the ring will hold
    if a.kind == LAYER_FULL:
        rows["cstate"] = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
    if a.kind in (LAYER_FULL, LAYER_REINDEX):
        rows["qi"], rows["wi"] = a.indexer(x, lat, positions, a.inv_freq)
    return rows


def attend_requests(
    st: ExecutorState,
    lid: int,
    a: Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    reqs: list[Request],
    sel: dict,
    pools: dict,
    tiled: bool,
) -> torch.Tensor:
    """Layer ``lid``'s attention for the prefill requests ``reqs`` of a step, request by request."""
    rows = layer_rows(st, a, x, positions)
    return torch.cat(
        [
            attend_layer(a.kind, RequestAttention(st, lid, a, i, req, positions, rows, sel, pools, tiled))
            for i, req in enumerate(reqs)
        ]
    )


def attend_prefill(
    st: ExecutorState,
    lid: int,
    a: Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    reqs: list[Request],
    sel: dict,
    pools: dict,
) -> torch.Tensor:
    """The per-request path's ``attend`` (``prefill_path``: "tiled", or "dense": every query against every
    chunk key through a dense mask, the oracle of the tiled path's tests and the benchmark's baseline)."""
    if st.prefill_path not in ("tiled", "dense"):
        raise ValueError(f"prefill_path={st.prefill_path!r}: must be 'tiled' or 'dense'")
    tiled = st.prefill_path == "tiled"
    # the tiled path's small functions run compiled under fuse_glue, as the decode glue does
    with fused_glue(st.fuse_glue and tiled):
        return attend_requests(st, lid, a, x, positions, reqs, sel, pools, tiled)


def compress(
    st: ExecutorState,
    lid: int,
    a: Attention,
    new_state: torch.Tensor,
    s: int,
    n: int,
    slot: int,
    table: torch.Tensor,
) -> None:
    """Pool the groups a chunk completes into the paged caches; keep the newest per-token state."""
    r = a.ratio
    dm = a.compressor.state_dim
    e0, e1 = s // r, (s + n) // r
    if r > 1:
        ring, cring = st.comp_state[lid], st.comp_ring[lid]
        g0 = e0 * r  # first token of the group that is partial at s
        old = ring[slot, torch.arange(g0, s, device=st.device) % cring]
        state = torch.cat((old, new_state))  # per-token state of positions [g0, s + n)
        keep = slice(max(0, n - cring), n)
        pos = torch.arange(s, s + n, device=st.device)
        ring[slot, pos[keep] % cring] = new_state[keep]
    else:
        state = new_state
    if e1 == e0 or st.no_block_writes:  # a replay: these entries are in the (shared) cached blocks already
        return
    whole = state[: (e1 - e0) * r]
    main = a.compressor.pool(whole[:, :dm], e0, a.inv_freq)
    idx = a.index_compressor.pool(whole[:, dm:], e0, a.inv_freq)
    slots = st.entry_slots(table, torch.arange(e0, e1, device=st.device), r)
    st.store(st.kv[lid], main, slots, "main")
    st.store(st.index_keys[lid], idx, slots, "index")


def execute_requests(st: ExecutorState, b: ForwardBatch, feed: TokenFeed | None = None) -> ForwardOutput:
    """A validated step on the per-request path (prefill chunks, encoder-only steps, the row path off)."""
    dev = st.device
    tokens = torch.as_tensor(b.token_ids, device=dev)
    if feed is not None:
        # a copy: on the CPU as_tensor shares the host array, which must keep its placeholders
        tokens = tokens.clone()
        feed.apply(tokens)
    positions = torch.as_tensor(b.positions, device=dev)
    off = b.offsets.tolist()
    reqs = [
        (
            off[i],
            off[i + 1],
            int(b.start_pos[i]),
            int(b.state_slots[i]),
            torch.as_tensor(b.block_tables[i], dtype=torch.long, device=dev),
        )
        for i in range(b.num_requests)
    ]
    sel: dict = {}
    pools: dict = {}
    rows = engram_rows(st, b, tokens, feed)

    def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        return attend_prefill(st, lid, a, x, positions, reqs, sel, pools)

    if b.encoder_only:
        return _encoder_only(st, b, tokens, attend, reqs, rows)
    targets = () if st.spec is None else st.spec.drafter.target_layers
    # run_layers fills a state for every key it is given
    capture = cast(dict[int, torch.Tensor], dict.fromkeys((*b.capture_layers, *targets)))
    hidden, counts = st.model.run_layers(tokens, attend, capture=capture, engram_rows=rows)
    logit_rows = b.logit_rows()
    rows_t = torch.as_tensor(logit_rows, device=dev)
    logits = st.model.logits(hidden[rows_t])
    st.slot_end[b.state_slots] = b.start_pos + b.query_lens
    st.encoder_only[b.state_slots] = False
    spec_out = None
    if st.spec is not None:
        slots_rows = torch.as_tensor(np.repeat(b.state_slots, b.query_lens), device=dev)
        keep = torch.as_tensor(last_rows(b, st.swa_ring), device=dev)
        st.spec.write_context([capture[lid] for lid in targets], positions, slots_rows, keep)
        spec_out = st.spec.step(b, logits)
    return ForwardOutput(
        logits=logits,
        logit_rows=logit_rows,
        request_of_logit=np.repeat(np.arange(b.num_requests), b.num_logits),
        expert_counts=counts,
        captured={lid: capture[lid][rows_t] for lid in b.capture_layers},
        snapshots=st.take_snapshots(b),
        **(spec_out or {}),
    )


def _encoder_only(
    st: ExecutorState,
    b: ForwardBatch,
    tokens: torch.Tensor,
    attend: AttendFn,
    reqs: list[Request],
    rows: dict[int, torch.Tensor],
) -> ForwardOutput:
    """An encoder-only step (CED prefix prefill): the encoder layers, then the first decoder layer's global
    KV written from its input (``source_only``); no logits."""

    def source(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        cstate = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
        for r0, r1, s, slot, table in reqs:
            compress(st, lid, a, cstate[r0:r1], s, r1 - r0, slot, table)
        return x

    _, counts = st.model.run_layers(tokens, attend, source_only=source, engram_rows=rows)
    st.slot_end[b.state_slots] = b.start_pos + b.query_lens
    st.encoder_only[b.state_slots] = True
    empty = np.zeros(0, np.int64)
    return ForwardOutput(
        logits=torch.zeros(0, st.cfg.vocab_size, dtype=st.dtype, device=st.device),
        logit_rows=empty,
        request_of_logit=empty,
        expert_counts=counts,
        snapshots=st.take_snapshots(b),
    )


def _gather_compressed(
    st: ExecutorState,
    flat: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    ratio: int,
    g0: int,
    g1: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys [g1 - g0, k, d] of one request's rows g0 .. g1 - 1 (their ``ids`` picked
    from the paged cache ``flat`` through ``table``) and their validity."""
    kb = st.fmt.main.dequantize(flat[st.entry_slots(table, ids[g0:g1].reshape(-1), ratio)]).to(st.dtype)
    return kb.view(g1 - g0, ids.shape[1], kb.shape[-1]), valid[g0:g1]


def _pick_keys(
    keys: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, g0: int, g1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows g0 .. g1 - 1 of a request's top-k compressed keys [g1 - g0, k, d] from its dequantised
    entries ``keys`` [E, d], and their validity."""
    return keys[ids[g0:g1]], valid[g0:g1]
