"""Every KV kernel variant (1, 2 or 4 scale groups a thread) and codec path (hardware / integer fp8,
threshold / division e2m1) against the torch reference, byte for byte (stores) and value for value
(loads); benchmarks/kernels.py times them side by side."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu

FORMATS = [("fp8", 512, 528), ("fp4", 512, 288), ("mxfp4", 128, 68), ("fp8", 128, 132), ("fp4", 64, 36)]
VARIANTS = ["group", "group2", "group4", "lanes", "bf16x2i4"]


def _ck():  # type: ignore[no-untyped-def]
    from deepinfer_kernels.cuda import _tl
    from deepinfer_kernels.cuda import kv_store as ck

    assert _tl.HAVE_TILELANG, "tilelang must import on the GPU machine"
    assert tuple(VARIANTS) == ck.VARIANTS
    return ck


def _paths(fmt: str) -> list[tuple[bool | None, bool | None]]:
    """(hw_fp8, fast_e2m1) pairs: both fp8 codecs; both e2m1 codecs (fp4: with the hardware / integer
    e4m3 scale byte)."""
    if fmt == "fp8":
        return [(True, None), (False, None)]
    return [(True, True), (False, False)] if fmt == "fp4" else [(None, True), (None, False)]


def _rows(n: int, dim: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows over many magnitudes (1e-6 .. 1e4) with an all-zero group, a huge value and e2m1 midpoints."""
    x = torch.randn(n, dim, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-14, 9, generator=g))
    if n:
        x[0, :32] = 0.0
        x[-1, 5] = 3.0e5
        x[n // 2, 40:48] = 2.5
        x[n // 3, 8:16] = -1e-30  # tiny group: scale exponent clamps at -127
    return x.to(dtype).cuda()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("fmt", "dim", "bpt"), FORMATS)
@pytest.mark.parametrize("n", [1, 97, 1000])
def test_store_variant_bytes_exact(
    variant: str, fmt: str, dim: int, bpt: int, dtype: torch.dtype, n: int
) -> None:
    ck = _ck()
    ref = get_op("kv_store", "reference")
    g = torch.Generator().manual_seed(n * 131 + bpt + dim)
    slots_total = max(2 * n, 64)
    pool = torch.randint(0, 256, (slots_total, bpt), dtype=torch.uint8, generator=g).cuda()
    x = _rows(n, dim, g, dtype)
    slots = torch.randperm(slots_total, generator=g)[:n]
    if n > 3:
        slots[1] = -1  # padding tokens: not stored
        slots[-1] = -5
    slots = slots.cuda()
    want = ref(pool.clone(), x, slots, fmt)
    for hw, fast in _paths(fmt):
        got = pool.clone()
        ck.store_slots(got, x, slots, fmt, hw_fp8=hw, variant=variant, fast_e2m1=fast)
        assert torch.equal(got, want), (
            f"{variant} hw={hw} fast_e2m1={fast}: {(got != want).sum().item()} bytes differ"
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "dim", "bpt"), FORMATS)
def test_gather_variant_exact(variant: str, fmt: str, dim: int, bpt: int, out_dtype: torch.dtype) -> None:
    ck = _ck()
    store, ref_load = get_op("kv_store", "reference"), get_op("kv_load", "reference")
    g = torch.Generator().manual_seed(bpt * 7 + dim)
    blocks, bs = 20, 16
    pool = torch.zeros(blocks, bs, bpt, dtype=torch.uint8, device="cuda")
    store(pool, _rows(blocks * bs, dim, g, torch.float32), torch.arange(blocks * bs).cuda(), fmt)
    table = torch.randint(0, blocks, (5, 4), dtype=torch.int32, generator=g).cuda()
    lens = torch.tensor([0, 1, 17, 64, 41]).cuda()
    want = ref_load(pool, table, lens, fmt, dim, out_dtype)
    t = torch.arange(4 * bs).cuda()
    slots = (table.long()[:, t // bs] * bs + t % bs).masked_fill(t[None, :] >= lens[:, None], -1).reshape(-1)
    for hw, fast in _paths(fmt):
        got = ck.gather_slots(
            pool.view(-1, bpt), slots, fmt, dim, out_dtype, hw=hw, variant=variant, fast_e2m1=fast
        ).view(5, 4 * bs, dim)
        assert torch.equal(got, want), (
            f"{variant} hw={hw} fast_e2m1={fast}: {(got != want).sum().item()} values differ"
        )
    assert ck.gather_slots(pool.view(-1, bpt), slots[:0], fmt, dim, out_dtype, variant=variant).shape == (
        0,
        dim,
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("hw", [True, False])
def test_fp8_decoders_every_byte_every_scale(variant: str, hw: bool) -> None:
    """All e4m3 bytes but the NaNs under every scale code a store writes (0..254); hw=True is the float32
    decoder with its code >= 247 float64 guard (HW_FP8_DECODE)."""
    ck = _ck()
    fmt = __import__("deepinfer_core.kv.formats", fromlist=["FP8Format"]).FP8Format()
    rows = torch.zeros(255, 528, dtype=torch.uint8)
    vals = (torch.arange(512)[None, :] + torch.arange(255)[:, None]) % 256
    vals = torch.where((vals & 0x7F) == 0x7F, vals ^ 1, vals)
    rows[:, :512] = vals.to(torch.uint8)
    rows[:, 512:] = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 16)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = ck.gather_slots(
            rows.cuda(), torch.arange(255).cuda(), "fp8", 512, out_dtype, hw=hw, variant=variant
        ).cpu()
        want = fmt.dequantize(rows).to(out_dtype)
        assert torch.equal(got, want), (
            f"{variant} hw={hw} {out_dtype}: {(got != want).sum().item()} values differ"
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fast", [True, False])
def test_fp4_decoders_every_byte_every_scale(variant: str, fast: bool) -> None:
    """All 256 code pairs under every e4m3 scale byte a store writes (0..126): the float16-bit decoder
    (fast_e2m1) and the select chain, against the reference."""
    ck = _ck()
    fmt = __import__("deepinfer_core.kv.formats", fromlist=["FP4Format"]).FP4Format()
    rows = torch.zeros(127, 288, dtype=torch.uint8)
    rows[:, :256] = ((torch.arange(256)[None, :] + torch.arange(127)[:, None]) % 256).to(torch.uint8)
    rows[:, 256:] = torch.arange(127, dtype=torch.uint8)[:, None].expand(127, 32)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = ck.gather_slots(
            rows.cuda(), torch.arange(127).cuda(), "fp4", 512, out_dtype, variant=variant, fast_e2m1=fast
        ).cpu()
        want = fmt.dequantize(rows).to(out_dtype)
        assert torch.equal(got, want), (
            f"{variant} fast={fast} {out_dtype}: {(got != want).sum().item()} values differ"
        )
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("variant", VARIANTS)
def test_public_ops_follow_the_module_flags(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_store / kv_load / ring ops with the module-level variant flipped: what a one-line promotion gives."""
    ck = _ck()
    monkeypatch.setattr(ck, "STORE_VARIANT", variant)
    monkeypatch.setattr(ck, "LOAD_VARIANT", variant)
    store, store_ref = get_op("kv_store", "cuda"), get_op("kv_store", "reference")
    load, load_ref = get_op("kv_load", "cuda"), get_op("kv_load", "reference")
    g = torch.Generator().manual_seed(99)
    for fmt, dim, bpt in FORMATS[:3]:
        pool = torch.zeros(24, 16, bpt, dtype=torch.uint8, device="cuda")
        x = _rows(301, dim, g, torch.bfloat16)
        slots = torch.randperm(24 * 16, generator=g)[:301].cuda()
        want = store_ref(pool.clone(), x, slots, fmt)
        assert torch.equal(store(pool.clone(), x, slots, fmt), want)
        assert torch.equal(store(pool.clone(), x, slots, fmt, check=False), want)
        table = torch.randint(0, 24, (3, 5), dtype=torch.int32, generator=g).cuda()
        lens = torch.tensor([80, 1, 33]).cuda()
        assert torch.equal(
            load(want, table, lens, fmt, dim, torch.bfloat16),
            load_ref(want, table, lens, fmt, dim, torch.bfloat16),
        )
    with pytest.raises(ValueError, match="variant: must be one of"):
        ck.store_slots(pool.view(-1, 68), x, slots, "mxfp4", variant="warp")
