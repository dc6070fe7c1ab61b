"""Differentiable batched forward of the target and the DSpark drafter (what ``scripts/train_tiny.py`` trains).

:meth:`DeepSeekV41.forward_full` masks complete [T, T] matrices for one sequence, which is right for an
oracle and far too slow to train with. :func:`batched_forward` runs ``B`` sequences of ``T`` tokens through
the *same* layer loop (:meth:`DeepSeekV41.run_layers`, so mHC, Engram, MoE and the norms are the modules
themselves) with a batched ``attend``: each query row gets its sliding window of keys gathered ([N, W, d])
and the compressed entries its indexer picked ([N, k, d]), and :func:`sink_attention` does the maths on
those per-row key sets. The selection is the oracle's: per-sequence compressed entries and indexer keys,
the same visibility, candidate pools and stable top-k, so the logits equal ``forward_full``'s up to
summation order (tests/deepinfer_core/model/test_checkpoint.py checks it in float64).

Gradients: everything but the indexer (its top-k is discrete; the tiny model's indexer keeps its
initial weights, docs/model.md) and the MoE selection bias (moved by the aux-loss-free balancing rule,
:func:`balance_experts_`). :func:`drafter_loss` trains the DSpark drafter on the target's own greedy
predictions with teacher-forced Markov inputs, and its confidence head on whether each draft was right.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import candidate_pool, mask_scores, select_topk
from deepinfer_core.model.model import AttendFn, DeepSeekV41

log = logging.getLogger(__name__)

__all__ = [
    "balance_experts_",
    "batched_forward",
    "drafter_block",
    "drafter_loss",
    "engram_rows_batched",
    "lm_loss",
]


def _windows(k: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position the ``w`` rows ending at it: [B, T, d] -> ([B*T, w, d], valid [B*T, w])."""
    b, t, d = k.shape
    pad = torch.cat((k.new_zeros(b, w - 1, d), k), dim=1)  # [B, T + w - 1, d]
    idx = torch.arange(t, device=k.device)[:, None] + torch.arange(w, device=k.device)[None, :]  # [T, w]
    win = pad[:, idx]  # [B, T, w, d]
    valid = (idx >= w - 1).expand(b, t, w)
    return win.reshape(b * t, w, d), valid.reshape(b * t, w)


def engram_rows_batched(
    model: DeepSeekV41, tokens: torch.Tensor, tables: Mapping[int, torch.Tensor] | None = None
) -> dict[int, torch.Tensor]:
    """{layer: rows [B*T, row_dim]} for ``tokens`` [B, T] (one sequence a row). ``tables`` ({layer:
    values [rows, head_dim]} on the tokens' device) defaults to the model's tables' values; hashing runs
    on the tokens' device."""
    cfg = model.cfg
    if not cfg.engram_layer_ids:
        return {}
    h = model.engram_hasher
    ids = h.hash(tokens)  # [L, B, T, cols]
    out = {}
    for lid in cfg.engram_layer_ids:
        vals = tables[lid] if tables is not None else model.engram_tables[lid].data.to(tokens.device).float()
        r = ids[h.layer_index(lid)].long()
        out[lid] = vals[r].reshape(tokens.numel(), -1).to(model.embed.dtype)
    return out


def batched_forward(
    model: DeepSeekV41,
    tokens: torch.Tensor,
    capture: Sequence[int] | None = None,
    engram_rows: Mapping[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Logits [B, T, V], expert counts [layers, experts] and {layer: output state [B*T, D]} for ``capture``.

    ``tokens`` [B, T]: B independent sequences, each starting at position 0 (no cache)."""
    b, t = tokens.shape
    attend = _batched_attend(model, b, t, tokens.device)
    if engram_rows is None:
        engram_rows = engram_rows_batched(model, tokens)
    # run_layers fills a state for every key it is given
    caps = cast(dict[int, torch.Tensor], dict.fromkeys(capture)) if capture else None
    hidden, counts = model.run_layers(tokens.reshape(-1), attend, capture=caps, engram_rows=engram_rows)
    return model.logits(hidden).view(b, t, -1), counts, caps or {}


def _batched_attend(model: DeepSeekV41, b: int, t: int, dev: torch.device) -> AttendFn:
    """The layers' attention over B sequences of T tokens from position 0, rows in sequence order: each
    layer's compressed entries, indexer keys, selections and candidate pools, kept per layer for the later
    layers that share them (a fresh state per forward, hence a closure)."""
    cfg = model.cfg
    pos = torch.arange(t, device=dev).repeat(b)  # [N]
    win = cfg.sliding_window
    comp: dict[int, torch.Tensor] = {}
    ikeys: dict[int, torch.Tensor] = {}
    sel: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pools: dict[int, torch.Tensor] = {}
    bidx = torch.arange(b, device=dev).repeat_interleave(t)  # sequence of each row

    def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        q, lat = a.queries(x, pos)
        ka, ma = _windows(a.swa_kv(x, pos).view(b, t, -1), win)
        if a.kind == LAYER_SWA:
            return sink_attention(q, ka, ma, None, None, a.attn_sink, a.scale)
        r = a.ratio
        src = cfg.kv_source_of(lid)
        assert src is not None
        e = t // r
        if e == 0:
            return sink_attention(q, ka, ma, None, None, a.attn_sink, a.scale)
        if a.kind == LAYER_FULL:
            ent = torch.arange(e, device=dev).repeat(b)
            for store, c in ((comp, a.compressor), (ikeys, a.index_compressor)):
                st = c.project(x).view(b, t, -1)[:, : e * r].reshape(b * e, r, -1)
                store[lid] = c.pool_groups(st, ent, a.inv_freq).view(b, e, -1)
        visible = (pos + 1) // r
        vis = torch.arange(e, device=dev)[None, :] < visible[:, None]
        if a.kind in (LAYER_FULL, LAYER_REINDEX):
            qi, wi = a.indexer(x, lat, pos, a.inv_freq)
            # scores per sequence: [B, T, H, d] x [B, E, d] (not per row: the keys are shared by a sequence)
            raw = torch.einsum("bthd,bed->bthe", qi.view(b, t, *qi.shape[1:]), ikeys[src])
            sc = torch.einsum("nh,nhe->ne", wi, torch.relu(raw).reshape(b * t, qi.shape[1], e))
            sc = mask_scores(sc, vis)
            if cfg.uses_candidates(lid):
                sc = mask_scores(sc, pools[src])
            if lid == cfg.candidate_source_layer_id:
                pools[lid] = candidate_pool(sc, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            sel[lid] = select_topk(sc.detach(), cfg.index_topk)
        isrc = cfg.index_source_of(lid)
        assert isrc is not None
        ids, valid = sel[isrc]
        kb = comp[src][bidx[:, None], ids]  # [N, k, d]
        return sink_attention(q, ka, ma, kb, valid, a.attn_sink, a.scale)

    return attend


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of logits [B, T, V] on tokens [B, T]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def balance_experts_(model: DeepSeekV41, counts: torch.Tensor, rate: float = 1e-3) -> None:
    """Aux-loss-free balancing: move each layer's selection bias towards its under-loaded experts."""
    for blk, c in zip(model.layers, counts):
        c = c.float()
        blk.ffn.gate_bias.add_(rate * torch.sign(c.mean() - c))


def drafter_block(
    model: DeepSeekV41, tokens: torch.Tensor, caps: Mapping[int, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's block states at every anchor q in [1, T - block] of every row of ``tokens`` [B, T]:
    (row ids [R], anchors [R], accepted tokens y [R], normed block states [R, block, D]), R = B (T - block),
    anchors in row-major order. Same maths as :meth:`DSparkDrafter.draft_full` for each anchor."""
    dr = model.drafter
    assert dr is not None
    b, t = tokens.shape
    blk, w = dr.block, dr.window
    dev = tokens.device
    feat = dr.features([caps[lid] for lid in dr.target_layers])  # [B*T, D]
    pos = torch.arange(t, device=dev).repeat(b)
    qs = torch.arange(1, t - blk + 1, device=dev)  # anchors
    nq = qs.shape[0]
    rows_b = torch.arange(b, device=dev).repeat_interleave(nq)
    rows_q = qs.repeat(b)
    sel = rows_b * t + rows_q - 1  # the context window ends at q - 1
    keys, mask = [], None
    for st in dr.stages:
        kw, valid = _windows(st.context_keys(feat, pos).view(b, t, -1), w)
        keys.append(kw[sel])
        mask = valid[sel]
    y = tokens[rows_b, rows_q]
    cond = feat[sel]
    assert mask is not None  # a drafter has at least one stage
    return rows_b, rows_q, y, dr.run_block(model, y, rows_q, cond, keys, mask)


def drafter_loss(
    model: DeepSeekV41,
    tokens: torch.Tensor,
    target_next: torch.Tensor,
    caps: Mapping[int, torch.Tensor],
    conf_weight: float = 0.2,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss of the drafter on every anchor of ``tokens`` [B, T] (the target's greedy predictions
    ``target_next`` [B, T]: row i is the token the target puts after position i; ``caps``: the target
    layers' output states [B*T, D], from :func:`batched_forward`, detached).

    Anchor q (1 <= q <= T - block) drafts from y = tokens[q]; draft k's label is target_next[q + k] and
    its Markov input the previous label (teacher forcing: what an accepted chain feeds). The confidence
    head learns P(draft k right | drafts < k right) by BCE on the rows whose earlier drafts were right.
    Returns (loss, stats: per-position accuracy and conditional acceptance)."""
    dr = model.drafter
    assert dr is not None
    dev = tokens.device
    blk = dr.block
    rows_b, rows_q, y, hidden = drafter_block(model, tokens, caps)
    ks = torch.arange(blk, device=dev)
    labels = target_next[rows_b[:, None], rows_q[:, None] + ks[None, :]]  # [R, blk]
    prev = torch.cat((y[:, None], labels[:, :-1]), dim=1)
    code = dr.markov_in[prev]  # [R, blk, r]
    logits = model.logits(hidden) + code @ dr.markov_out.t()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    right = logits.argmax(-1) == labels
    earlier = torch.cat((torch.ones_like(right[:, :1]), torch.cumprod(right.long(), 1)[:, :-1].bool()), 1)
    conf_logit = torch.cat((hidden, code), -1) @ dr.conf_w + dr.conf_b
    bce = F.binary_cross_entropy_with_logits(conf_logit[earlier].float(), right[earlier].float())
    with torch.no_grad():
        acc = right.float().mean(0)
        cond_acc = (right & earlier).float().sum(0) / earlier.float().sum(0).clamp(min=1)
        accepted = torch.cumprod(right.long(), 1).sum(1).float().mean()
    return ce + conf_weight * bce, {
        "ce": float(ce.detach()),
        "bce": float(bce.detach()),
        "acc": acc.tolist(),
        "cond_acc": cond_acc.tolist(),
        "accepted": float(accepted),
    }
