"""TileLang ``apply_token_bitmask``: logits [rows, vocab] masked in place by an int32 bitmask [rows, words].

One thread per logit, ``_BLOCK`` logits per CTA along the vocabulary, one CTA row per logits row (or per
entry of ``rows``, the spec-rows / mixed-batch layout where only some rows are constrained). The 32 lanes
of a warp read one bitmask word (a broadcast), so the mask costs 1/32 of a logit read per element. The
kernel only *writes* disallowed logits, like xgrammar's: the bytes moved are one read of the logits and
the mask plus one write per masked token. Vocabulary columns past ``32 * words`` are disallowed, as in
the reference. Kernels are specialised on (vocab, words, dtype, indexed) and symbolic in the row count.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import (
    HAVE_TILELANG,
    KERNEL_DTYPES,
    T,
    compile_kernel,
    require_cuda,
    torch_dtype_name,
)
from deepinfer_kernels.ops.token_bitmask import apply_token_bitmask as _reference
from deepinfer_kernels.ops.token_bitmask import check_inputs
from deepinfer_kernels.registry import register

_BLOCK = 1024
_THREADS = 256


def _build(vocab: int, words: int, dtype: str, indexed: bool):
    rows = T.dynamic("rows")
    n_idx = T.dynamic("n_idx")
    block = _BLOCK

    if indexed:

        @T.prim_func
        def masked_rows(
            logits: T.Tensor((rows, vocab), dtype),
            mask: T.Tensor((rows, words), "int32"),
            idx: T.Tensor((n_idx,), "int64"),
        ):
            with T.Kernel(T.ceildiv(vocab, block), n_idx, threads=_THREADS) as (bx, by):
                r = idx[by]
                for i in T.Parallel(block):
                    v = bx * block + i
                    if v < vocab:
                        if v // 32 >= words:  # noqa: SIM114 - `or` would read the mask out of bounds
                            logits[r, v] = -T.infinity(dtype)
                        elif ((mask[r, v // 32] >> (v % 32)) & 1) == 0:
                            logits[r, v] = -T.infinity(dtype)

        return masked_rows

    @T.prim_func
    def all_rows(logits: T.Tensor((rows, vocab), dtype), mask: T.Tensor((rows, words), "int32")):
        with T.Kernel(T.ceildiv(vocab, block), rows, threads=_THREADS) as (bx, by):
            for i in T.Parallel(block):
                v = bx * block + i
                if v < vocab:
                    if v // 32 >= words:  # noqa: SIM114 - `or` would read the mask out of bounds
                        logits[by, v] = -T.infinity(dtype)
                    elif ((mask[by, v // 32] >> (v % 32)) & 1) == 0:
                        logits[by, v] = -T.infinity(dtype)

    return all_rows


@register("apply_token_bitmask", "cuda")
def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as the reference (in place, returns ``logits``); CUDA tensors, float32/bf16/fp16."""
    if not HAVE_TILELANG or logits.device.type != "cuda" or logits.dtype not in KERNEL_DTYPES:
        return _reference(logits, bitmask, rows)
    check_inputs(logits, bitmask)
    if not logits.is_contiguous():
        raise ValueError("logits: must be contiguous (the kernel masks in place)")
    dtype = torch_dtype_name(logits.dtype)
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    require_cuda("bitmask", bitmask)
    n_rows, vocab = logits.shape
    words = bitmask.shape[1]
    if rows is None:
        if n_rows == 0 or vocab == 0:
            return logits
        kern = compile_kernel(
            ("bitmask", vocab, words, dtype, False), lambda: _build(vocab, words, dtype, False)
        )
        kern(logits, bitmask)
        return logits
    idx = torch.as_tensor(rows).to(device=logits.device, dtype=torch.int64)
    if idx.dim() != 1:
        raise ValueError(f"rows: must be a 1-D index tensor, got shape {tuple(idx.shape)}")
    if idx.numel() == 0 or vocab == 0:
        return logits
    # Bounds are checked on the device side by one reduction; a bad index must not write out of bounds.
    lo, hi = torch.aminmax(idx)
    if int(lo) < 0 or int(hi) >= n_rows:
        raise IndexError(f"rows: indices must be in [0, {n_rows}), got [{int(lo)}, {int(hi)}]")
    kern = compile_kernel(("bitmask", vocab, words, dtype, True), lambda: _build(vocab, words, dtype, True))
    kern(logits, bitmask, idx.contiguous())
    return logits
