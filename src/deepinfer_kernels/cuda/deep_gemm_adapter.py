"""DeepGEMM (deepseek-ai/DeepGEMM, SM90): grouped FP8 GEMMs for the MoE and the indexer's logits.

The library's layout is kept at the boundary; each entry point converts through one function of
``deepinfer_kernels.libs.layouts`` (the grouped layouts, the FP8 quantisers, the index-key conversion).

Facts from the pinned source (DeepGEMM 54e2261 = v2.6.1, csrc/apis/gemm.hpp, attention.hpp, layout.hpp):
``m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout)`` and ``m_grouped_fp8_gemm_nt_masked(a, b, d,
masked_m, expected_m)`` are aliases of the fp8_fp4 functions; on SM90 (recipe (1, 128, 128)) a = (e4m3
[M, K], float32 [M, K/128]) and b = (e4m3 [G, N, K], float32 [G, N/128, K/128] contiguous), both K-major,
d bf16 row-major; the A scales are made TMA-aligned and MN-major inside (``get_mn_major_tma_aligned_tensor``).
Contiguous: m_indices int32 [M], -1 on padding rows, segments aligned to
``get_mk_alignment_for_contiguous_layout()`` (128). ``fp8_mqa_logits(q, (kv, kv_scale), weights,
cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0)``: q e4m3 [T, H, D] with H in
{32, 64} on SM90, kv e4m3 [S, D] and float32 [S], weights float32 [T, H] -> float32 [T, S] (a view of a
row-padded buffer; -inf outside [ks, ke) when clean_logits). ``fp8_paged_mqa_logits(q [B, next_n, H, D],
kv_cache uint8 [blocks, 64, 1, D + 4], weights [B * next_n, H], context_lens int32 [B, next_n],
block_table int32 [B, W], schedule_meta, max_context_len, clean_logits=False)`` with
``get_paged_mqa_logits_metadata(context_lens, 64, num_sms)``; entries at or past a row's context length
are not written (garbage), so this adapter masks them to -inf.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kernels.libs import layouts as L
from deepinfer_kernels.libs.switch import require

_WEIGHTS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _lib() -> Any:
    return require("deep_gemm")


def fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 expert weights [E, N, K] -> the checkpoint-layout FP8 pair, quantised once per tensor (cached
    by storage, shape and version: an in-place update re-quantises)."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype, w._version, w.device)
    got = _WEIGHTS.get(key)
    if got is None:
        if len(_WEIGHTS) > 64:  # a model has a few dozen expert tensors; drop stale entries beyond that
            _WEIGHTS.clear()
        got = L.quantize_fp8_blocks(w)
        _WEIGHTS[key] = got
    return got


def grouped_fp8_contiguous(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """Our MoE contract (x [R, K] sorted by expert, offs [E] end offsets; rows past offs[-1] give zeros) with
    FP8 checkpoint weights (e4m3 [E, N, K], float32 [E, N/128, K/128]) -> bf16 [R, N], through the
    contiguous layout (prefill-sized batches)."""
    dg = _lib()
    L.check_fp8_block_weights(w8, w_scale)
    lay = L.contiguous_layout(x, offs, align=int(dg.get_mk_alignment_for_contiguous_layout()))
    a = L.quantize_fp8_tokens(lay.x)
    d = torch.empty(lay.x.shape[0], w8.shape[1], dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, (w8, w_scale), d, lay.groups)
    return L.gather_rows(d, lay.rows)


def grouped_fp8_masked(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    max_m: int | None = None,
    expected_m: int | None = None,
) -> torch.Tensor:
    """As :func:`grouped_fp8_contiguous` through the masked layout (decode: static shapes, no host sync
    unless ``max_m`` < rows). ``expected_m``: DeepGEMM's hint of the rows an expert gets (default R / E)."""
    dg = _lib()
    L.check_fp8_block_weights(w8, w_scale)
    lay = L.masked_layout(x, offs, max_m)
    e, m, k = lay.x.shape
    a8, asf = L.quantize_fp8_tokens(lay.x.view(e * m, k))
    a = (a8.view(e, m, k), asf.view(e, m, -1))
    d = torch.empty(e, m, w8.shape[1], dtype=torch.bfloat16, device=x.device)
    hint = expected_m if expected_m is not None else max(1, -(-x.shape[0] // e))
    dg.m_grouped_fp8_gemm_nt_masked(a, (w8, w_scale), d, lay.groups, hint)
    return L.gather_rows(d, lay.rows)


def mqa_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    key_start: torch.Tensor,
    key_end: torch.Tensor,
) -> torch.Tensor:
    """Our ``indexer_scores`` contract (q [T, H, D], weights [T, H], keys [S, D] or an (e4m3, scale) pair,
    key_start / key_end [T]) -> float32 [T, S] logits, -inf outside each row's range. q is rounded to e4m3
    with its per-(t, h) power-of-two scale folded into the weights (``fold_q_scales``); float keys get one
    power-of-two scale each (``fp8_index_keys``)."""
    dg = _lib()
    h = q.shape[1]
    if h not in (32, 64):
        raise ValueError(f"q: DeepGEMM's SM90 logits need 32 or 64 heads, got {h}")
    q8, w = L.fold_q_scales(q, weights)
    kv = keys if isinstance(keys, tuple) else L.fp8_index_keys(keys)
    ks = key_start.to(q.device, torch.int32).contiguous()
    ke = key_end.to(q.device, torch.int32).contiguous()
    return dg.fp8_mqa_logits(q8, kv, w, ks, ke, clean_logits=True)


def paged_mqa_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    schedule_meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged logits in DeepGEMM's layout: q [B, next_n, H, D] (bf16; rounded as in :func:`mqa_logits`),
    weights [B * next_n, H], kv_cache uint8 [blocks, 64, 1, D + 4], block_table int32 [B, W],
    context_lens int32 [B] (keys of the last of the next_n tokens; causal per token) or [B, next_n]
    -> float32 [B * next_n, max_context_len], -inf at and past each token's context length."""
    dg = _lib()
    b, nn, h, d = q.shape
    q8, w = L.fold_q_scales(q.reshape(b * nn, h, d), weights)
    cl = context_lens if context_lens.dim() == 2 else L.context_lens_2d(context_lens, nn)
    cl = cl.to(q.device, torch.int32).contiguous()
    meta = (
        schedule_meta
        if schedule_meta is not None
        else dg.get_paged_mqa_logits_metadata(cl, L.DG_PAGED_BLOCK, dg.get_num_sms())
    )
    logits = dg.fp8_paged_mqa_logits(
        q8.view(b, nn, h, d), kv_cache, w, cl, block_table.to(torch.int32), meta, max_context_len, False
    )
    j = torch.arange(max_context_len, device=q.device)
    return logits.masked_fill(j[None, :] >= cl.view(-1, 1), float("-inf"))


def paged_mqa_logits_mxfp4(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    context_lens: torch.Tensor,
    max_context_len: int,
) -> torch.Tensor:
    """:func:`paged_mqa_logits` over our paged MXFP4 index-key pool (converted by
    ``layouts.mxfp4_pool_to_deep_gemm``: a full copy of the pool a call, for tests and measurements; a
    serving path would keep the converted cache)."""
    cache, table = L.mxfp4_pool_to_deep_gemm(pool, block_table, page_size, q.shape[-1])
    return paged_mqa_logits(q, weights, cache, table.clamp(min=0), context_lens, max_context_len)
