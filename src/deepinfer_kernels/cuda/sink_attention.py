"""TileLang ``sink_attention_rows``: a decode row's MQA attention over its window and top-k keys in one kernel.

Replaces, per attention layer of a decode step, the two batched GEMMs (q.k and p.v over the gathered keys)
and the softmax glue between them: on the H200 at B = 64 (wide config, 2026-12-01) those were 20 + 8 us a
compressed layer plus ~10 us of softmax kernels, the q.k GEMM reading the [64, 512, 512] bf16 keys once and
the p.v GEMM again.

Launch contract: ``keys`` [N, K, D] is one key set per row (the decode path gathers the window and the
top-k keys into one buffer with ``kv_gather(out=, col=)``; two sets given to the op are concatenated
first), ``mask`` [N, K] bool. Grid (D / 256, N); CTA (c, n) computes output dims [256 c, 256 c + 256) of
row n for all H = 64 heads, with 256 threads of two consumer warpgroups (each takes half of every GEMM's
N: the logits' 64 key columns, then the 256 output dims) and, as TileLang 0.1.15 lowers the 2-stage
``T.Pipelined`` key loop, a third producer warpgroup issuing TMA loads into double-buffered shared memory:

- q [H, D] of the row goes to shared memory once, as the CTA's own 256 dims and the other 256;
- per block of 64 keys: the block's own and other halves to shared memory, ``s = q_own k_own^T + q_oth
  k_oth^T`` (two wgmma GEMMs into one fp32 [H, 64] fragment), masked keys to -inf, the online softmax
  (running max and sum per head; the sink starts them: max = sink, sum = 1, so a row with every key
  masked ends at 0 / 1 = 0, never NaN), then ``o = o * alpha + p k_own`` (p cast to the key dtype, as a
  softmax's output would be, and staged in shared memory: each warpgroup holds half of its columns, and
  the product needs whole rows);
- ``o / sum`` cast to q's dtype.

Both CTAs of a row compute the same logits (the q.k work is done twice; the keys are read twice, the
second time mostly from L2); in exchange the grid has 2N CTAs (128 at B = 64, the H200 has 132 SMs) and the
fp32 output fragment is 64 x 256 (64 registers a thread) instead of 64 x 512. Compiled for sm_90a on a
GPU-less machine (scripts/tl_compile.py): 168 registers, no spill. With two key sources in the loop
TileLang did not pipeline it (synchronous copies), hence the one buffer.

Shapes the kernel takes: bf16 / fp16, H = 64, D = 512, K a multiple of 64. Anything else takes the
reference (same contract). Masks are bool; passed to the kernel as uint8 views.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.ops import sink_attention as ref
from deepinfer_kernels.registry import register

_H, _D, _HALF, _BS, _THREADS = 64, 512, 256, 64, 256


def _build(k_len: int, scale: float, dtype: str):
    n_dyn = T.dynamic("n")
    acc = "float32"

    @T.prim_func
    def attn(
        q: T.Tensor((n_dyn, _H, _D), dtype),
        keys: T.Tensor((n_dyn, k_len, _D), dtype),
        mask: T.Tensor((n_dyn, k_len), "uint8"),
        sink: T.Tensor((_H,), acc),
        out: T.Tensor((n_dyn, _H, _D), dtype),
    ):
        with T.Kernel(_D // _HALF, n_dyn, threads=_THREADS) as (c, bx):
            q_own = T.alloc_shared((_H, _HALF), dtype)
            q_oth = T.alloc_shared((_H, _HALF), dtype)
            k_own = T.alloc_shared((_BS, _HALF), dtype)
            k_oth = T.alloc_shared((_BS, _HALF), dtype)
            o_sh = T.alloc_shared((_H, _HALF), dtype)
            p_sh = T.alloc_shared((_H, _BS), dtype)
            s = T.alloc_fragment((_H, _BS), acc)
            o = T.alloc_fragment((_H, _HALF), acc)
            m = T.alloc_fragment((_H,), acc)
            m_prev = T.alloc_fragment((_H,), acc)
            alpha = T.alloc_fragment((_H,), acc)
            rsum = T.alloc_fragment((_H,), acc)
            den = T.alloc_fragment((_H,), acc)  # the softmax denominator
            T.copy(q[bx, 0:_H, c * _HALF : c * _HALF + _HALF], q_own)
            T.copy(q[bx, 0:_H, (1 - c) * _HALF : (1 - c) * _HALF + _HALF], q_oth)
            T.fill(o, 0)
            for i in T.Parallel(_H):
                m[i] = sink[i]
                den[i] = T.float32(1)
            for kb in T.Pipelined(k_len // _BS, num_stages=2):
                T.copy(keys[bx, kb * _BS : kb * _BS + _BS, c * _HALF : c * _HALF + _HALF], k_own)
                T.copy(keys[bx, kb * _BS : kb * _BS + _BS, (1 - c) * _HALF : (1 - c) * _HALF + _HALF], k_oth)
                T.clear(s)
                T.gemm(q_own, k_own, s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(q_oth, k_oth, s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(_H, _BS):
                    s[i, j] = T.if_then_else(mask[bx, kb * _BS + j] != 0, s[i, j] * scale, -T.infinity(acc))
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(_H):
                    alpha[i] = T.exp(m_prev[i] - m[i])
                for i, j in T.Parallel(_H, _BS):
                    s[i, j] = T.exp(s[i, j] - m[i])
                T.reduce_sum(s, rsum, dim=1)
                for i in T.Parallel(_H):
                    den[i] = den[i] * alpha[i] + rsum[i]
                for i, j in T.Parallel(_H, _HALF):
                    o[i, j] = o[i, j] * alpha[i]
                T.copy(s, p_sh)
                T.gemm(p_sh, k_own, o, policy=T.GemmWarpPolicy.FullCol)
            for i, j in T.Parallel(_H, _HALF):
                o[i, j] = o[i, j] / den[i]
            T.copy(o, o_sh)
            T.copy(o_sh, out[bx, 0:_H, c * _HALF : c * _HALF + _HALF])

    return attn


def kernel_takes(q: torch.Tensor, k_a: torch.Tensor, k_b: torch.Tensor | None) -> bool:
    """Whether these inputs run the kernel (else the reference)."""
    n_keys = k_a.shape[1] + (0 if k_b is None else k_b.shape[1]) if k_a.dim() == 3 else 0
    return (
        HAVE_TILELANG
        and q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.dim() == 3
        and q.shape[1] == _H
        and q.shape[2] == _D
        and k_a.dim() == 3
        and n_keys > 0
        and n_keys % _BS == 0
    )


@register("sink_attention_rows", "cuda")
def sink_attention_rows(
    q: torch.Tensor,
    k_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as the reference; the shapes of :func:`kernel_takes` run the TileLang kernel (no host
    synchronisation: capturable in a CUDA graph). The kernel reads one key set: given two, they are
    concatenated first (a copy; the decode path gathers both into one buffer instead, ``kv_gather(out=)``)."""
    if not kernel_takes(q, k_a, k_b):
        return ref.sink_attention_rows(q, k_a, mask_a, k_b, mask_b, sink, scale)
    n, _, _ = ref.check_sink_attention_inputs(q, k_a, mask_a, k_b, mask_b, sink)
    out = torch.empty_like(q)
    if n == 0:
        return out
    keys = k_a if k_b is None else torch.cat([k_a, k_b], 1)
    mask = mask_a if k_b is None else torch.cat([mask_a, mask_b], 1)  # type: ignore[list-item]
    k_len = keys.shape[1]
    dt = torch_dtype_name(q.dtype)
    kern = compile_kernel(
        ("sink_attention_rows", k_len, float(scale), dt), lambda: _build(k_len, float(scale), dt)
    )
    kern(
        q.contiguous(),
        keys.contiguous(),
        mask.contiguous().view(torch.uint8),
        sink.to(torch.float32).contiguous(),
        out,
    )
    return out
