"""cuda KV store / load / SWA ring (TileLang) against the torch references: byte-exact stores, exact loads."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu

FORMATS = [("fp8", 512, 528), ("fp4", 512, 288), ("mxfp4", 128, 68)]


def _ops(name: str):
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG, "tilelang must import on the GPU machine, else the cuda op is the reference"
    cuda, ref = get_op(name, "cuda"), get_op(name, "reference")
    assert cuda is not ref
    return cuda, ref


def _rows(n: int, dim: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows over many magnitudes (1e-6 .. 1e4), with an all-zero group, a huge value and exact ties."""
    x = torch.randn(n, dim, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-14, 9, generator=g))
    if n:
        x[0, :32] = 0.0
        x[-1, 5] = 3.0e5
        x[n // 2, 40:48] = 2.5  # e2m1 midpoint after scaling in some groups
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("fmt", "dim", "bpt"), FORMATS)
@pytest.mark.parametrize("n", [1, 97, 0])
def test_store_bytes_exact(fmt: str, dim: int, bpt: int, dtype: torch.dtype, n: int) -> None:
    cuda, ref = _ops("kv_store")
    g = torch.Generator().manual_seed(n * 31 + bpt)
    blocks, bs = 12, 16
    pool = torch.randint(0, 256, (blocks, bs, bpt), dtype=torch.uint8, generator=g).cuda()
    x = _rows(n, dim, g, dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    if n > 3:
        slots[3] = -1  # padding token: not stored
    slots = slots.cuda()
    want = ref(pool.clone(), x, slots, fmt)
    got = cuda(pool.clone(), x, slots, fmt)
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "dim", "bpt"), FORMATS)
def test_load_exact(fmt: str, dim: int, bpt: int, out_dtype: torch.dtype) -> None:
    cuda, ref = _ops("kv_load")
    store = get_op("kv_store", "reference")
    g = torch.Generator().manual_seed(bpt)
    blocks, bs = 20, 16
    pool = torch.zeros(blocks, bs, bpt, dtype=torch.uint8, device="cuda")
    store(pool, _rows(blocks * bs, dim, g, torch.float32), torch.arange(blocks * bs).cuda(), fmt)
    table = torch.randint(0, blocks, (5, 4), dtype=torch.int32, generator=g).cuda()
    lens = torch.tensor([0, 1, 17, 64, 40]).cuda()
    want = ref(pool, table, lens, fmt, dim, out_dtype)
    got = cuda(pool, table, lens, fmt, dim, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    empty = cuda(pool, table[:0], lens[:0], fmt, dim, out_dtype)
    assert empty.shape == (0, 4 * bs, dim)


def test_swa_ring_write_rollback_read() -> None:
    """Ring of 128 + 6: write a prefix, write 5 drafts, roll back 3, rewrite; the window must be the accepted tokens."""
    write, write_ref = _ops("swa_ring_write")
    read, read_ref = _ops("swa_ring_read")
    g = torch.Generator().manual_seed(5)
    window, ring_len, states = 128, 134, 3
    ring = torch.zeros(states, ring_len, 528, dtype=torch.uint8, device="cuda")
    ring_ref = ring.clone()
    seq = {s: [] for s in range(states)}  # oracle: the accepted rows per state

    def step(state_ids: list[int], lengths: list[int], rows: torch.Tensor) -> None:
        st = torch.tensor(state_ids).cuda()
        pos = torch.tensor(lengths).cuda()
        write(ring, rows, st, pos)
        write_ref(ring_ref, rows, st, pos)

    length = {0: 0, 1: 0, 2: 0}
    for s, n in ((0, 150), (1, 3), (2, 128)):
        rows = _rows(n, 512, g, torch.bfloat16)
        step([s] * n, list(range(n)), rows)
        seq[s] = list(rows)
        length[s] = n
    # state 0: 5 drafts written, 2 accepted -> the 3 rejected entries are stale until overwritten
    drafts = _rows(5, 512, g, torch.bfloat16)
    step([0] * 5, list(range(150, 155)), drafts)
    seq[0] += list(drafts[:2])
    length[0] = 152
    assert torch.equal(ring, ring_ref)
    st = torch.tensor([0, 1, 2]).cuda()
    lens = torch.tensor([length[0], length[1], length[2]]).cuda()
    got = read(ring, st, lens, window)
    assert torch.equal(got, read_ref(ring_ref, st, lens, window))
    fmt = __import__("deepinfer_core.kv.formats", fromlist=["FP8Format"]).FP8Format()
    for s in range(states):
        tail = torch.stack(seq[s][-window:])
        want = fmt.dequantize(fmt.quantize(tail))
        assert torch.equal(got[s, window - len(tail) :], want)
        assert not got[s, : window - len(tail)].any()


@pytest.mark.parametrize("hw", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_both_encoders_same_bytes(dtype: torch.dtype, hw: bool) -> None:
    """Both fp8 encoders (hardware cvt, integer arithmetic) must give torch's bytes."""
    from deepinfer_kernels.cuda import kv_store as ck

    _, ref = _ops("kv_store")
    g = torch.Generator().manual_seed(77)
    pool = torch.zeros(64, 16, 528, dtype=torch.uint8, device="cuda")
    x = _rows(1000, 512, g, dtype)
    slots = torch.randperm(1024, generator=g)[:1000].cuda()
    want = ref(pool.clone(), x, slots, "fp8")
    got = pool.clone()
    ck.store_slots(got.view(-1, 528), x, slots, "fp8", hw_fp8=hw)
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hw", [True, False])
def test_fp8_both_decoders_exact(hw: bool, out_dtype: torch.dtype) -> None:
    """Both fp8 decoders on every byte the store can write (all e4m3 codes but the NaNs 0x7F / 0xFF) under
    every scale code it can write (0..254: exponents -127..127). NaN bytes and code 255 never reach a pool
    (the store rejects NaN and saturates); the decoders are not specified there (see docs/cuda_backend.md)."""
    from deepinfer_kernels.cuda import kv_store as ck

    fmt = __import__("deepinfer_core.kv.formats", fromlist=["FP8Format"]).FP8Format()
    rows = torch.zeros(255, 528, dtype=torch.uint8)
    vals = (torch.arange(512)[None, :] + torch.arange(255)[:, None]) % 256
    vals = torch.where((vals & 0x7F) == 0x7F, vals ^ 1, vals)  # 0x7F -> 0x7E, 0xFF -> 0xFE
    rows[:, :512] = vals.to(torch.uint8)
    rows[:, 512:] = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 16)  # scale code = row
    got = ck.gather_slots(rows.cuda(), torch.arange(255).cuda(), "fp8", 512, out_dtype, hw=hw).cpu()
    want = fmt.dequantize(rows).to(out_dtype)
    assert torch.equal(got, want), f"{(got != want).sum().item()} values differ"


def test_unchecked_fast_path_same_bytes() -> None:
    store, ref = _ops("kv_store")
    load, load_ref = _ops("kv_load")
    g = torch.Generator().manual_seed(8)
    pool = torch.zeros(32, 16, 288, dtype=torch.uint8, device="cuda")
    x = _rows(300, 512, g, torch.bfloat16)
    slots = torch.randperm(512, generator=g)[:300].cuda()
    assert torch.equal(store(pool.clone(), x, slots, "fp4", check=False), ref(pool.clone(), x, slots, "fp4"))
    store(pool, x, slots, "fp4", check=False)
    table = torch.randint(0, 32, (3, 4), dtype=torch.int32, generator=g).cuda()
    lens = torch.tensor([5, 64, 33]).cuda()
    assert torch.equal(
        load(pool, table, lens, "fp4", 512, torch.bfloat16, check=False),
        load_ref(pool, table, lens, "fp4", 512, torch.bfloat16),
    )


def test_rows_not_a_whole_number_of_words_fall_back() -> None:
    """fp8 at dim 64 is 66 B a token (the tiny model's ring): the reference path, not a crash."""
    store, ref = _ops("kv_store")
    g = torch.Generator().manual_seed(66)
    ring = torch.zeros(2, 20, 66, dtype=torch.uint8, device="cuda")
    x = _rows(7, 64, g, torch.bfloat16)
    slots = torch.tensor([0, 3, 5, 21, 22, 39, -1]).cuda()
    assert torch.equal(store(ring.clone(), x, slots, "fp8"), ref(ring.clone(), x, slots, "fp8"))
    read, read_ref = _ops("swa_ring_read")
    st, ln = torch.tensor([0, 1]).cuda(), torch.tensor([6, 20]).cuda()
    assert torch.equal(read(ring, st, ln, 16, "fp8", 64), read_ref(ring, st, ln, 16, "fp8", 64))
