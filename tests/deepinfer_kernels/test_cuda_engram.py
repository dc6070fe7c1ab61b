"""cuda engram ops against the torch references: hash (TileLang and tile_kernels) exact, gather exact."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _hash_inputs(t: int, n: int, layers: int, heads: int, g: torch.Generator):
    ids = torch.randint(0, 129_280, (t, n), generator=g, dtype=torch.int32)
    mult = torch.randint(-(2**62), 2**62, (layers, n), generator=g, dtype=torch.int64) | 1
    sizes = torch.randint(1000, 2**31 - 1, (layers, n - 1, heads), generator=g, dtype=torch.int32)
    offs = torch.randint(0, 2**20, (layers, (n - 1) * heads), generator=g, dtype=torch.int32)
    return [x.cuda() for x in (ids, mult, sizes, offs)]


@pytest.mark.parametrize(("t", "n", "layers", "heads"), [(1, 4, 2, 8), (1000, 4, 2, 8), (77, 3, 1, 2), (0, 4, 2, 8)])
def test_hash_exact(t: int, n: int, layers: int, heads: int) -> None:
    from deepinfer_kernels.cuda import _tl
    from deepinfer_kernels.cuda import engram as ce

    assert _tl.HAVE_TILELANG
    ref = get_op("engram_hash", "reference")
    g = torch.Generator().manual_seed(t + n)
    args = _hash_inputs(t, n, layers, heads, g)
    want = ref(*args)
    assert torch.equal(ce.engram_hash_tilelang(*args), want)
    assert torch.equal(get_op("engram_hash", "cuda")(*args), want)


def test_hash_tile_kernels_adapter() -> None:
    from deepinfer_kernels.cuda import engram as ce

    if not ce._HAVE_TILE_KERNELS:
        pytest.skip("tile_kernels not importable")
    g = torch.Generator().manual_seed(11)
    args = _hash_inputs(4096, 4, 2, 8, g)
    assert torch.equal(ce.engram_hash_tile_kernels(*args), get_op("engram_hash", "reference")(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(1,), (3, 17), (0,)])
def test_gather_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    cuda, ref = get_op("engram_gather", "cuda"), get_op("engram_gather", "reference")
    assert cuda is not ref
    g = torch.Generator().manual_seed(len(shape))
    rows, dim = 5003, 256
    table = (torch.randn(rows, dim, generator=g) * 4).to(dtype).cuda()
    scales = torch.randint(100, 140, (rows, 2), generator=g, dtype=torch.uint8).cuda() if dtype == torch.float8_e4m3fn else None
    ids = torch.randint(0, rows, shape, generator=g).cuda()
    got = cuda(table, ids, scales, torch.bfloat16)
    want = ref(table, ids, scales, torch.bfloat16)
    assert got.shape == (*shape, dim) and torch.equal(got, want)
    with pytest.raises(IndexError, match="row_ids"):
        cuda(table, torch.tensor([rows], device="cuda"), scales)
