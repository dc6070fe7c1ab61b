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
from typing import Any

import torch
from torch.profiler import record_function

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA
from deepinfer_core.model.layers.attention import sink_attention
from deepinfer_core.model.layers.indexer import (
    candidate_pool,
    index_scores,
    mask_scores,
    pick_entries,
    select_topk,
    select_topk_keyed,
)
from deepinfer_core.model.layers.window_attention import window_attention, window_width

# profiler ranges around the prefill's attention and indexer work (benchmarks/model_cuda.py splits the GPU
# time by them); a record_function outside a profiler costs about a microsecond
ATTENTION_RANGE = "prefill.attention"
INDEXER_RANGE = "prefill.indexer"
DEFAULT_BUDGET = 512 << 20  # bytes of intermediates per piece of rows (the dense path: ~n^2 * H * 8)
DEFAULT_TILE = 64  # query rows per window tile: window + 63 keys per tile (1.5x the window at w = 128)


def rows_per_piece(per_row_bytes: int, budget: int, multiple: int = 1) -> int:
    """Rows whose intermediates fit ``budget`` (at least ``multiple``, and a multiple of it)."""
    rows = max(1, budget // max(1, per_row_bytes))
    return max(multiple, rows // multiple * multiple)


def select_entries(cfg: Any, lid: int, qi: torch.Tensor, wi: torch.Tensor, ik: torch.Tensor, s: int, ratio: int,
                   pools: dict, key: Any, budget: int = DEFAULT_BUDGET, keyed: bool = True,
                   score_op: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
            tail = ent[e_c: e_c + k_out - ids.shape[1]].expand(c1 - c0, -1)
            ids = torch.cat((ids, tail), 1)
            valid = torch.cat((valid, torch.zeros_like(tail, dtype=torch.bool)), 1)
        ids_l.append(ids)
        valid_l.append(valid)
    if make_pool:
        pools[key] = torch.cat(pool_l)
    return torch.cat(ids_l), torch.cat(valid_l)


def attend_request(q: torch.Tensor, keys: torch.Tensor, key_pos0: int, s: int, window: int, floor: int,
                   sink: torch.Tensor, scale: float, compressed: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   n_compressed: int = 0, tile: int = DEFAULT_TILE, budget: int = DEFAULT_BUDGET) -> torch.Tensor:
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
        outs.append(window_attention(q[r0:r1], keys, key_pos0, s + r0, window, floor, sink, scale, kb, vb, tile))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_requests(ex: Any, lid: int, a: Any, x: torch.Tensor, positions: torch.Tensor, reqs: list, sel: dict,
                    pools: dict, tiled: bool) -> torch.Tensor:
    """Layer ``lid``'s attention for the prefill requests ``reqs`` of a step (``ModelExecutor._attend``):
    queries, window keys from the ring history + the chunk, ring writes and snapshots, compression,
    the indexer's selection and the attention, per request; ``tiled`` picks the tiled maths (this
    module) or the dense path's (``sink_attention`` over dense masks, ``pick_entries`` on whole
    matrices). ``ex`` is the ModelExecutor (its caches, rings, floors and settings)."""
    cfg, fmt = ex.cfg, ex.fmt
    w = cfg.sliding_window
    q, lat = a.queries(x, positions)
    raw_swa = a.swa_kv(x, positions)
    swa_bytes = fmt.swa.quantize(raw_swa)
    kswa = fmt.swa.dequantize(swa_bytes).to(ex.dtype)  # attend to exactly what the ring will hold
    if a.kind == LAYER_FULL:
        cstate = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
    if a.kind in (LAYER_FULL, LAYER_REINDEX):
        qi, wi = a.indexer(x, lat, positions, a.inv_freq)
    outs = []
    for i, (r0, r1, s, slot, table) in enumerate(reqs):
        n = r1 - r0
        qp = positions[r0:r1]
        # ---- sliding window: history from the ring, then this chunk's keys
        ring = ex.swa[lid]
        floor = int(ex._floor[slot, int(lid >= cfg.encoder_layers)])
        h0 = max(0, s - (w - 1), min(floor, s))  # the first history position the ring can serve
        hist = torch.arange(h0, s, device=ex.device)
        k_hist = fmt.swa.dequantize(ring[slot, hist % ex.swa_ring]).to(ex.dtype)
        keys_a = torch.cat((k_hist, kswa[r0:r1]))
        if not tiled:
            kp = torch.cat((hist, qp))
            mask_a = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - w) & (kp[None, :] >= floor)
        if i in ex._snap_at and lid < cfg.encoder_layers:  # the ring as it is at position X
            x_at = ex._snap_at[i]
            snap = ring[slot].clone()
            sp = torch.arange(max(s, x_at - ex.swa_ring), x_at, device=ex.device)
            snap[sp % ex.swa_ring] = swa_bytes[r0:r1][sp - s]
            ex._snaps.setdefault(i, []).append(snap)
        keep = slice(max(0, n - ex.swa_ring), n)
        ex._ring_store(ring, raw_swa[r0:r1][keep], swa_bytes[r0:r1][keep], torch.full_like(qp[keep], slot), qp[keep])
        win = (h0, s, w, floor, a.attn_sink, a.scale)  # the tiled path's window arguments
        if a.kind == LAYER_SWA:
            with record_function(ATTENTION_RANGE):
                outs.append(attend_request(q[r0:r1], keys_a, *win, tile=ex.prefill_tile, budget=ex.prefill_budget)
                            if tiled else sink_attention(q[r0:r1], keys_a, mask_a, None, None, a.attn_sink, a.scale))
            continue
        src = cfg.kv_source_of(lid)
        ratio = a.ratio
        if a.kind == LAYER_FULL:
            ex._compress(lid, a, cstate[r0:r1], s, n, slot, table)
        e_total = (s + n) // ratio
        if a.kind in (LAYER_FULL, LAYER_REINDEX):
            with record_function(INDEXER_RANGE):
                ent = torch.arange(e_total, device=ex.device)
                flat = ex.index_keys[src].view(-1, fmt.index.bytes_per_token)
                ik = fmt.index.dequantize(flat[ex._slots(table, ent, ratio)]).to(ex.dtype)
                if tiled:
                    sel[(lid, i)] = select_entries(cfg, lid, qi[r0:r1], wi[r0:r1], ik, s, ratio, pools, i,
                                                   ex.prefill_budget, score_op=ex._index_score_op())
                else:
                    visible = (qp + 1) // ratio
                    sc = mask_scores(index_scores(qi[r0:r1], wi[r0:r1], ik), ent[None, :] < visible[:, None])
                    sel[(lid, i)] = pick_entries(cfg, lid, sc, visible, pools, i)
        ids, valid = sel[(cfg.index_source_of(lid), i)]
        flat = ex.kv[src].view(-1, fmt.main.bytes_per_token)
        with record_function(ATTENTION_RANGE):
            if tiled and cfg.ratio(cfg.index_source_of(lid)) == ratio:  # ids index this layer's entries
                # dequantise the request's e_total entries once, then gather rows of bf16 keys: the
                # same values as dequantising each gathered row (the codec is per entry), ~512x fewer
                # codec passes at top-k 512
                table_keys = fmt.main.dequantize(flat[ex._slots(table, torch.arange(e_total, device=ex.device),
                                                                  ratio)]).to(ex.dtype)
                gather = functools.partial(_pick_keys, table_keys, ids, valid)
            else:
                gather = functools.partial(_gather_compressed, ex, flat, table, ids, valid, ratio)
            if tiled:
                outs.append(attend_request(q[r0:r1], keys_a, *win, compressed=gather, n_compressed=ids.shape[1],
                                           tile=ex.prefill_tile, budget=ex.prefill_budget))
            else:
                kb, _ = gather(0, n)
                outs.append(sink_attention(q[r0:r1], keys_a, mask_a, kb, valid, a.attn_sink, a.scale))
    return torch.cat(outs)


def _gather_compressed(ex: Any, flat: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                       ratio: int, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys [g1 - g0, k, d] of one request's rows g0 .. g1 - 1 (their ``ids`` picked
    from the paged cache ``flat`` through ``table``) and their validity."""
    kb = ex.fmt.main.dequantize(flat[ex._slots(table, ids[g0:g1].reshape(-1), ratio)]).to(ex.dtype)
    return kb.view(g1 - g0, ids.shape[1], kb.shape[-1]), valid[g0:g1]


def _pick_keys(keys: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, g0: int,
               g1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows g0 .. g1 - 1 of a request's top-k compressed keys [g1 - g0, k, d] from its dequantised
    entries ``keys`` [E, d], and their validity."""
    return keys[ids[g0:g1]], valid[g0:g1]
