"""The identities the CUDA e2m1 codecs rest on, checked exhaustively on the CPU in IEEE float32.

``_codecs.e2m1_thresholds``: for a scale ``s`` that is an e4m3 value or a power of two, the reference's
``e2m1_encode(x / s)`` (a correctly rounded float32 division, then counting midpoints below it) equals
counting the exact thresholds ``mid * s`` below ``|x|``. ``_codecs.e2m1_as_half``: the e2m1 bits placed
in a float16 read as the value times 2**-14. The kernels are compared with the reference on the GPU; this
test shows the arithmetic holds at every scale and at the floats next to every threshold, where a
random test would almost never look.
"""

from __future__ import annotations

import torch

from deepinfer_core.kv import formats as F

E2M1_MIDS = F._E2M1_MID  # the kernels use the same constants (_codecs imports them)


def _threshold_codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: a binary search over the seven float32 products mid * s."""
    th = torch.tensor(E2M1_MIDS, dtype=torch.float32)[None, :] * s[:, None]  # [S, 7], float32 products
    a = x.abs()
    hi = a > th[:, 3:4]
    m1 = a > torch.where(hi, th[:, 5:6], th[:, 1:2])
    m2 = a > torch.where(hi, torch.where(m1, th[:, 6:7], th[:, 4:5]), torch.where(m1, th[:, 2:3], th[:, 0:1]))
    code = hi.to(torch.uint8) * 4 + m1.to(torch.uint8) * 2 + m2.to(torch.uint8)
    return code | (((x < 0) & (code > 0)).to(torch.uint8) << 3)


def _near_thresholds(s: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per scale: each threshold, its float32 neighbours (2 ulps each way), negatives, zero, random values."""
    th = torch.tensor(E2M1_MIDS, dtype=torch.float32)[None, :] * s[:, None]
    cols = [th]
    up, down = th, th
    for _ in range(2):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        cols += [up, down]
    rnd = torch.rand(s.shape[0], 64, generator=g) * 7.0 * s[:, None]
    x = torch.cat([*cols, rnd, torch.zeros(s.shape[0], 1), (th * 1.3)], dim=1)
    return torch.cat([x, -x], dim=1)


def test_fp4_thresholds_equal_division_at_every_e4m3_scale() -> None:
    g = torch.Generator().manual_seed(20261130)
    codes = torch.arange(1, 127, dtype=torch.uint8)  # every positive finite e4m3 value a scale can take
    s = F.e4m3_decode(codes)
    x = _near_thresholds(s, g)
    want = F.e2m1_encode(x / s[:, None])  # the reference: float32 division, midpoint count, ties down
    got = _threshold_codes(x, s)
    assert torch.equal(got, want), f"{(got != want).sum().item()} codes differ"


def test_mxfp4_thresholds_equal_float64_scaling_at_every_power_of_two() -> None:
    g = torch.Generator().manual_seed(7)
    e = torch.arange(-127, 127)
    s64 = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e)
    s = s64.float()  # 2**-127 is a float32 subnormal, held exactly
    assert torch.equal(s.double(), s64)
    x = _near_thresholds(s, g)
    finite = torch.isfinite(x).all(dim=1)  # near 2**126 the larger thresholds overflow to inf, which is right
    x = torch.where(torch.isfinite(x), x, torch.finfo(torch.float32).max)
    want = F.e2m1_encode((x.double() / s64[:, None]).float())  # the reference's mxfp4 path
    got = _threshold_codes(x, s)
    assert finite.sum() > 200
    assert torch.equal(got, want), f"{(got != want).sum().item()} codes differ"


def test_e2m1_code_as_float16_bits() -> None:
    codes = torch.arange(16, dtype=torch.int32)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    half = bits.to(torch.int16).view(torch.float16).float()
    want = F.e2m1_decode(codes.to(torch.uint8))
    got = half * 2.0**14
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # code 8 is -0.0 in both
