"""The tiled prefill's bounded pieces (see :mod:`~deepinfer_core.model.prefill`): the indexer's top-k
selection of one request's rows a memory ``budget`` at a time (:func:`select_entries`) and one request's
attention in query tiles and row pieces (:func:`attend_request`).

Split from ``prefill.py``, which wires them into a step (``RequestAttention``); both names stay importable
from there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.layers.indexer import (
    candidate_pool,
    index_scores,
    mask_scores,
    select_topk,
    select_topk_keyed,
)
from deepinfer_core.model.layers.window_attention import window_attention, window_width
from deepinfer_core.model.state import DEFAULT_BUDGET, DEFAULT_TILE

__all__ = ["attend_request", "rows_per_piece", "select_entries"]

Selected = tuple[torch.Tensor, torch.Tensor]  # (ids [rows, k'], valid [rows, k'])


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
) -> Selected:
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
    es = 4 if score_op is not None else qi.element_size()  # the op's scores (and its torch fallback) are fp32
    # per row: the [heads, E] products and their relu, then the [E] scores, mask, pool and sort keys
    rows = rows_per_piece(e_all * (2 * heads * es + 4 * es + 3 * 8), budget)
    make_pool = lid == cfg.candidate_source_layer_id
    # the pool a candidate-restricted layer reads is the one stored before this call (read up front: a
    # source layer's new pool is stored only after all of its pieces)
    candidates = pools[key] if cfg.uses_candidates(lid) else None
    sel = select_topk_keyed if keyed else select_topk
    piece = functools.partial(_select_piece, cfg, qi, wi, ik, s, ratio, candidates, make_pool, sel, score_op)
    parts = [piece(c0, min(n, c0 + rows)) for c0 in range(0, n, rows)]
    if make_pool:
        pools[key] = torch.cat([pool for _, _, pool in parts if pool is not None])
    return torch.cat([ids for ids, _, _ in parts]), torch.cat([valid for _, valid, _ in parts])


def _select_piece(
    cfg: ModelConfig,
    qi: torch.Tensor,
    wi: torch.Tensor,
    ik: torch.Tensor,
    s: int,
    ratio: int,
    candidates: torch.Tensor | None,
    make_pool: bool,
    sel: Callable[[torch.Tensor, int], Selected],
    score_op: Callable[..., torch.Tensor] | None,
    c0: int,
    c1: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows c0 .. c1 - 1 of :func:`select_entries`: (ids, valid, their candidate pool [c1 - c0, E] when
    ``make_pool``, else None), padded to the dense width k' = min(index_topk, E)."""
    e_all, dev, m = ik.shape[0], qi.device, c1 - c0
    k_out = min(cfg.index_topk, e_all)
    ent = torch.arange(e_all, device=dev)
    e_c = min(e_all, (s + c1) // ratio)  # the piece's last row sees the most entries
    vis = (s + c0 + 1 + torch.arange(m, device=dev)) // ratio
    if e_c == 0:  # no entry visible yet: the dense sort lists the masked entries in index order
        pool = torch.zeros(m, e_all, dtype=torch.bool, device=dev) if make_pool else None
        return ent[:k_out].expand(m, -1), torch.zeros(m, k_out, dtype=torch.bool, device=dev), pool
    if score_op is None:
        sc = mask_scores(index_scores(qi[c0:c1], wi[c0:c1], ik[:e_c]), ent[None, :e_c] < vis[:, None])
    else:
        sc = score_op(qi[c0:c1], wi[c0:c1], ik[:e_c], torch.zeros_like(vis), vis)
    cand = None if candidates is None else candidates[c0:c1, :e_c]
    return pick_scored(cfg, sc, vis, cand, make_pool, sel, ent, e_all, k_out)


def pick_scored(
    cfg: ModelConfig,
    sc: torch.Tensor,
    vis: torch.Tensor,
    cand: torch.Tensor | None,
    make_pool: bool,
    sel: Callable[[torch.Tensor, int], Selected],
    ent: torch.Tensor,
    width: int,
    k_out: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A piece of rows' selection from its scores ``sc`` [m, e] over entries 0 .. e - 1 (the tiled and the
    varlen prefill alike): the candidate mask ``cand`` applied, the candidate pool padded to ``width``
    when ``make_pool``, the top-k by ``sel``, padded to ``k_out`` with entries e .. (``ent``: the entry ids
    0, 1, ...), masked, in index order, as the stable sort over all entries lists them."""
    m, e = sc.shape
    if cand is not None:
        sc = mask_scores(sc, cand)
    pool = None
    if make_pool:
        pool = candidate_pool(sc, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        pool = torch.cat((pool, pool.new_zeros(m, width - e)), 1)
    ids, valid = sel(sc, cfg.index_topk)
    if ids.shape[1] < k_out:
        tail = ent[e : e + k_out - ids.shape[1]].expand(m, -1)
        ids = torch.cat((ids, tail), 1)
        valid = torch.cat((valid, torch.zeros_like(tail, dtype=torch.bool)), 1)
    return ids, valid, pool


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
