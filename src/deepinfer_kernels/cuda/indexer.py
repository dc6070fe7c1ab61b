"""TileLang ``indexer_scores`` (+ ``indexer_topk`` through torch.topk); DeepGEMM's ``fp8_mqa_logits`` and
DeepSelect's top-k in their place where ``DEEPINFER_KERNEL_LIBS`` selects them (``libs.switch``).

One CTA per (query token, block of ``_BS`` keys): Q_t [H, D] and the key block [BS, D] go to shared
memory, one tensor-core GEMM gives the [H, BS] head logits in fp32, then relu, the per-head weights and a
reduction over heads give BS scores. Blocks entirely outside the query's key range are filled with -inf
without the GEMM (causal prefill skips about half). A variant streaming 8 key blocks per CTA through a
2-stage ``T.Pipelined`` loop measured slower on the H200 (55 vs 107 TFLOP/s at 2048 x 16384, 32 x 128),
fewer CTAs hiding less latency, so it was dropped. bf16 / fp16 inputs; float32 inputs take the reference
(tensor cores would round them to tf32, so "within tolerance" would silently mean tf32), and so do head
counts that are not a multiple of 16 (the MMA tile's M; the tiny test config has 4 index heads).
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.libs.switch import enabled
from deepinfer_kernels.ops import indexer as ref
from deepinfer_kernels.registry import register

_BS = 64
_THREADS = 128


def _build(h: int, d: int, dtype: str):
    t_dyn = T.dynamic("t")
    s_dyn = T.dynamic("s")

    @T.prim_func
    def scores(
        q: T.Tensor((t_dyn, h, d), dtype),
        w: T.Tensor((t_dyn, h), "float32"),
        keys: T.Tensor((s_dyn, d), dtype),
        ks: T.Tensor((t_dyn,), "int32"),
        ke: T.Tensor((t_dyn,), "int32"),
        out: T.Tensor((t_dyn, s_dyn), "float32"),
    ):
        with T.Kernel(T.ceildiv(s_dyn, _BS), t_dyn, threads=_THREADS) as (bx, by):
            q_sh = T.alloc_shared((h, d), dtype)
            k_sh = T.alloc_shared((_BS, d), dtype)
            acc = T.alloc_fragment((h, _BS), "float32")
            red = T.alloc_fragment((_BS,), "float32")
            lo = ks[by]
            hi = ke[by]
            if (bx * _BS < hi) & (bx * _BS + _BS > lo):
                T.copy(q[by, 0:h, 0:d], q_sh)
                T.copy(keys[bx * _BS : bx * _BS + _BS, 0:d], k_sh)
                T.clear(acc)
                T.gemm(q_sh, k_sh, acc, transpose_B=True)
                for i, j in T.Parallel(h, _BS):
                    acc[i, j] = T.max(acc[i, j], T.float32(0)) * w[by, i]
                T.reduce_sum(acc, red, dim=0)
                for j in T.Parallel(_BS):
                    s = bx * _BS + j
                    if s < s_dyn:
                        out[by, s] = T.if_then_else((s >= lo) & (s < hi), red[j], -T.infinity("float32"))
            else:
                for j in T.Parallel(_BS):
                    s = bx * _BS + j
                    if s < s_dyn:
                        out[by, s] = -T.infinity("float32")

    return scores


@register("indexer_scores", "cuda")
def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor
) -> torch.Tensor:
    """Same contract as the reference; bf16 / fp16 q and keys run the TileLang kernel (fp32 accumulation),
    or DeepGEMM's ``fp8_mqa_logits`` where selected (32 or 64 heads: q and keys rounded to FP8)."""
    if (
        enabled("deep_gemm")
        and q.device.type == "cuda"
        and q.dim() == 3
        and q.shape[1] in (32, 64)
        and q.shape[2] in (32, 64, 128)
    ):
        from deepinfer_kernels.cuda import deep_gemm_adapter

        ref.check_indexer_inputs(q, weights, keys, key_start, key_end)
        return deep_gemm_adapter.mqa_logits(q, weights, keys, key_start, key_end)
    if (
        not HAVE_TILELANG
        or q.device.type != "cuda"
        or q.dtype not in (torch.bfloat16, torch.float16)
        or keys.dtype != q.dtype
        or q.dim() != 3
        or q.shape[1] % 16  # the tensor-core tile needs M (heads) a multiple of 16: tiny configs use torch
    ):
        return ref.indexer_scores(q, weights, keys, key_start, key_end)
    t, h, d, s = ref.check_indexer_inputs(q, weights, keys, key_start, key_end)
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t == 0 or s == 0:
        return out
    dt = torch_dtype_name(q.dtype)
    kern = compile_kernel(("indexer", h, d, dt), lambda: _build(h, d, dt))
    kern(
        q.contiguous(),
        weights.to(torch.float32).contiguous(),
        keys.contiguous(),
        key_start.to(q.device, torch.int32).contiguous(),
        key_end.to(q.device, torch.int32).contiguous(),
        out,
    )
    return out


@register("indexer_topk", "cuda")
def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """DeepSelect's top-k where selected (bf16 / float32 scores, k <= 4096; unsorted, -1 after the valid
    ones), else the torch.topk reference."""
    if (
        enabled("deep_select")
        and scores.device.type == "cuda"
        and scores.dim() == 2
        and scores.dtype in (torch.bfloat16, torch.float32)
        and isinstance(k, int)
        and 1 <= k <= 4096
    ):
        from deepinfer_kernels.cuda import deep_select_adapter

        return deep_select_adapter.indexer_topk(scores, k)
    return ref.indexer_topk(scores, k)
