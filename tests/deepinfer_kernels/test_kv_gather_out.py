"""``kv_gather(out=, col=)``: two gathers from different pools and formats fill one key buffer; against the
two plain gathers concatenated (CPU reference; the TileLang gathers on the GPU, skipped here)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.kv.formats import get_format
from deepinfer_kernels import get_backend


def pools(seed: int, n_slots: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 ring and an fp4 pool of 512-wide rows filled through kv_store (real codes and scales)."""
    g = torch.Generator().manual_seed(seed)
    ref = get_backend("reference")
    out = []
    for fmt in ("fp8", "fp4"):
        pool = torch.zeros(n_slots, get_format(fmt, 512).bytes_per_token, dtype=torch.uint8, device=device)
        ref.op("kv_store")(
            pool, torch.randn(n_slots, 512, generator=g).to(device), torch.arange(n_slots, device=device), fmt
        )
        out.append(pool)
    return out[0], out[1]


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), wa=st.integers(1, 9), kb=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_two_gathers_into_one_buffer_equal_the_concatenation(rows, wa, kb, seed):
    ring, pool = pools(seed % 1000, 40)
    g = torch.Generator().manual_seed(seed)
    sa = torch.randint(-1, 40, (rows, wa), generator=g)  # -1: zeros
    sb = torch.randint(-1, 40, (rows, kb), generator=g)
    op = get_backend("reference").op("kv_gather")
    want = torch.cat([op(ring, sa, "fp8", 512, torch.float32), op(pool, sb, "fp4", 512, torch.float32)], 1)
    keys = torch.full((rows, wa + kb, 512), float("nan"))
    assert op(ring, sa, "fp8", 512, torch.float32, out=keys, col=0) is keys
    op(pool, sb, "fp4", 512, torch.float32, out=keys, col=wa)
    assert torch.equal(keys, want)


def test_out_shapes_are_checked():
    ring, _ = pools(0, 8)
    op = get_backend("reference").op("kv_gather")
    s = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="col"):
        op(ring, s, "fp8", 512, torch.float32, out=torch.empty(2, 4, 512), col=2)
    with pytest.raises(ValueError, match="out"):
        op(ring, s, "fp8", 512, torch.float32, out=torch.empty(3, 4, 512), col=0)
    with pytest.raises(ValueError, match="slots"):
        op(ring, s.view(-1), "fp8", 512, torch.float32, out=torch.empty(2, 4, 512), col=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_gathers_into_one_buffer_equal_the_reference(dtype: torch.dtype) -> None:
    ring, pool = pools(3, 700, "cuda")
    g = torch.Generator().manual_seed(4)
    for rows in (1, 7, 64):
        sa = torch.randint(-1, 700, (rows, 128), generator=g).cuda()
        sb = torch.randint(-1, 700, (rows, 512), generator=g).cuda()
        cuda, ref = get_backend("cuda").op("kv_gather"), get_backend("reference").op("kv_gather")
        keys = torch.full((rows, 640, 512), float("nan"), dtype=dtype, device="cuda")
        cuda(ring, sa, "fp8", 512, dtype, out=keys, col=0)
        cuda(pool, sb, "fp4", 512, dtype, out=keys, col=128)
        want = torch.cat([ref(ring, sa, "fp8", 512, dtype), ref(pool, sb, "fp4", 512, dtype)], 1)
        assert torch.equal(keys, want)
