"""Cache-free masked reference for the replay tests (an oracle independent of the executor's caches).

``masked_forward`` is the model's full forward over one whole sequence with two changes: SWA keys
below ``enc_floor`` (encoder layers) / ``dec_floor`` (decoder layers) are masked out, and the
compressed entries (main KV and indexer keys) of groups that end before ``cached_below`` are taken from
an unmasked run, as a prefix hit takes them from the cached blocks. It returns the logits and every
layer's SWA keys [T, d], so the rings the executor leaves can be compared position by position.
"""

from __future__ import annotations

import torch

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import candidate_pool, index_scores, mask_scores, topk_mask
from deepinfer_core.model.model import DeepSeekV41


@torch.no_grad()
def masked_forward(
    model: DeepSeekV41,
    tokens: torch.Tensor,
    enc_floor: int = 0,
    dec_floor: int = 0,
    cached_below: int = 0,
    _exact: dict | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict]:
    cfg = model.cfg
    t = tokens.shape[0]
    pos = torch.arange(t)
    i, j = pos[:, None], pos[None, :]
    win = (j <= i) & (j > i - cfg.sliding_window)
    comp: dict[int, torch.Tensor] = {}
    ikeys: dict[int, torch.Tensor] = {}
    sel: dict[int, torch.Tensor] = {}
    pools: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    if cached_below and _exact is None:
        _exact = masked_forward(model, tokens)[2]

    def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        floor = enc_floor if lid < cfg.encoder_layers else dec_floor
        m = win & (j >= floor)
        q, lat = a.queries(x, pos)
        kswa = a.swa_kv(x, pos)
        keys[lid] = kswa
        if a.kind == LAYER_SWA:
            return sink_attention(q, kswa, m, None, None, a.attn_sink, a.scale)
        r = a.ratio
        src = cfg.kv_source_of(lid)
        e = t // r
        if a.kind == LAYER_FULL:
            comp[lid] = a.compressor.pool(a.compressor.project(x[: e * r]), 0, a.inv_freq)
            ikeys[lid] = a.index_compressor.pool(a.index_compressor.project(x[: e * r]), 0, a.inv_freq)
            if cached_below:  # groups inside the hit come from the cache, i.e. from the unmasked run
                c = cached_below // r
                comp[lid][:c] = _exact["comp"][lid][:c]
                ikeys[lid][:c] = _exact["ikeys"][lid][:c]
        visible = (pos + 1) // r
        vis = torch.arange(e)[None, :] < visible[:, None]
        if a.kind in (LAYER_FULL, LAYER_REINDEX):
            qi, wi = a.indexer(x, lat, pos, a.inv_freq)
            sc = mask_scores(index_scores(qi, wi, ikeys[src]), vis)
            if cfg.uses_candidates(lid):
                sc = mask_scores(sc, pools[src])
            if lid == cfg.candidate_source_layer_id:
                pools[lid] = candidate_pool(sc, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            sel[lid] = topk_mask(sc, cfg.index_topk)
        return sink_attention(q, kswa, m, comp[src], sel[cfg.index_source_of(lid)], a.attn_sink, a.scale)

    hidden, _ = model.run_layers(tokens, attend)
    return model.logits(hidden), keys, {"comp": comp, "ikeys": ikeys}
