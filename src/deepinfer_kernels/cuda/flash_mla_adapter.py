"""FlashMLA (deepseek-ai/FlashMLA, SM90 build): sparse FP8 decode over the V3.2 656-byte paged cache, and
dense bf16 decode. The library's layout is kept at the boundary; the one conversion (our cache bytes ->
its k_cache view, the indexer's positions -> its block * page + offset indices) is in
``deepinfer_kernels.libs.layouts`` (``flash_mla_kv_cache``, ``flash_mla_indices``).

Facts from the pinned source (FlashMLA 9241ae3, flash_mla/flash_mla_interface.py, csrc/api/sparse_decode.h):
``get_mla_metadata()`` takes no arguments now and returns ``(FlashMLASchedMeta, None)``; the scheduling
metadata is computed on the first call and may be reused only while the shapes, top-k and topk_length
stay the same. Sparse decode: q bf16 [b, s_q, h_q, 576] (h_q 64 or 128 on SM90), head_dim_v 512,
``is_fp8_kvcache=True``, block_table / cache_seqlens unused (None), indices int32 [b, s_q, topk];
returns out bf16 [b, s_q, h_q, 512] and lse float32 [b, s_q, h_q] (+inf for a query with no valid index,
whose output is 0). ``attn_sink`` float32 [h_q] scales the output by exp(lse) / (exp(lse) + exp(sink)).
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kernels.libs import layouts as L
from deepinfer_kernels.libs.switch import require

D_QK = 576
D_V = 512


def _lib() -> Any:
    return require("flash_mla")


def new_sched_meta() -> Any:
    """A fresh scheduling-metadata object (one per distinct shape / top-k / topk_length)."""
    return _lib().get_mla_metadata()[0]


def sparse_decode_raw(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    sched_meta: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache`` in its own layout (k_cache [blocks, page, 1, 656], indices int32
    [b, s_q, topk]); checks the SM90 limits before the library sees the tensors."""
    fm = _lib()
    if q.dim() != 4 or q.dtype != torch.bfloat16 or q.shape[2] not in (64, 128) or q.shape[3] != D_QK:
        raise ValueError(
            f"q: must be bf16 [b, s_q, h_q in (64, 128), {D_QK}], got {q.dtype} {tuple(q.shape)}"
        )
    if indices.dtype != torch.int32 or indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"indices: must be int32 [b, s_q, topk] matching q, got {indices.dtype} {tuple(indices.shape)}"
        )
    meta = sched_meta if sched_meta is not None else fm.get_mla_metadata()[0]
    return fm.flash_mla_with_kvcache(
        q,
        k_cache,
        None,
        None,
        D_V,
        meta,
        None,
        sm_scale,
        False,
        True,
        indices,
        attn_sink,
        None,
        None,
        topk_length,
        None,
    )


def sparse_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    *,
    seq_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
    attn_sink: torch.Tensor | None = None,
    sched_meta: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over our V3.2 cache (uint8 [slots, 656] or [blocks, page, 656]) at the indexer's
    top-k ``positions`` ([b, s_q, k] or [b, k], per-sequence token positions, negative = none; or flat
    ids with ``seq_start``) through ``block_table`` [b, W]. Returns FlashMLA's (out, lse)."""
    k_cache = L.flash_mla_kv_cache(cache, page_size)
    indices = L.flash_mla_indices(positions, block_table, page_size, seq_start)
    return sparse_decode_raw(
        q, k_cache, indices, sm_scale=sm_scale, attn_sink=attn_sink, sched_meta=sched_meta
    )


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    causal: bool = False,
    sched_meta: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense bf16 MLA decode in FlashMLA's layout: q bf16 [b, s_q, h_q, 576], k_cache bf16
    [blocks, page, 1, 576] (values = the first 512 dims), block_table int32 [b, W], cache_seqlens int32 [b]."""
    fm = _lib()
    if q.dim() != 4 or q.dtype != torch.bfloat16 or q.shape[3] != D_QK:
        raise ValueError(f"q: must be bf16 [b, s_q, h_q, {D_QK}], got {q.dtype} {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.dtype != torch.bfloat16 or k_cache.shape[2:] != (1, D_QK):
        raise ValueError(
            f"k_cache: must be bf16 [blocks, page, 1, {D_QK}], got {k_cache.dtype} {tuple(k_cache.shape)}"
        )
    meta = sched_meta if sched_meta is not None else fm.get_mla_metadata()[0]
    return fm.flash_mla_with_kvcache(
        q,
        k_cache,
        block_table.to(torch.int32),
        cache_seqlens.to(torch.int32),
        D_V,
        meta,
        None,
        sm_scale,
        causal,
        False,
    )
