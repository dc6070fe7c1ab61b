"""The lightning indexer: score(t, e) = sum_h w_h(t) * relu(q_h(t) . k_e), top-k per query row.

Selection is by a *stable* descending sort, so ties (e.g. rows where every relu is 0) are broken by
the lower entry index in every code path: the full forward and the cached executor pick identical sets.
Hierarchical candidates: entries are grouped in blocks of ``block_size`` scored by their max; the top
``topk_blocks`` blocks (the newest partial block always kept, counting against the budget) form the pool
in which later Reindex layers pick their top-k.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.rope import apply_rope_

NEG = float("-inf")


class IndexerQuery(nn.Module):
    """Per-layer indexer queries (from the query latent) and head weights (from the hidden state)."""

    def __init__(
        self,
        hidden: int,
        q_lora: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        rope_interleave: bool = True,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.rope_interleave = rope_interleave
        self.wq = nn.Parameter(torch.empty(n_heads * head_dim, q_lora))
        self.weights_proj = nn.Parameter(torch.empty(n_heads, hidden))

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        for p in (self.wq, self.weights_proj):
            p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) / math.sqrt(p.shape[1]))

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [N, heads, dim] roped, weights [N, heads] with the 1/sqrt(heads * dim) scale folded in)."""
        return self.from_products(x @ self.weights_proj.t(), q_latent, positions, inv_freq)

    def from_products(
        self, w_raw: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` from the product ``x @ weights_proj.t()`` (``Attention.input_products``)."""
        q = (q_latent @ self.wq.t()).view(-1, self.n_heads, self.head_dim)
        # in place: q is this call's own product
        q = apply_rope_(q, positions, inv_freq, self.rope_dim, self.rope_interleave)
        return q, w_raw / math.sqrt(self.n_heads * self.head_dim)


@fusable
def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores [N, E] of queries [N, H, d] (weights [N, H]) against keys [E, d] or per row [N, E, d]."""
    eq = "nhd,ed->nhe" if keys.dim() == 2 else "nhd,ned->nhe"
    return torch.einsum("nh,nhe->ne", w, torch.relu(torch.einsum(eq, q, keys)))


@fusable
def mask_scores(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~allowed, NEG)


@fusable
def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry ids [N, k'] (k' = min(k, E)) and validity [N, k'] of the top-k unmasked scores per row."""
    k = min(k, scores.shape[1])
    s, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    return ids[:, :k], s[:, :k] > NEG  # +inf (a forced block) is valid, -inf (masked) is not


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [N, E]: the entries :func:`select_topk` picks."""
    ids, valid = select_topk(scores, k)
    m = torch.zeros_like(scores, dtype=torch.bool)
    m.scatter_(1, ids, valid)
    return m


def pick_entries(
    cfg: Any, lid: int, scores: torch.Tensor, visible: torch.Tensor, pools: dict, key: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The executor's choice of compressed entries for layer ``lid`` from its masked scores [N, E]: in
    layers that use hierarchical candidates, only the pool ``pools[key]`` may be picked; the candidate
    source layer makes that pool (stored at ``pools[key]``); then :func:`select_topk` (ids, valid)."""
    if cfg.uses_candidates(lid):
        scores = mask_scores(scores, pools[key])
    if lid == cfg.candidate_source_layer_id:
        pools[key] = candidate_pool(scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    return select_topk(scores, cfg.index_topk)


@fusable
def candidate_pool(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """Boolean [N, E] pool of the hierarchical candidate blocks.

    ``scores`` [N, E] are -inf where not visible; ``visible`` [N] is the number of visible entries.
    """
    n, e = scores.shape
    nb = -(-e // block_size)
    pad = torch.full((n, nb * block_size - e), NEG, dtype=scores.dtype, device=scores.device)
    bmax = torch.cat((scores, pad), 1).view(n, nb, block_size).amax(-1)
    # force each row's newest partial block: a gather / where / scatter of one column per row instead of
    # a nonzero() over the partial rows, so no host synchronisation (CUDA-graph capturable); a row with
    # no partial block writes its own value back
    if nb:
        partial = (visible % block_size) != 0
        col = (visible // block_size).clamp(max=nb - 1)[:, None]
        cur = bmax.gather(1, col)
        bmax.scatter_(1, col, torch.where(partial[:, None], torch.full_like(cur, float("inf")), cur))
    bsel = topk_mask(bmax, topk_blocks)  # [N, nb]
    pool = bsel.repeat_interleave(block_size, dim=1)[:, :e]
    return pool & (scores > NEG)


_KEYED = (torch.float16, torch.bfloat16, torch.float32)


# not @fusable: Inductor (torch 2.11 on the H200) emits the 2**32 - 1 / 0x7FFFFFFF key arithmetic as int32
# constants and the Triton compile fails ("Scalar 4294967295 is out of range for type int32"); eagerly it
# is a handful of elementwise kernels beside one topk
def select_topk_keyed(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_topk` through ``torch.topk`` (a partial selection instead of a full sort per row).

    Identical ids and order, by construction: each score (float32 or narrower, widened exactly) becomes
    one int64 key, its order-preserving 32-bit integer image in the high half and ``2**32 - 1 - index`` in
    the low half, so keys are distinct and ordered by (score descending, index ascending), which is the
    order of the stable descending sort. ``-0.0`` is first turned into ``+0.0`` (the sort calls them
    equal); NaN scores are not supported (the executor's scores never hold NaN). Other dtypes (float64)
    fall back to :func:`select_topk`.
    """
    if scores.dtype not in _KEYED or scores.shape[1] >= 2**31:
        return select_topk(scores, k)
    k = min(k, scores.shape[1])
    s32 = scores.to(torch.float32) + 0.0  # exact widening; -0.0 + 0.0 == +0.0
    bits = s32.view(torch.int32)
    # negative floats order backwards as integers: flip their magnitude bits (the sign bit stays)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    idx = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    key = ordered.to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - idx)[None, :]
    top = torch.topk(key, k, dim=1, largest=True, sorted=True).values
    ids = (1 << 32) - 1 - (top & 0xFFFFFFFF)
    return ids, scores.gather(1, ids) > NEG
