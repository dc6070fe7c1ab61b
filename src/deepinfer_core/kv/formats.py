"""Byte-exact KV cache formats (torch reference; device kernels must produce the same bytes).

Every format is a frozen object with ``name``, ``dim``, ``bytes_per_token``, ``quantize(x[..., dim]) ->
uint8[..., bytes_per_token]`` and ``dequantize(uint8[..., bytes]) -> float32[..., dim]``. Layouts are
little-endian, values first, then scales (then RoPE for V3.2):

=========  ==========================================================  ============
format     per token (dim = 512 unless noted)                          bytes
=========  ==========================================================  ============
``fp4``    dim/2 B packed e2m1 (low nibble = even index) + dim/16 e4m3    288
           scales (one per 16 values)
``fp8``    dim B e4m3 + dim/32 ue8m0 scales (one per 32); SWA ring       528
``v32``    512 e4m3 + 4 fp32 scales (one per 128) + 64 bf16 RoPE          656
           (dim = 576: 512 quantised + 64 RoPE kept in bf16; FlashMLA's bytes)
``mxfp4``  dim/2 B packed e2m1 + dim/32 ue8m0 scales; indexer keys       68 (dim 128)
``bf16``   raw bf16 bytes (exact for bf16 inputs)                     2 * dim
``fp32``   raw fp32 bytes (exact)                                     4 * dim
=========  ==========================================================  ============

Scales are chosen so the block maximum never clips (``fp4``: the e4m3 scale is amax/6 rounded *up* to
the next e4m3 value; ``fp8``/``mxfp4``: the power of two 2^ceil(log2(amax / max_elem)); ``v32``:
FlashMLA's 2^ceil(log2(max(amax / 448, 1e-4))) in float32); values are
then rounded to the nearest grid point. Inputs beyond the format's range (including +-inf) saturate to
the largest finite value; NaN is rejected with ValueError. Error bounds are in docs/kv.md and tested
in tests/deepinfer_core/kv/test_formats.py against a float64 decoder.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
# e2m1 magnitudes by 3-bit code, and the midpoints used for round-to-nearest.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
UE8M0_BIAS = 127


@runtime_checkable
class CacheFormat(Protocol):
    """A per-token byte format of cached vectors."""

    @property
    def name(self) -> str:
        """The format's name (``FORMATS``)."""
        ...

    @property
    def dim(self) -> int:
        """Values per token."""
        ...

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's ``dim`` values occupy."""
        ...

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] (any float dtype) -> uint8 [..., bytes_per_token]."""
        ...

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        """uint8 [..., bytes_per_token] -> float32 [..., dim]."""
        ...


# ---------------------------------------------------------------- element codecs


# the NaN check reads a flag back from the device: a synchronisation, not allowed inside a CUDA graph
# capture; the executor's sync-free decode stores turn it off (their inputs are the model's own keys)
_NAN_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("kv_nan_check", default=True)


@contextlib.contextmanager
def nan_check(on: bool) -> Iterator[None]:
    """``quantize`` refuses NaN input inside this block only when ``on`` (the default outside any block);
    with it off a NaN is stored as the codec's NaN code (decoding it is unspecified)."""
    tok = _NAN_CHECK.set(bool(on))
    try:
        yield
    finally:
        _NAN_CHECK.reset(tok)


def _check_input(x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}.quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}.quantize: x must be a float tensor, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != dim:
        raise ValueError(f"{name}.quantize: x must have last dim {dim}, got shape {tuple(x.shape)}")
    x = x.to(torch.float32)
    if _NAN_CHECK.get() and torch.isnan(x).any():
        raise ValueError(f"{name}.quantize: x contains NaN (cannot be saturated)")
    # +-inf and out-of-range values saturate; clamping to the float32 range keeps amax finite.
    return x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)


def _check_bytes(b: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8:
        raise TypeError(
            f"{name}.dequantize: expected a uint8 tensor, got {getattr(b, 'dtype', type(b).__name__)}"
        )
    if b.ndim == 0 or b.shape[-1] != nbytes:
        raise ValueError(f"{name}.dequantize: last dim must be {nbytes} bytes, got shape {tuple(b.shape)}")
    return b.contiguous()


@functools.lru_cache(maxsize=64)
def _const(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on ``device``, made once: a fresh ``torch.tensor`` per call would copy it
    from the host every time (a device synchronisation, and not allowed inside a CUDA graph capture)."""
    return torch.tensor(values, dtype=dtype, device=device)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float (already divided by the scale) -> 4-bit codes in uint8: the nearest e2m1 value with ties
    toward zero (not round-half-even), saturating at +-6. Device kernels must match this tie rule."""
    mag = v.abs().clamp(max=E2M1_MAX)
    code = torch.bucketize(mag, _const(tuple(_E2M1_MID), mag.dtype, mag.device), right=False)
    sign = (v < 0) & (code > 0)  # no negative zero: keeps bytes canonical
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    grid = _const(tuple(_E2M1_GRID), torch.float32, code.device)
    mag = grid[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] 4-bit codes -> [..., k] bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn bytes, round to nearest even, saturating at +-448."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_round_up(s: torch.Tensor) -> torch.Tensor:
    """Smallest e4m3 value >= s (s >= 0, s <= 448), as bytes. Used for scales so the max never clips."""
    b = e4m3_encode(s)
    low = (e4m3_decode(b) < s) & (b < 0x7E)  # 0x7E = 448, the largest finite e4m3
    return torch.where(low, b + 1, b).to(torch.uint8)  # positive e4m3 codes are monotone in value


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded once, on every device. torch's CUDA division by a Python scalar multiplies by the
    rounded reciprocal (1/448 is inexact), which can differ from the CPU's true division in the last bit;
    dividing by a tensor on the same device is a correctly rounded division everywhere."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def pow2_scale_exponent(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """Smallest e with amax / 2^e <= elem_max, clamped to the ue8m0 range [-127, 127] (int32)."""
    y = _div(amax.to(torch.float64), elem_max)
    mant, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # exact powers of two need no extra step
    e = torch.where(y > 0, e, torch.full_like(e, -UE8M0_BIAS))
    return e.clamp(-UE8M0_BIAS, UE8M0_BIAS).to(torch.int32)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(
        torch.ones(b.shape, dtype=torch.float64, device=b.device), b.to(torch.int32) - UE8M0_BIAS
    )


def _to_f32_saturated(t: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 without overflowing to inf (a scale of 2^127 can exceed the float32 range)."""
    fmax = torch.finfo(torch.float32).max
    return t.clamp(-fmax, fmax).float()


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def _check_dim(name: str, dim: int, multiple: int) -> None:
    if not isinstance(dim, int) or dim <= 0 or dim % multiple:
        raise ValueError(f"{name}: dim must be a positive multiple of {multiple}, got {dim!r}")


# ---------------------------------------------------------------- formats


@attrs.frozen
class FP4Format:
    """e2m1 values, one e4m3 scale per 16 values (main compressed KV): dim/2 + dim/16 bytes."""

    dim: int = 512
    group: int = 16
    name: str = "fp4"

    def __attrs_post_init__(self) -> None:
        _check_dim(self.name, self.dim, 2 * self.group)

    @property
    def bytes_per_token(self) -> int:
        return self.dim // 2 + self.dim // self.group

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x = _groups(_check_input(x, self.dim, self.name), self.group)
        amax = x.abs().amax(dim=-1, keepdim=True)
        s = _div(amax, E2M1_MAX).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
        sb = e4m3_round_up(s)
        codes = e2m1_encode(x / e4m3_decode(sb))
        vals = pack_nibbles(codes.flatten(-2))
        return torch.cat((vals, sb.squeeze(-1)), dim=-1)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        b = _check_bytes(b, self.bytes_per_token, self.name)
        half = self.dim // 2
        vals = _groups(e2m1_decode(unpack_nibbles(b[..., :half])), self.group)
        scale = e4m3_decode(b[..., half:]).unsqueeze(-1)
        return (vals * scale).flatten(-2)


@attrs.frozen
class FP8Format:
    """e4m3 values, one ue8m0 (power-of-two) scale per 32 values: dim + dim/32 bytes. Also the SWA ring."""

    dim: int = 512
    group: int = 32
    name: str = "fp8"

    def __attrs_post_init__(self) -> None:
        _check_dim(self.name, self.dim, self.group)

    @property
    def bytes_per_token(self) -> int:
        return self.dim + self.dim // self.group

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x = _groups(_check_input(x, self.dim, self.name), self.group)
        e = pow2_scale_exponent(x.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
        # Divide in float64: 2^-127 scales are subnormal in float32.
        vals = e4m3_encode(
            (x.to(torch.float64) / torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)).float()
        )
        return torch.cat((vals.flatten(-2), (e + UE8M0_BIAS).to(torch.uint8).squeeze(-1)), dim=-1)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        b = _check_bytes(b, self.bytes_per_token, self.name)
        vals = _groups(e4m3_decode(b[..., : self.dim]), self.group).to(torch.float64)
        scale = ue8m0_decode(b[..., self.dim :]).unsqueeze(-1)
        return _to_f32_saturated((vals * scale).flatten(-2))


@attrs.frozen
class MXFP4Format:
    """OCP-MX-style e2m1 values with one ue8m0 scale per 32 (indexer keys): dim/2 + dim/32 bytes.

    Differs from the OCP default scale rule (floor(log2 amax) - 2, which clips the top of the block to 6)
    by rounding the exponent up so nothing clips; see docs/kv.md.
    """

    dim: int = 128
    group: int = 32
    name: str = "mxfp4"

    def __attrs_post_init__(self) -> None:
        _check_dim(self.name, self.dim, self.group)

    @property
    def bytes_per_token(self) -> int:
        return self.dim // 2 + self.dim // self.group

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x = _groups(_check_input(x, self.dim, self.name), self.group)
        e = pow2_scale_exponent(x.abs().amax(dim=-1, keepdim=True), E2M1_MAX)
        codes = e2m1_encode(
            (x.to(torch.float64) / torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)).float()
        )
        return torch.cat(
            (pack_nibbles(codes.flatten(-2)), (e + UE8M0_BIAS).to(torch.uint8).squeeze(-1)), dim=-1
        )

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        b = _check_bytes(b, self.bytes_per_token, self.name)
        half = self.dim // 2
        vals = _groups(e2m1_decode(unpack_nibbles(b[..., :half])), self.group).to(torch.float64)
        scale = ue8m0_decode(b[..., half:]).unsqueeze(-1)
        return _to_f32_saturated((vals * scale).flatten(-2))


# V3.2 scale rules. "pow2" is FlashMLA's reference quantiser (tests/quant.py, since January 2026): the
# float32 scale is 2^ceil(log2(max(amax / 448, 1e-4))), so the FP8 bytes are FlashMLA's and an all-zero
# tile gets the floor's scale 2^-13. "amax" is the earlier rule (the tile maximum maps exactly to 448).
V32_SCALE_RULES = ("pow2", "amax")
V32_SCALE_FLOOR = 1e-4  # FlashMLA's floor on amax / 448 (HFAI FP8's FP8_AMAX_MARGIN)


def v32_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's V3.2 tile scale: 2^ceil(log2(max(amax / 448, 1e-4))) as float32.

    amax / 448 is a correctly rounded float32 division and the floor is float32(1e-4), as in the
    published rule; the ceiling of log2 is taken exactly, from the float32 exponent (a float32 ``log2``
    can round a value a few ulps above a power of two down to the integer, which would make the tile's
    maximum exceed 448 after the division). Powers of two keep their exponent; the result is in
    [2^-13, 2^120] for finite float32 inputs, so the division by it is exact and nothing clips.
    """
    y = _div(amax.to(torch.float32), E4M3_MAX)
    y = torch.maximum(y, torch.full((), V32_SCALE_FLOOR, dtype=torch.float32, device=y.device))
    mant, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(y), e).to(torch.float32)


@attrs.frozen
class V32Format:
    """DeepSeek-V3.2 FP8 KV (FlashMLA's ``V32_FP8Sparse`` layout): 512 e4m3 (one fp32 scale per 128) +
    64 bf16 RoPE = 656 B.

    ``scale_rule="pow2"`` (default) writes FlashMLA's bytes: power-of-two scales
    (:func:`v32_pow2_scale`); ``"amax"`` the earlier amax / 448 scales. Either decodes with the same
    rule (value x scale), so caches written under either read back the same way.
    """

    dim: int = 576
    rope_dim: int = 64
    group: int = 128
    name: str = "v32"
    scale_rule: str = "pow2"

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.rope_dim, int) or not 0 <= self.rope_dim < self.dim:
            raise ValueError(f"{self.name}: rope_dim must be in [0, dim), got {self.rope_dim!r}")
        _check_dim(self.name, self.dim - self.rope_dim, self.group)
        if self.scale_rule not in V32_SCALE_RULES:
            raise ValueError(
                f"{self.name}: scale_rule must be one of {list(V32_SCALE_RULES)}, got {self.scale_rule!r}"
            )

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        return self.nope_dim + 4 * (self.nope_dim // self.group) + 2 * self.rope_dim

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 scale of every 128-value tile of ``x [..., dim]``: [..., nope_dim / 128]."""
        return self._scales(_check_input(x, self.dim, self.name))

    def _scales(self, x: torch.Tensor) -> torch.Tensor:
        amax = _groups(x[..., : self.nope_dim], self.group).abs().amax(dim=-1)
        if self.scale_rule == "pow2":
            return v32_pow2_scale(amax)
        # the tile maximum maps exactly to 448; the tiny floor keeps all-zero tiles finite
        return _div(amax, E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        # _check_input clamps to the finite float32 range first: an inf would make the tile scale inf and
        # inf/inf a NaN whose fp8 byte differs between CPU and CUDA; saturating keeps the bytes defined.
        x = _check_input(x, self.dim, self.name)
        nope, rope = _groups(x[..., : self.nope_dim], self.group), x[..., self.nope_dim :]
        scale = self._scales(x).unsqueeze(-1)
        vals = e4m3_encode(nope / scale).flatten(-2)
        sbytes = scale.squeeze(-1).contiguous().view(torch.uint8)
        bf_max = torch.finfo(torch.bfloat16).max
        rbytes = rope.clamp(-bf_max, bf_max).to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat((vals, sbytes, rbytes), dim=-1)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        b = _check_bytes(b, self.bytes_per_token, self.name)
        n, ng = self.nope_dim, self.nope_dim // self.group
        vals = _groups(e4m3_decode(b[..., :n]), self.group)
        scale = b[..., n : n + 4 * ng].contiguous().view(torch.float32).unsqueeze(-1).to(torch.float64)
        rope = b[..., n + 4 * ng :].contiguous().view(torch.bfloat16).float()
        return torch.cat((_to_f32_saturated((vals * scale).flatten(-2)), rope), dim=-1)


@attrs.frozen
class RawFormat:
    """No quantisation: the raw bytes of bf16 or fp32 values (lets exactness tests switch FP4/FP8 off)."""

    dim: int = 512
    dtype: torch.dtype = torch.bfloat16
    name: str = "bf16"

    def __attrs_post_init__(self) -> None:
        _check_dim(self.name, self.dim, 1)
        if self.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"{self.name}: dtype must be bfloat16, float16 or float32, got {self.dtype}")

    @property
    def bytes_per_token(self) -> int:
        return self.dim * self.dtype.itemsize

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x, self.dim, self.name)
        if self.dtype != torch.float32:  # saturate instead of overflowing to inf
            fmax = torch.finfo(self.dtype).max
            x = x.clamp(-fmax, fmax)
        return x.to(self.dtype).contiguous().view(torch.uint8)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        return _check_bytes(b, self.bytes_per_token, self.name).view(self.dtype).float()


FORMATS = ("fp4", "fp8", "v32", "mxfp4", "bf16", "fp16", "fp32")


def get_format(name: str, dim: int | None = None) -> CacheFormat:
    """Format by name with its default dim (main KV 512, indexer 128, v32 576) unless ``dim`` is given."""
    kw: dict[str, Any] = {} if dim is None else {"dim": dim}
    if name == "fp4":
        return FP4Format(**kw)
    if name == "fp8":
        return FP8Format(**kw)
    if name == "mxfp4":
        return MXFP4Format(**kw)
    if name == "v32":
        return V32Format(**kw)
    if name in ("bf16", "fp16", "fp32"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
        return RawFormat(dtype=dt, name=name, **kw)
    raise ValueError(f"unknown cache format {name!r}; allowed: {', '.join(FORMATS)}")


# The released model's formats, named by role.
MAIN_KV_FP4 = FP4Format()
MAIN_KV_FP8 = FP8Format()
SWA_RING = FP8Format()
INDEXER_MXFP4 = MXFP4Format()
V32_KV = V32Format()
