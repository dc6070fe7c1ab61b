"""Rotary position embedding on the last ``rope_dim`` dims of a head, with optional YaRN frequencies.

(choice, config ``rope_interleave``) Pairs are adjacent dims (x[2i], x[2i+1]) rotated as one complex
number, as in the DeepSeek-V3 reference code; ``rope_interleave=False`` rotates the two halves instead. Angles are computed from integer positions on
the fly, so there is no precomputed table and no maximum length.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(rope_dim: int, base: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] in float64; YaRN blends interpolated and original ones."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    inv = 1.0 / (base ** (i / rope_dim))
    if scaling is None:
        return inv
    factor = float(scaling.get("factor", 1.0))
    orig = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))

    def corr_dim(num_rot: float) -> float:
        return rope_dim * math.log(orig / (num_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(beta_fast)), 0)
    hi = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 where the original (high) frequency is kept
    return inv / factor * (1 - keep) + inv * keep


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
               interleave: bool = True) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of ``x`` [T, ..., d] by ``positions`` [T]; returns a new tensor.

    ``interleave``: pairs are adjacent dims (2i, 2i+1); otherwise dim i pairs with i + rope_dim/2.
    """
    if rope_dim == 0:
        return x
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, r/2]
    shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (ang.shape[1],)
    cos = torch.cos(ang).to(x.dtype).view(shape)
    sin = torch.sin(ang).to(x.dtype).view(shape)
    d, h = x.shape[-1], rope_dim // 2
    tail = x[..., d - rope_dim :]
    if interleave:
        t = tail.reshape(*x.shape[:-1], h, 2)
        a, b = t[..., 0], t[..., 1]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).view(*x.shape[:-1], rope_dim)
    else:
        a, b = tail[..., :h], tail[..., h:]
        rot = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((x[..., : d - rope_dim], rot), dim=-1)
