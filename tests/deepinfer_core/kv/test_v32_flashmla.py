"""The V3.2 656-byte format writes FlashMLA's bytes: power-of-two tile scales
2^ceil(log2(max(amax / 448, 1e-4))) (FlashMLA's reference quantiser, tests/quant.py), e4m3 values
round-to-nearest-even, then the fp32 scales, then the RoPE part in bf16.

The oracle here is written from that published rule and the OCP e4m3 bit definition with numpy and
Python floats (no formats.py code): an exhaustive nearest-value search over the 127 finite e4m3
magnitudes, ties to the even code. Bytes are pinned for hand-made tokens (worked out by hand in the
comments) and compared with the oracle on random tokens; the decoder is checked against FlashMLA's
decoding rule (fp8 value x fp32 scale, RoPE read as bf16).
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import pytest
import torch

from deepinfer_core.kv import formats as F


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """(value, code) of every finite non-negative e4m3fn code, from the bit definition."""
    codes = np.arange(0x7F)  # 0x7F is NaN
    e, m = codes >> 3, codes & 7
    vals = np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1.0 + m / 8.0, e - 7))
    return vals, codes


E4M3_VALS, E4M3_CODES = _e4m3_table()


def oracle_e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value (ties to the even code), saturating at 448; the sign bit for every
    v < 0, a negative value that rounds to zero included (an IEEE-style cast keeps the sign: FlashMLA casts
    with torch's ``.to(torch.float8_e4m3fn)``, which writes 0x80 there)."""
    mag = np.minimum(np.abs(v), 448.0)
    d = np.abs(mag[..., None] - E4M3_VALS)
    best = d.min(-1, keepdims=True)
    cand = d == best
    # among tied candidates, the even code (there are at most two, adjacent codes)
    even = cand & (E4M3_CODES % 2 == 0)
    pick = np.where(even.any(-1, keepdims=True), even, cand).argmax(-1)
    code = E4M3_CODES[pick]
    return np.where(v < 0, code | 0x80, code).astype(np.uint8)


def oracle_scale(tile: np.ndarray) -> float:
    """FlashMLA's published rule, with float32 amax / 448 and float32(1e-4) as in its reference."""
    y = np.float32(np.abs(tile).max()) / np.float32(448.0)
    y = max(y, np.float32(1e-4))
    return 2.0 ** math.ceil(math.log2(float(y)))  # float64 log2 of a float32: exact enough to ceil


def oracle_bytes(x: np.ndarray) -> np.ndarray:
    """One token [576] float32 -> its 656 bytes."""
    vals, scales = [], []
    for t in range(4):
        tile = x[128 * t : 128 * (t + 1)].astype(np.float64)
        s = oracle_scale(tile)
        scales.append(s)
        vals.append(oracle_e4m3(tile / s))  # a power of two: the division is exact
    sbytes = np.asarray(scales, dtype="<f4").view(np.uint8)
    rope = torch.from_numpy(x[512:].copy()).to(torch.bfloat16).view(torch.uint8).numpy()
    return np.concatenate([*vals, sbytes, rope])


def test_pinned_bytes_for_known_tokens() -> None:
    x = torch.zeros(576)
    x[0], x[1], x[2] = 1.0, -0.5, 0.0078125  # tile 0: amax 1 -> 1/448 = 2^-8.8 -> scale 2^-8
    # tile 1 stays all zero: amax / 448 = 0 -> the floor 1e-4 = 2^-13.3 -> scale 2^-13
    x[256], x[257] = 448.0, -448.0  # tile 2: amax / 448 = 1 exactly -> scale 1 (a power of two keeps it)
    x[384] = 1e-6  # tile 3: below the floor -> scale 2^-13; 1e-6 * 2^13 = 0.008192 -> subnormal 4 * 2^-9
    x[512], x[513] = 1.0, -2.0  # RoPE in bf16
    b = F.get_format("v32").quantize(x[None]).numpy()[0]
    assert b.shape == (656,)
    # e4m3fn: 2^8 = exponent 15, mantissa 0 -> 0x78; -2^7 -> 0x80 | 0x70; 2^-7 * 2^8 = 2 -> 0x40
    assert b[:4].tolist() == [0x78, 0xF0, 0x40, 0x00]
    assert not b[128:256].any()  # the all-zero tile: +0 codes
    assert b[256:259].tolist() == [0x7E, 0xFE, 0x00]  # +-448 is the largest finite e4m3
    assert b[384] == 0x04 and not b[385:512].any()
    # fp32 little-endian scales 2^-8, 2^-13, 1, 2^-13
    assert b[512:528].tolist() == [0, 0, 0x80, 0x3B, 0, 0, 0, 0x39, 0, 0, 0x80, 0x3F, 0, 0, 0, 0x39]
    assert b[528:532].tolist() == [0x80, 0x3F, 0x00, 0xC0]  # bf16 1.0, -2.0
    assert not b[532:].any()
    np.testing.assert_array_equal(b, oracle_bytes(x.numpy()))
    # the earlier rule (amax / 448, kept as an option) maps tile 0's maximum to 448 exactly
    old = F.V32Format(scale_rule="amax").quantize(x[None]).numpy()[0]
    assert old[0] == 0x7E and old[512:516].view("<f4")[0] == np.float32(1.0) / np.float32(448.0)


def test_power_of_two_boundaries() -> None:
    # amax exactly 448 * 2^k keeps 2^k; one float32 ulp above needs the next power (nothing may clip)
    f = F.get_format("v32")
    for k in (-12, -5, -1, 0, 3, 10):
        at = np.float32(448.0 * 2.0**k)
        above = np.nextafter(at, np.float32(np.inf), dtype=np.float32)
        x = torch.zeros(2, 576)
        x[0, 0], x[1, 0] = float(at), float(above)
        s = f.scales(x)[:, 0].double().numpy()
        assert s[0] == 2.0**k and s[1] == 2.0 ** (k + 1), (k, s)
        assert f.quantize(x)[0, 0].item() == 0x7E  # the maximum maps to 448 exactly
    z = f.scales(torch.zeros(1, 576))
    assert torch.equal(z, torch.full((1, 4), 2.0**-13))


def test_random_tokens_match_the_published_rule_byte_for_byte() -> None:
    seed = secrets.randbits(32)
    g = torch.Generator().manual_seed(seed)
    n = 24
    x = torch.randn(n, 576, generator=g)
    mag = torch.exp(torch.empty(n, 4, 1).uniform_(-14, 8, generator=g))  # tiles from below the floor to large
    x[:, :512] = (x[:, :512].reshape(n, 4, 128) * mag).reshape(n, 512)
    x[1, :128] = 0.0
    x = x.to(torch.bfloat16).float()  # FlashMLA quantises a bf16 cache
    got = F.get_format("v32").quantize(x).numpy()
    want = np.stack([oracle_bytes(row) for row in x.numpy()])
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


def test_decode_equals_flashmla_decode_rule() -> None:
    # FlashMLA's dequantiser: value = fp8(byte) * fp32 scale of its tile; RoPE read back as bf16
    seed = secrets.randbits(32)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(seed)) * 3
    f = F.get_format("v32")
    raw = f.quantize(x)
    r = raw.numpy()
    mag = E4M3_VALS[r[:, :512] & 0x7F]
    vals = np.where(r[:, :512] & 0x80, -mag, mag)
    sc = np.repeat(r[:, 512:528].copy().view("<f4").astype(np.float64), 128, axis=1)
    rope = torch.from_numpy(r[:, 528:].copy()).view(torch.bfloat16).float().numpy()
    want = np.concatenate([vals * sc, rope], axis=1).astype(np.float32)
    got = f.dequantize(raw).numpy()
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    # both scale rules decode with the same rule and stay within e4m3's half-ulp of the input
    for rule in F.V32_SCALE_RULES:
        g = F.V32Format(scale_rule=rule)
        y = g.dequantize(g.quantize(x))
        err = (y[:, :512] - x[:, :512]).abs()
        s = torch.repeat_interleave(g.scales(x), 128, dim=1)
        assert bool((err <= torch.maximum(x[:, :512].abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)).all()), seed
        assert torch.equal(y[:, 512:], x[:, 512:].to(torch.bfloat16).float())


def test_scale_rule_is_validated() -> None:
    with pytest.raises(ValueError, match=r"scale_rule must be one of \['pow2', 'amax'\]"):
        F.V32Format(scale_rule="fp32")
    assert F.get_format("v32").scale_rule == "pow2" and F.V32_KV.scale_rule == "pow2"
