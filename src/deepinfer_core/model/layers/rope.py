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
from deepinfer_core.model.layers.norm import rms_norm

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


@fusable
def _angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, r/2] in ``dtype`` of the float64 angles positions x inv_freq: one kernel under the
    glue (eagerly the cast, product, cos, sin and two casts are six)."""
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = _ANGLES.get()
    key = (id(positions), id(inv_freq), dtype)
    if (
        cache is not None
        and (hit := cache.get(key)) is not None
        and hit[0] is positions
        and hit[1] is inv_freq
    ):
        return hit[2], hit[3]
    cos, sin = _angles(positions, inv_freq.to(positions.device), dtype)
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


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, interleave: bool = True
) -> torch.Tensor:
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


def _rotated(tail: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The rotated copy of ``tail`` [T, ..., r] (a new tensor)."""
    shape = (cos.shape[0],) + (1,) * (tail.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    r = tail.shape[-1]
    h = r // 2
    if interleave:
        t = tail.reshape(*tail.shape[:-1], h, 2)
        a, b = t[..., 0], t[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).view(*tail.shape[:-1], r)
    a, b = tail[..., :h], tail[..., h:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleave: bool
) -> torch.Tensor:
    d = x.shape[-1]
    return torch.cat((x[..., : d - rope_dim], _rotated(x[..., d - rope_dim :], cos, sin, interleave)), dim=-1)


_rotate_fused = fusable(_rotate)


def apply_rope_(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, interleave: bool = True
) -> torch.Tensor:
    """:func:`apply_rope` in place: rotates ``x[..., d - rope_dim:]`` and returns ``x``; the other dims are
    neither read nor written. For a caller that owns ``x`` (a fresh projection nobody else holds): the
    functional form rewrites all d dims to rotate rope_dim (queries: 512 to rotate 64). Same values as
    :func:`apply_rope`, eagerly and under the fused glue (tested)."""
    if rope_dim == 0:
        return x
    tail = x[..., x.shape[-1] - rope_dim :]
    if torch.compiler.is_compiling():  # traced inside another fused function: the angles inline
        ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
        tail.copy_(_rotated(tail, torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype), interleave))
        return x
    cos, sin = _cos_sin(positions, inv_freq, x.dtype)
    if not glue_on():
        tail.copy_(_rotated(tail, cos, sin, interleave))
    elif (pairs := _bf16_pairs(tail, interleave)) is not None:
        _rotate_pairs_(pairs, cos, sin)
    else:
        _rotate_tail_(tail, cos, sin, interleave)
    return x


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    interleave: bool = True,
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), ...)``, a new tensor: under the fused glue one compiled
    function (the norm's rows rotated before they are stored: one kernel, where the norm and the in-place
    rotation were two); eagerly the norm then :func:`apply_rope_` on it (the reference's calls)."""
    if rope_dim == 0 or not glue_on():
        return apply_rope_(rms_norm(x, weight, eps), positions, inv_freq, rope_dim, interleave)
    cos, sin = _cos_sin(positions, inv_freq, x.dtype)
    return _norm_rotate(x, weight, eps, cos, sin, rope_dim, interleave)


@fusable
def _norm_rotate(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleave: bool,
) -> torch.Tensor:
    return _rotate(rms_norm(x, weight, eps), cos, sin, rope_dim, interleave)


@fusable
def _rotate_tail_(tail: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> None:
    # (the one fusable that mutates an argument, on purpose) compiled, the function sees only the tail
    # view, so the kernels touch rope_dim of the d dims; the rotation reads each element's partner, which
    # Inductor will not write in place in the same kernel (its fusion rule for a mutated input: read and
    # write at the same index), so this is two kernels: the rotation into a buffer, its copy into the tail.
    # :func:`_rotate_pairs_` is the one-kernel form for bf16 pairs
    tail.copy_(_rotated(tail, cos, sin, interleave))


def _bf16_pairs(tail: torch.Tensor, interleave: bool) -> torch.Tensor | None:
    """``tail`` (bf16, adjacent pairs) as int32 [..., r / 2], one element per pair (a view); None when it
    cannot be viewed so (another dtype, halves pairing, odd strides or offset)."""
    if tail.dtype != torch.bfloat16 or not interleave or tail.stride(-1) != 1 or tail.storage_offset() % 2:
        return None
    if any(st % 2 for st in tail.stride()[:-1]):
        return None
    try:  # rows [T * heads, r / 2]: see _rotate_pairs_
        return tail.view(torch.int32).view(-1, tail.shape[-1] // 2)
    except RuntimeError:  # heads not evenly strided (not a fresh projection's tail)
        return None


@fusable
def _rotate_pairs_(pairs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The interleaved rotation of bf16 pairs viewed as int32 rows [T * heads, r / 2] (overwritten), the
    angles cos / sin [T, r / 2] (row j of ``pairs`` is token j // heads).

    One element holds one (x[2i], x[2i+1]) pair (little-endian, as on x86 and CUDA: x[2i] in the low 16
    bits), so the kernel reads and writes every element at its own index, and Inductor mutates the tail
    in place in one kernel: its rule for fusing a write into a mutated input with the reads of it wants
    the same index expression, which a [T, heads, r / 2] iteration would not give (the write's loop
    merges T and heads, the angles' broadcast keeps them apart; seen on the CPU). A bf16 is the high half
    of the float32 of the same value, so the halves widen exactly by shifts; the products run in float32
    and round once to bf16 at the end, as in the compiled :func:`_rotate` (same expressions, same order:
    bitwise equal, tested)."""
    t, h = cos.shape
    heads = pairs.shape[0] // t
    c = cos.to(torch.float32)[:, None, :].expand(t, heads, h).reshape(t * heads, h)
    s = sin.to(torch.float32)[:, None, :].expand(t, heads, h).reshape(t * heads, h)
    a = (pairs << 16).view(torch.float32)
    b = (pairs & -65536).view(torch.float32)  # -65536 == 0xFFFF0000: the high half in place
    lo = (a * c - b * s).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    hi = (a * s + b * c).to(torch.bfloat16).view(torch.int16).to(torch.int32) << 16
    pairs.copy_(hi | lo)


def _rope_inline(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int, interleave: bool
) -> torch.Tensor:
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    return _rotate(x, torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype), rope_dim, interleave)
