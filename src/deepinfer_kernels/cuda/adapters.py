"""Adapters to DeepSeek's kernel libraries, used only when the library is importable.

Each adapter keeps the library's own tensor layout at its boundary (documented per function) and raises
``RuntimeError`` naming the library when it is absent, so callers pick the torch path explicitly. The
conversions from the project's formats are pure torch, in ``deepinfer_kernels.libs.layouts`` (tested on
the CPU); the calls are per library:

- FlashMLA (``flash_mla_adapter``): sparse FP8 decode over the V3.2 656-byte cache, dense decode;
- DeepGEMM (``deep_gemm_adapter``): grouped FP8 GEMMs (contiguous, masked) for the MoE with checkpoint
  FP8 block weights, the indexer's logits (``fp8_mqa_logits``, ``fp8_paged_mqa_logits``);
- DeepSelect (``deep_select_adapter``): top-k for the indexer and for sampling;
- DeepEP: the buffer (two or more GPUs; untested here); tile_kernels: gating (tested against torch).

flash_mla, deep_gemm and deep_select are built from source by ``scripts/build_kernel_libs.sh``; their GPU
tests (tests/deepinfer_kernels/test_kernel_libs_gpu.py) skip where a library is not importable. Which of
them the cuda ops call is ``DEEPINFER_KERNEL_LIBS`` (``deepinfer_kernels.libs.switch``). See
docs/cuda_backend.md, "Kernel libraries".
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from deepinfer_kernels.libs.switch import LIBRARIES, require

_require = require


def available(lib: str) -> bool:
    """Whether ``lib`` can be imported here (checked without importing it)."""
    if lib not in LIBRARIES:
        raise ValueError(f"lib={lib!r}: must be one of {LIBRARIES}")
    return importlib.util.find_spec(lib) is not None


# The library adapters, re-exported under the names the callers use.
def flash_mla_sparse_decode(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`deepinfer_kernels.cuda.flash_mla_adapter.sparse_decode` (our V3.2 cache, positions)."""
    from deepinfer_kernels.cuda import flash_mla_adapter

    return flash_mla_adapter.sparse_decode(*args, **kwargs)


def deep_gemm_grouped_fp8(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor, masked: bool = True
) -> torch.Tensor:
    """Our MoE contract with FP8 checkpoint weights through DeepGEMM's masked (decode) or contiguous layout;
    see :mod:`deepinfer_kernels.cuda.deep_gemm_adapter`."""
    from deepinfer_kernels.cuda import deep_gemm_adapter as dga

    return (dga.grouped_fp8_masked if masked else dga.grouped_fp8_contiguous)(x, w8, w_scale, offs)


def deep_select_topk(x: torch.Tensor, k: int, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """deep_select.topk(x [b, n], k, sorted) -> (values, indices int64), rows shorter than k padded with
    (-inf, -1); see :mod:`deepinfer_kernels.cuda.deep_select_adapter`."""
    from deepinfer_kernels.cuda import deep_select_adapter

    return deep_select_adapter.topk(x, k, sorted)


def deep_ep_buffer(group: Any, **kwargs: Any) -> Any:
    """A DeepEP buffer for EP dispatch / combine over ``group`` (NVLink intranode; NVSHMEM for internode)."""
    de = _require("deep_ep")
    cls = getattr(de, "ElasticBuffer", None) or de.Buffer
    return cls(group, **kwargs)


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
