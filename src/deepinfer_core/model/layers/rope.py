"""Rotary position embedding on the last ``rope_dim`` dims of a head, with optional YaRN frequencies.

(choice, config ``rope_interleave``) Pairs are adjacent dims (x[2i], x[2i+1]) rotated as one complex
number, as in the DeepSeek-V3 reference code; ``rope_interleave=False`` rotates the two halves instead. Angles are computed from integer positions on
the fly, so there is no precomputed table and no maximum length.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch

from deepinfer_core.model.fusion import fusable, glue_on

# (positions, inv_freq, dtype) -> (positions, inv_freq, cos, sin) inside :func:`cached_angles`; the key
# tensors are kept in the value so their ids cannot be reused while the cache lives
_ANGLES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("rope_angles", default=None)


@contextlib.contextmanager
def cached_angles() -> Iterator[None]:
    """Inside this block :func:`apply_rope` computes cos / sin once per (positions, inv_freq, dtype):
    a decode step ropes queries, keys and indexer queries at the same positions in every layer, and each
    fresh computation is 6 kernels (the executor's sync-free step uses it; same values)."""
    tok = _ANGLES.set({})
    try:
        yield
    finally:
        _ANGLES.reset(tok)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cache = _ANGLES.get()
    key = (id(positions), id(inv_freq), dtype)
    if cache is not None and (hit := cache.get(key)) is not None and hit[0] is positions and hit[1] is inv_freq:
        return hit[2], hit[3]
    pkey = (id(positions), "f64")  # the float64 positions once too (other frequencies reuse them)
    if cache is not None and (hit := cache.get(pkey)) is not None and hit[0] is positions:
        pos64 = hit[1]
    else:
        pos64 = positions.to(torch.float64)
        if cache is not None:
            cache[pkey] = (positions, pos64)
    ang = pos64[:, None] * inv_freq.to(positions.device)[None, :]  # [T, r/2]
    cos, sin = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)
    if cache is not None:
        cache[key] = (positions, inv_freq, cos, sin)
    return cos, sin


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
    if torch.compiler.is_compiling():  # traced inside another fused function: the angles inline
        return _rope_inline(x, positions, inv_freq, rope_dim, interleave)
    cos, sin = _cos_sin(positions, inv_freq, x.dtype)
    if glue_on():
        # fused glue: the rotation is one kernel, the angles stay a per-row table (cached per step):
        # computed inside the kernel they would be float64 cos / sin once per head and element
        return _rotate_fused(x, cos, sin, rope_dim, interleave)
    return _rotate(x, cos, sin, rope_dim, interleave)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleave: bool) -> torch.Tensor:
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
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


_rotate_fused = fusable(_rotate)


def _rope_inline(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
                interleave: bool) -> torch.Tensor:
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    return _rotate(x, torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype), rope_dim, interleave)
