"""TileLang ``moe_grouped_gemm``: the MoE's expert products over expert-sorted rows, for decode batches.

At decode batch sizes each expert sees a few dozen rows (B = 64, top-6 of 8: ~48), so the products are a
weight stream: on the H200 (wide config, 2026-12-01) ``torch._grouped_mm`` read the 3.4 GB of expert
weights a step at 66 % of copy bandwidth. Here the weights stream through a TMA pipeline.

Launch contract: grid (N / 128, E); CTA (nb, e) computes columns [128 nb, 128 nb + 128) of expert e's rows,
``offs[e - 1] .. offs[e]``, in tiles of 64 rows (a runtime loop: ceil(rows / 64) tiles, usually one), each
tile a 3-stage ``T.Pipelined`` loop over K in 64-wide blocks: x's rows (TMA, rows past the tensor read as
zeros) and the expert's weight block to shared memory, one wgmma GEMM into a [64, 128] fp32 fragment; the
tile's rows of the expert are stored (rows of the next expert inside the tile are not). Rows past
``offs[-1]`` are zeroed by the wrapper.

Shapes the kernel takes: bf16 / fp16, K a multiple of 64, N a multiple of 128; anything else takes the
reference (same contract).
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.ops import grouped_gemm as ref
from deepinfer_kernels.registry import register

_BM, _BN, _BK, _THREADS, _STAGES = 64, 128, 64, 128, 3


def _build(e: int, n: int, k: int, dtype: str):
    r_dyn = T.dynamic("r")
    acc = "float32"

    @T.prim_func
    def gg(
        x: T.Tensor((r_dyn, k), dtype),
        w: T.Tensor((e, n, k), dtype),
        offs: T.Tensor((e,), "int32"),
        out: T.Tensor((r_dyn, n), dtype),
    ):
        with T.Kernel(n // _BN, e, threads=_THREADS) as (nb, ex):
            a_sh = T.alloc_shared((_BM, _BK), dtype)
            b_sh = T.alloc_shared((_BN, _BK), dtype)
            c = T.alloc_fragment((_BM, _BN), acc)
            # the expert's rows as expressions over offs (an alloc_var assigned here was moved into the
            # producer branch by the warp specialisation, leaving the loop bound unset)
            lo = T.if_then_else(ex == 0, 0, offs[T.max(ex - 1, 0)])
            hi = offs[ex]
            for mt in T.serial(T.ceildiv(hi - lo, _BM)):
                T.clear(c)
                for kb in T.Pipelined(k // _BK, num_stages=_STAGES):
                    T.copy(x[lo + mt * _BM : lo + mt * _BM + _BM, kb * _BK : kb * _BK + _BK], a_sh)
                    T.copy(w[ex, nb * _BN : nb * _BN + _BN, kb * _BK : kb * _BK + _BK], b_sh)
                    T.gemm(a_sh, b_sh, c, transpose_B=True)
                for i, j in T.Parallel(_BM, _BN):
                    if lo + mt * _BM + i < hi:
                        out[lo + mt * _BM + i, nb * _BN + j] = c[i, j]

    return gg


def kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether these inputs run the kernel (else the reference)."""
    return (HAVE_TILELANG and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and w.dim() == 3 and x.shape[1] % _BK == 0 and w.shape[1] % _BN == 0 and x.shape[0] > 0)


@register("moe_grouped_gemm", "cuda")
def moe_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference; the shapes of :func:`kernel_takes` run the TileLang kernel (no host
    synchronisation: capturable in a CUDA graph)."""
    if not kernel_takes(x, w):
        return ref.moe_grouped_gemm(x, w, offs)
    r, k, e, n = ref.check_grouped_gemm_inputs(x, w, offs)
    # rows past the last expert's end are zero (the reference's contract); the kernel writes the others
    out = torch.zeros(r, n, dtype=x.dtype, device=x.device)
    kern = compile_kernel(("moe_grouped_gemm", e, n, k, torch_dtype_name(x.dtype)),
                          lambda: _build(e, n, k, torch_dtype_name(x.dtype)))
    kern(x.contiguous(), w.contiguous(), offs.to(device=x.device, dtype=torch.int32).contiguous(), out)
    return out
