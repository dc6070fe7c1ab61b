"""Local and host tables, fp8 quantisation and memory planning, against brute force."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engram import (
    EngramConfig,
    HostEngramTable,
    LocalEngramTable,
    bytes_per_row,
    plan_for_config,
    plan_memory,
    quantize_fp8,
)
from deepinfer_kernels import get_op


def _values(rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes so the per-block scales matter
    return torch.randn(rows, dim, generator=g) * torch.exp2(
        torch.randint(-12, 8, (rows, 1), generator=g).float()
    )


def test_quantize_fp8_scales_and_error() -> None:
    x = _values(64, 128, 1)
    x[3, :32] = 0.0  # an all-zero block
    data, codes = quantize_fp8(x)
    assert data.dtype == torch.float8_e4m3fn and codes.shape == (64, 4) and codes.dtype == torch.uint8
    blocks = x.unflatten(-1, (4, 32))
    amax = blocks.abs().amax(-1)
    e = codes.float() - 127
    nz = amax > 0
    # the scale is the smallest power of two bringing the block max within e4m3's 448
    assert bool((amax[nz] <= 448 * torch.exp2(e[nz])).all())
    assert bool((amax[nz] > 448 * torch.exp2(e[nz] - 1)).all())
    deq = data.float().unflatten(-1, (4, 32)) * torch.exp2(e).unsqueeze(-1)
    # e4m3 keeps 3 mantissa bits: error at most half an ulp of the block max's binade (2**-4 relative)
    err = (deq - blocks).abs().amax(-1)
    assert bool((err <= amax * 2**-4 + 1e-30).all())
    assert bool((deq[3, 0] == 0).all())


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("cls", [LocalEngramTable, HostEngramTable])
def test_fetch_equals_brute_force(cls, fmt: str) -> None:
    x = _values(300, 64, 2)
    table = cls.from_values(x, fmt)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (7, 5, 3), generator=g)
    ids[0, 0, :] = 299  # duplicates and the last row
    got = table.fetch(ids)
    assert got.shape == (7, 5, 3, 64) and got.dtype == torch.bfloat16
    if fmt == "bf16":
        want = torch.stack([x[int(i)].to(torch.bfloat16) for i in ids.reshape(-1)]).reshape(7, 5, 3, 64)
        assert torch.equal(got, want)
    else:
        data, codes = quantize_fp8(x)
        for i, r in zip(ids.reshape(-1).tolist(), got.reshape(-1, 64)):
            row = torch.cat(
                [data[i, b * 32 : (b + 1) * 32].float() * 2.0 ** (int(codes[i, b]) - 127) for b in range(2)]
            )
            assert torch.equal(r, row.to(torch.bfloat16))
    assert table.fetch(torch.empty(0, dtype=torch.int64)).shape == (0, 64)


@pytest.mark.parametrize("cls", [LocalEngramTable, HostEngramTable])
def test_bad_ids_raise(cls) -> None:
    table = cls.from_values(_values(10, 32, 0), "fp8")
    with pytest.raises(IndexError, match=r"row_ids: id 10 is outside \[0, num_rows=10\)"):
        table.fetch(torch.tensor([0, 10]))
    with pytest.raises(IndexError, match="row_ids: id -1"):
        table.fetch(torch.tensor([[-1]]))
    with pytest.raises(TypeError, match="row_ids"):
        table.fetch(torch.tensor([1.0]))


def test_bad_storage_raises() -> None:
    with pytest.raises(ValueError, match="scales"):
        LocalEngramTable(torch.zeros(4, 32, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="data: dtype"):
        LocalEngramTable(torch.zeros(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="fmt"):
        LocalEngramTable.from_values(torch.zeros(4, 32), "int4")
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_fp8(torch.zeros(4, 40))


def test_gather_op_rejects_bad_ids() -> None:
    op = get_op("engram_gather")
    with pytest.raises(IndexError, match="row_ids"):
        op(torch.zeros(3, 4, dtype=torch.bfloat16), torch.tensor([3]))


def test_bytes_per_row() -> None:
    assert bytes_per_row(256, "fp8") == 256 + 8
    assert bytes_per_row(256, "bf16") == 512
    with pytest.raises(ValueError, match="fmt"):
        bytes_per_row(256, "fp4")


def test_memory_plan_v41_seed_numbers() -> None:
    plan = plan_for_config(EngramConfig.v41_flash(), "fp8", 64)
    # brute force: every prime of both layers summed, 264 B per row
    from deepinfer_core.engram import derive_primes

    primes = derive_primes(EngramConfig.v41_flash())
    assert plan.total_bytes == int(primes.sum()) * 264
    assert abs(plan.total_bytes / 1e9 - 202.76) < 0.01  # the seed: 202.76 GB of tables
    assert 3.1e9 < plan.bytes_per_rank < 3.25e9  # "about 3.2 GB each" over 64 ranks
    per_layer = [int(p.sum()) for p in primes]
    assert all(3.8e8 < r < 3.9e8 for r in per_layer)  # about 384M rows per layer
    assert plan.rows_per_rank == tuple(-(-r // 64) for r in per_layer)


def test_memory_plan_with_replicated_scales() -> None:
    rows = (1000, 2001)
    p = plan_memory(rows, 256, "fp8", 8, scales_replicated=True)
    # values sharded, every row's 8 scale bytes on every rank
    assert p.bytes_per_rank == (125 + 251) * 256 + 3001 * 8
    assert p.total_bytes == 3001 * 264
    assert plan_memory(rows, 256, "bf16", 8, scales_replicated=True).bytes_per_rank == (125 + 251) * 512
    v41 = plan_for_config(EngramConfig.v41_flash(), "fp8", 64, scales_replicated=True)
    assert 9.2e9 < v41.bytes_per_rank < 9.4e9  # 3.1 GB of values + 6.1 GB of replicated scales


def test_memory_plan_uneven_and_bad() -> None:
    p = plan_memory(10, 32, "bf16", 4)
    assert p.rows_per_rank == (3,) and p.bytes_per_rank == 3 * 64 and p.total_bytes == 10 * 64
    with pytest.raises(ValueError, match="group_size"):
        plan_memory(10, 32, "bf16", 0)
    with pytest.raises(ValueError, match="table_rows"):
        plan_memory([], 32, "bf16", 2)
