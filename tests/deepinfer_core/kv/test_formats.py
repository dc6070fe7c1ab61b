"""Cache formats: exact byte sizes, layout decoded by an independent float64 numpy oracle, error bounds
on fresh random data, saturation instead of inf/NaN, clear errors on bad input."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from deepinfer_core.kv import formats as F

# ---------------------------------------------------------------- independent float64 decoders
# Written from the bit definitions (OCP FP8 / MX specs), not from formats.py's tables.


def dec_e2m1(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.int64)
    e, m = (c >> 1) & 3, c & 1
    mag = np.where(e == 0, m * 0.5, np.ldexp(1.0 + m / 2.0, e - 1))
    return np.where(c & 8, -mag, mag)


def dec_e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def dec_ue8m0(b: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, b.astype(np.int64) - 127)


def unpack(b: np.ndarray) -> np.ndarray:
    return np.stack((b & 15, b >> 4), axis=-1).reshape(*b.shape[:-1], -1)


def oracle(fmt: F.CacheFormat, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values float64 [n, dim], per-element scale float64 [n, dim]) decoded from the documented layout."""
    n, d = raw.shape[0], fmt.dim
    if fmt.name == "fp4":
        vals = dec_e2m1(unpack(raw[:, : d // 2]))
        sc = np.repeat(dec_e4m3(raw[:, d // 2 :]), 16, axis=1)
    elif fmt.name == "mxfp4":
        vals = dec_e2m1(unpack(raw[:, : d // 2]))
        sc = np.repeat(dec_ue8m0(raw[:, d // 2 :]), 32, axis=1)
    elif fmt.name == "fp8":
        vals = dec_e4m3(raw[:, :d])
        sc = np.repeat(dec_ue8m0(raw[:, d:]), 32, axis=1)
    elif fmt.name == "v32":
        vals = dec_e4m3(raw[:, :512])
        s32 = raw[:, 512:528].copy().view("<f4").astype(np.float64)
        rope = (raw[:, 528:].copy().view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
        sc = np.concatenate((np.repeat(s32, 128, axis=1), np.ones((n, 64))), axis=1)
        vals = np.concatenate((vals, rope), axis=1)
    else:
        raise AssertionError(fmt.name)
    return vals, sc


E2M1_GRID = np.unique(np.abs(dec_e2m1(np.arange(16))))
E4M3_POS = np.unique(dec_e4m3(np.arange(0, 0x7F)))  # every finite non-negative e4m3 value


def fresh(n: int, dim: int, group: int) -> tuple[torch.Tensor, int]:
    """Gaussian rows whose groups have log-uniform magnitudes over ~10 decades, plus outliers and zeros."""
    seed = secrets.randbits(32)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    mag = torch.exp(torch.empty(n, dim // group, 1, dtype=torch.float64).uniform_(-12, 12, generator=g))
    x = (x.reshape(n, dim // group, group) * mag).reshape(n, dim)
    x[0, :group] = 0.0  # an all-zero group
    x[1, 3] *= 50.0  # an outlier
    return x.float(), seed


QUANT = ["fp4", "fp8", "mxfp4", "v32"]


def test_exact_byte_sizes() -> None:
    assert F.get_format("fp4").bytes_per_token == 288
    assert F.get_format("fp8").bytes_per_token == 528
    assert F.SWA_RING.bytes_per_token == 528
    assert F.get_format("v32").bytes_per_token == 656
    assert F.get_format("mxfp4").bytes_per_token == 68
    assert F.get_format("bf16").bytes_per_token == 1024
    assert F.get_format("fp4", dim=64).bytes_per_token == 36  # tiny-config head_dim
    for name in [*QUANT, "bf16", "fp32"]:
        f = F.get_format(name)
        assert isinstance(f, F.CacheFormat)
        assert f.quantize(torch.randn(2, 3, f.dim)).shape == (2, 3, f.bytes_per_token)


@pytest.mark.parametrize("name", QUANT)
def test_layout_matches_float64_oracle(name: str) -> None:
    f = F.get_format(name)
    x, seed = fresh(64, f.dim, 64 if name == "v32" else 32)
    raw = f.quantize(x)
    vals, sc = oracle(f, raw.numpy())
    want = np.clip(vals * sc, -np.finfo(np.float32).max, np.finfo(np.float32).max).astype(np.float32)
    got = f.dequantize(raw).numpy()
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


def _group_view(a: np.ndarray, g: int) -> np.ndarray:
    return a.reshape(a.shape[0], -1, g)


@pytest.mark.parametrize("name", ["fp4", "mxfp4"])
def test_fp4_nearest_grid_and_scale_rule(name: str) -> None:
    f = F.get_format(name)
    g = 16 if name == "fp4" else 32
    x, seed = fresh(64, f.dim, g)
    raw = f.quantize(x).numpy()
    vals, sc = oracle(f, raw)
    x64 = x.double().numpy()
    amax = np.abs(_group_view(x64, g)).max(-1)
    s = _group_view(sc, g)[..., 0]
    if name == "fp4":
        # smallest e4m3 >= amax / 6 (floored at the smallest subnormal 2^-9): the max never clips
        # (groups with amax > 6 * 448 saturate: scale 448, values clipped to +-2688)
        sat = amax > 6 * 448
        assert sat.any() and (~sat).any(), seed  # the data covers both regimes
        assert (s[sat] == 448).all(), seed
        target = np.maximum(amax / 6.0, 2.0**-9)[~sat]
        assert (s[~sat] >= target * (1 - 1e-7)).all(), seed
        prev = E4M3_POS[np.searchsorted(E4M3_POS, s[~sat]) - 1]
        assert (prev < target).all(), seed
        # documented coarse bound: |err| <= scale <= max(amax * 9/48, amax/6 + 2^-9)
        bound = np.maximum(amax * 9 / 48, amax / 6 + 2.0**-9)[~sat]
        assert (s[~sat] <= bound * (1 + 1e-7)).all(), seed
        keep = np.repeat(~sat, g, axis=1)
    else:
        # smallest power of two 2^e with amax / 2^e <= 6
        assert (amax <= 6 * s).all() and ((amax > 3 * s) | (amax == 0) | (s == 2.0**-127)).all(), seed
        keep = np.ones_like(x64, dtype=bool)
    # each value is the nearest representable g * s (ties of measure zero on random data)
    cand = np.abs(x64[..., None] - np.sign(x64)[..., None] * E2M1_GRID * sc[..., None]).min(-1)
    err = np.abs(x64 - vals * sc)
    assert (err <= cand + 1e-12 * np.abs(x64) + 1e-300).all(), seed
    # |err| <= half the widest e2m1 gap (2) times the scale
    assert (err <= sc * (1 + 1e-6))[keep].all(), seed
    assert (np.abs(vals * sc) <= 6 * 448)[~keep].all(), seed


@pytest.mark.parametrize("name", ["fp8", "v32"])
def test_fp8_relative_error_bound(name: str) -> None:
    f = F.get_format(name)
    g = 32 if name == "fp8" else 128
    x, seed = fresh(64, f.dim, 32 if name == "fp8" else 64)
    raw = f.quantize(x)
    _vals, sc = oracle(f, raw.numpy())
    x64 = x.double().numpy()
    got = f.dequantize(raw).double().numpy()
    nd = 512
    err = np.abs(got[:, :nd] - x64[:, :nd])
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normals, 2^-10 * scale below 2^-6
    bound = np.maximum(np.abs(x64[:, :nd]) * 2.0**-4, sc[:, :nd] * 2.0**-10) * (1 + 1e-6)
    bound += np.abs(x64[:, :nd]) * 2.0**-23  # the float32 division x / scale (v32's fp32 scale)
    assert (err <= bound).all(), seed
    amax = np.abs(_group_view(x64[:, :nd], g)).max(-1)
    s = _group_view(sc[:, :nd], g)[..., 0]
    assert (amax <= 448 * s * (1 + 1e-6)).all(), seed  # nothing clips
    if name == "v32":  # RoPE part is plain bf16: 2^-8 relative
        r = np.abs(got[:, nd:] - x64[:, nd:])
        assert (r <= np.abs(x64[:, nd:]) * 2.0**-8).all(), seed


@pytest.mark.parametrize("name", [*QUANT, "bf16", "fp16", "fp32"])
def test_saturates_instead_of_inf_or_nan(name: str) -> None:
    f = F.get_format(name)
    x = torch.randn(4, f.dim)
    x[0, 0], x[1, 5], x[2, 7], x[3, :] = float("inf"), float("-inf"), 1e38, 1e30
    y = f.dequantize(f.quantize(x))
    assert torch.isfinite(y).all()
    assert y[0, 0] > 0 and y[1, 5] < 0 and y[2, 7] > 0
    if name == "fp4":
        assert y[0, 0] == 6 * 448 and y[1, 5] == -6 * 448  # e2m1 max times the e4m3 max scale
    if name == "fp16":
        assert y[0, 0] == 65504.0


@pytest.mark.parametrize("name", [*QUANT, "bf16", "fp32"])
def test_bad_input_is_rejected_clearly(name: str) -> None:
    f = F.get_format(name)
    x = torch.randn(2, f.dim)
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        f.quantize(x)
    with F.nan_check(False):  # the sync-free decode stores: no device readback, the NaN is stored
        assert f.quantize(x).shape[-1] == f.bytes_per_token
        with F.nan_check(True), pytest.raises(ValueError, match="NaN"):
            f.quantize(x)
    with pytest.raises(ValueError, match="NaN"):  # the default is back outside the blocks
        f.quantize(x)
    with pytest.raises(ValueError, match=f"last dim {f.dim}"):
        f.quantize(torch.randn(2, f.dim + 1))
    with pytest.raises(TypeError, match="float"):
        f.quantize(torch.ones(2, f.dim, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"{f.bytes_per_token} bytes"):
        f.dequantize(torch.zeros(2, f.bytes_per_token - 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        f.dequantize(torch.zeros(2, f.bytes_per_token))


def test_format_construction_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        F.FP4Format(dim=48)
    with pytest.raises(ValueError, match="allowed"):
        F.get_format("int4")


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_raw_formats_are_exact(name: str, dtype: torch.dtype) -> None:
    f = F.get_format(name, dim=96)
    x = torch.randn(5, 7, 96).to(dtype)
    assert torch.equal(f.dequantize(f.quantize(x)), x.float())


@pytest.mark.parametrize("name", F.FORMATS)
def test_torch_free_sizes_agree(name: str) -> None:
    from deepinfer_core.kv.sizes import bytes_per_token

    dims = [576, 704] if name == "v32" else [64, 128, 512]
    for d in dims:
        assert bytes_per_token(name, d) == F.get_format(name, d).bytes_per_token


@pytest.mark.gpu
@pytest.mark.parametrize("name", F.FORMATS)
def test_reference_is_bit_identical_on_cuda(name: str) -> None:
    # The torch reference is the byte contract for device kernels: it must give the same bytes on CUDA.
    f = F.get_format(name)
    x, seed = fresh(257, f.dim, 64 if name == "v32" else 16)
    x[5, 3], x[6, 4] = float("inf"), -1e30
    cpu = f.quantize(x)
    gpu = f.quantize(x.cuda())
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu), f"seed {seed}"
    assert torch.equal(f.dequantize(gpu).cpu(), f.dequantize(cpu)), f"seed {seed}"


def test_e2m1_ties_round_toward_zero() -> None:
    # The documented tie rule (device kernels match it): exact midpoints take the smaller magnitude.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = dec_e2m1(np.arange(7))  # codes 0..6 = 0, .5, 1, 1.5, 2, 3, 4
    got = F.e2m1_decode(F.e2m1_encode(torch.cat([mids, -mids]))).double().numpy()
    np.testing.assert_array_equal(got, np.concatenate([want, -want]))
    assert F.e2m1_encode(torch.tensor([-0.1])).item() == 0  # no negative zero
