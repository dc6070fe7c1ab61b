"""RMSNorm (computed in at least float32, returned in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.model.fusion import fusable


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in >= float32, returned in x's dtype."""
    dt = x.dtype
    xf = x if dt == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(dt)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight. V4.1 uses eps 1e-20, so the sum is done in >= float32 to stay finite."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
