"""TileLang ``mhc_sinkhorn``: one thread per n x n matrix, all ``iters`` normalisations in registers.

The torch loop launches 4 kernels per iteration (row sum, divide, column sum, divide): 80 launches for
V4.1's 20 iterations, per layer (one call covers both sublayers with ``hc_single_pass``), about a quarter
of the wide config's ~2,000 kernels in a replayed decode step (H200 profile, 2026-12-01). Here the matrix
(16 floats for hc_mult 4) stays in registers: one launch, one read and one write of the logits.

Same maths as the reference; sums are formed left to right (torch's reduction order over 4 values is its
own) and each row / column is scaled by one reciprocal of its sum instead of n divisions (an IEEE fp32
division is a ~20-instruction sequence; with one thread per matrix the kernel is a latency chain of
them: 23 us a call for the wide config's 128 matrices at B = 64 on the H200, 2026-12-01), so results agree
to float32 rounding, not bit for bit (tested with a tolerance). fp32 only; float64 (precision runs) takes
the reference.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel
from deepinfer_kernels.ops import mhc_sinkhorn as ref
from deepinfer_kernels.registry import register

_THREADS = 128
_TINY = 1.1754943508222875e-38  # float32's smallest normal: the reference's floor on every sum


def _build(n: int, iters: int):
    m_dyn = T.dynamic("m")
    nn = n * n

    @T.prim_func
    def sinkhorn(x: T.Tensor((m_dyn, nn), "float32"), out: T.Tensor((m_dyn, nn), "float32")):
        with T.Kernel(T.ceildiv(m_dyn, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            a = T.alloc_local((nn,), "float32")
            mx = T.alloc_var("float32")
            s = T.alloc_var("float32")
            i = bx * _THREADS + tx
            if i < m_dyn:
                for r in T.unroll(n):  # each row's max (the reference's rule: no row underflows to 0 / 0)
                    mx = x[i, r * n]
                    for c in T.unroll(1, n):
                        mx = T.max(mx, x[i, r * n + c])
                    for c in T.unroll(n):
                        a[r * n + c] = T.exp(x[i, r * n + c] - mx)
                for _it in T.serial(iters):
                    for r in T.unroll(n):
                        s = a[r * n]
                        for c in T.unroll(1, n):
                            s = s + a[r * n + c]
                        s = 1.0 / T.max(s, _TINY)
                        for c in T.unroll(n):
                            a[r * n + c] = a[r * n + c] * s
                    for c in T.unroll(n):
                        s = a[c]
                        for r in T.unroll(1, n):
                            s = s + a[r * n + c]
                        s = 1.0 / T.max(s, _TINY)
                        for r in T.unroll(n):
                            a[r * n + c] = a[r * n + c] * s
                for j in T.unroll(nn):
                    out[i, j] = a[j]

    return sinkhorn


@register("mhc_sinkhorn", "cuda")
def mhc_sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Same contract as the reference; float32 CUDA inputs run the kernel (no host synchronisation:
    capturable in a CUDA graph), anything else the reference."""
    if (
        not HAVE_TILELANG
        or logits.device.type != "cuda"
        or logits.dtype != torch.float32
        or logits.dim() < 2
        or logits.shape[-1] != logits.shape[-2]
        or isinstance(iters, bool)
        or not isinstance(iters, int)
        or iters < 0
    ):
        return ref.mhc_sinkhorn(logits, iters)
    n = logits.shape[-1]
    x = logits.reshape(-1, n * n).contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        compile_kernel(("mhc_sinkhorn", n, iters), lambda: _build(n, iters))(x, out)
    return out.view(logits.shape)
