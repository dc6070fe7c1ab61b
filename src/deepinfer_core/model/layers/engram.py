"""Engram layer: hashed n-gram rows mixed into every residual stream through a per-stream gate.

The rows come from the ``engram`` component (hasher + an ``EngramTable``: local, host or sharded, the
executor's choice); this module only turns the fetched rows ``e`` [T, orders * heads * head_dim] into
the update ``h_i += g_i * v`` with ``v = W_v e`` (shared) and, per stream i, ``k_i = W_k[i] e`` and
``g_i = sigmoid(signed_sqrt(<norm(h_i), norm(k_i)> / sqrt(D)))`` (v41_flash.md). One key projection per
stream and a shared value follow the Engram paper's multi-branch form. The short causal convolution of
the paper is not modelled (uncertain for V4.1; docs/model.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.norm import RMSNorm, rms_norm


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.sqrt(x.abs())


@fusable
def _gate(
    st: torch.Tensor,
    k: torch.Tensor,
    h_w: torch.Tensor,
    k_w: torch.Tensor,
    h_eps: float,
    k_eps: float,
    scale: float,
) -> torch.Tensor:
    """Gate [T, n] of each stream ``st`` [T, n, D] from its key product ``k`` [T, n, D]."""
    s = (rms_norm(st, h_w, h_eps) * rms_norm(k, k_w, k_eps)).sum(-1) * scale
    return torch.sigmoid(signed_sqrt(s))


@fusable
def _gated_update(
    st: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h_w: torch.Tensor,
    k_w: torch.Tensor,
    h_eps: float,
    k_eps: float,
    scale: float,
) -> torch.Tensor:
    """``st + g * v`` with the gates g of :func:`_gate` and the value ``v`` [T, D]: the norms, the dot, the
    gate and the update in one fused kernel under the glue (eagerly ~12)."""
    return st + _gate(st, k, h_w, k_w, h_eps, k_eps, scale)[..., None] * v[:, None, :]


class EngramLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        d = cfg.hidden_size
        self.row_dim = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.w_v = nn.Parameter(torch.empty(d, self.row_dim))
        self.w_k = nn.Parameter(torch.empty(cfg.hc_mult, d, self.row_dim))
        self.h_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(d)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        for p in (self.w_v, self.w_k):
            p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) / math.sqrt(self.row_dim))
        for n in (self.h_norm, self.k_norm):
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape, generator=gen, device=gen.device))

    def gates(self, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Gate [T, n] of each stream (``state`` [T, n, D]) for fetched rows [T, row_dim]."""
        return _gate(state, torch.einsum("te,nde->tnd", rows, self.w_k), *self._gate_args())

    def _gate_args(self) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
        return self.h_norm.weight, self.k_norm.weight, self.h_norm.eps, self.k_norm.eps, self.scale

    def forward(self, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``state`` [T, n, D] (or [T, D] for a plain residual) updated with the rows [T, row_dim]."""
        flat = state.dim() == 2
        st = state[:, None, :] if flat else state
        k = torch.einsum("te,nde->tnd", rows, self.w_k)
        out = _gated_update(st, k, rows @ self.w_v.t(), *self._gate_args())
        return out[:, 0] if flat else out
