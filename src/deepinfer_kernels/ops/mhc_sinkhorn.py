"""Torch reference of ``mhc_sinkhorn``: the mHC residual-mixing matrices made doubly stochastic.

``mhc_sinkhorn(logits, iters)``: ``logits`` [..., n, n] (float32 / float64) -> ``exp(logits - max)`` (the
per-matrix max, a common factor the first normalisation cancels) normalised ``iters`` times, rows then
columns; the same maths as ``deepinfer_core.model.mhc.sinkhorn``, written out here so the kernels package
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
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m
