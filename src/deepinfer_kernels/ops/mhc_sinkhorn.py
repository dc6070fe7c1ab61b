"""Torch reference of ``mhc_sinkhorn``: the mHC residual-mixing matrices made doubly stochastic.

``mhc_sinkhorn(logits, iters)``: ``logits`` [..., n, n] (float32 / float64) -> ``exp(logits - row max)``
(a per-row factor the first row normalisation cancels exactly; a per-matrix max let a row ~88 below it
underflow to 0 / 0) normalised ``iters`` times, rows then columns, each sum floored at the dtype's smallest
normal; the same maths as ``deepinfer_core.model.mhc.sinkhorn``, written out here so the kernels package
does not import the model.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


@register("mhc_sinkhorn")
def mhc_sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits: must be [..., n, n], got shape {tuple(logits.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters={iters!r}: must be an integer >= 0")
    m = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    tiny = torch.finfo(m.dtype).tiny
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp_min(tiny)
        m = m / m.sum(-2, keepdim=True).clamp_min(tiny)
    return m
