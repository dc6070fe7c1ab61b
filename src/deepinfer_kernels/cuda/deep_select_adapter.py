"""DeepSelect (deepseek-ai/DeepSelect, built with DEEP_SELECT_CUDA_ARCHS=90a): top-k for the indexer (bf16
or float32 scores) and for sampling (float32 logits).

Facts from its source (deep_select/interface.py, csrc/api.cpp as indexed 2026-12): ``topk(input [b, n],
topk, sorted=False, begin=None, end=None, indices_type=torch.int64, sorted_index=False, hint=None,
output_idx=None, output_idx_offset=None, idx_oob_fill_value=2**31 - 1, value_oob_fill_value=-inf,
return_value=True, abort_when_nan_found=True) -> (values, indices)``; input bf16 or float32 with
stride(1) == 1 and a row stride that is a multiple of ``get_stride_requirement()[0]`` bytes;
1 <= topk <= 4096; n < 2^23; ``sorted`` only for float32; a row shorter than topk gets its entries
first, then the fill values. The conversion (row alignment, -1 for non-finite / fill entries) is in
``deepinfer_kernels.libs.layouts`` (``aligned_rows``, ``topk_to_indices``).
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kernels.libs import layouts as L
from deepinfer_kernels.libs.switch import require

MAX_K = 4096


def _lib() -> Any:
    return require("deep_select")


def topk(x: torch.Tensor, k: int, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``deep_select.topk`` in its own layout: (values [b, k] in x's dtype, indices int64 [b, k]); rows
    shorter than k end with (-inf, -1). ``sorted`` (descending values) needs float32."""
    ds = _lib()
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: must be bf16 or float32 [rows, n], got {x.dtype} {tuple(x.shape)}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k={k}: DeepSelect takes 1 <= k <= {MAX_K}")
    if sorted and x.dtype != torch.float32:
        raise ValueError("sorted=True: DeepSelect sorts float32 values only")
    xa = L.aligned_rows(x, int(ds.get_stride_requirement()[0]))
    return ds.topk(xa, k, sorted=sorted, idx_oob_fill_value=-1)


def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Our ``indexer_topk`` contract: int32 [T, k], the k best finite scores' indices (unsorted), -1 after."""
    if scores.shape[0] == 0:
        return torch.empty(0, k, dtype=torch.int32, device=scores.device)
    vals, idx = topk(scores, k)
    return L.topk_to_indices(vals, idx, scores.shape[1])
