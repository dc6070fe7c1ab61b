"""Thin adapters to DeepSeek's kernel libraries, used only when the library is importable.

Each adapter keeps the library's own tensor layout at its boundary (documented per function) and raises
``RuntimeError`` naming the library when it is absent, so callers pick the torch path explicitly. None of
flash_mla, deep_gemm, deep_ep or deep_select is installed on the H200 used here (they are built from
source), so these four are untested against their references in this repository; tile_kernels is
installed there: its ``engram_hash`` (``cuda/engram.py``) and ``topk_gate`` are tested against torch. See docs/cuda_backend.md.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

LIBRARIES = ("flash_mla", "deep_gemm", "deep_ep", "deep_select", "tile_kernels")


def available(lib: str) -> bool:
    """Whether ``lib`` can be imported here (checked without importing it)."""
    if lib not in LIBRARIES:
        raise ValueError(f"lib={lib!r}: must be one of {LIBRARIES}")
    return importlib.util.find_spec(lib) is not None


def _require(lib: str) -> Any:
    if not available(lib):
        raise RuntimeError(f"{lib} is not importable here; use the torch reference path")
    return importlib.import_module(lib)


def flash_mla_sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int = 512,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse MQA decode over an FP8 paged cache: q [b, s_q, h_q, d], k_cache [blocks, page, 1,
    bytes], indices int32 [b, s_q, topk] (block * page + offset, -1 invalid) -> (out bf16, lse fp32).
    SM90 needs h_q in {64, 128} and top-k a multiple of 64 (checked here, before the library sees it)."""
    fm = _require("flash_mla")
    if q.dim() != 4 or q.shape[2] not in (64, 128):
        raise ValueError(f"q: must be [b, s_q, h_q in (64, 128), d], got {tuple(q.shape)}")
    if indices.dim() != 3 or indices.shape[-1] % 64:
        raise ValueError(
            f"indices: must be [b, s_q, topk], topk a multiple of 64, got {tuple(indices.shape)}"
        )
    meta = kwargs.pop("tile_scheduler_metadata", None)
    if meta is None:
        meta = fm.get_mla_metadata(cache_seqlens, q.shape[1] * q.shape[2], 1)[0]
    return fm.flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        meta,
        is_fp8_kvcache=True,
        indices=indices,
        **kwargs,
    )


def deep_gemm_grouped_fp8(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous``: (a fp8 [M, K], scales), (b fp8 [G, N, K], scales),
    out bf16 [M, N], m_indices int32 [M] (expert of each row; segments aligned as DeepGEMM requires)."""
    dg = _require("deep_gemm")
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, out, m_indices)
    return out


def deep_ep_buffer(group: Any, **kwargs: Any) -> Any:
    """A DeepEP buffer for EP dispatch / combine over ``group`` (NVLink intranode; NVSHMEM for internode)."""
    de = _require("deep_ep")
    cls = getattr(de, "ElasticBuffer", None) or de.Buffer
    return cls(group, **kwargs)


def deep_select_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """deep_select.topk(x [b, n], k, sorted=False) -> (values, indices)."""
    return _require("deep_select").topk(x, k, sorted=False)


def tile_kernels_topk_gate(scores: torch.Tensor, k: int) -> torch.Tensor:
    """tile_kernels.moe.topk_gate: scores fp32 [tokens, experts] (contiguous), 1 <= k <= min(experts, 32)
    -> expert ids int64 [tokens, k]; ties go to the smaller id. Tested against torch in test_cuda_adapters."""
    _require("tile_kernels")
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(
            f"scores: must be float32 [tokens, experts], got {scores.dtype} {tuple(scores.shape)}"
        )
    if not 1 <= k <= min(scores.shape[1], 32):
        raise ValueError(f"k={k}: must be in [1, min(experts, 32)]")
    return importlib.import_module("tile_kernels.moe").topk_gate(scores.contiguous(), k)


def tile_kernels_mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """tile_kernels.mhc.mhc_pre_apply_mix_fwd: the sublayer input as a learned mix of the mHC streams
    (x [tokens, streams, hidden], mix per token and stream, out [tokens, hidden]); its own layout. Untested."""
    _require("tile_kernels")
    importlib.import_module("tile_kernels.mhc").mhc_pre_apply_mix_fwd(x, mix, out)
    return out
