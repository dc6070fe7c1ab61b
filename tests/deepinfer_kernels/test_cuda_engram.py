"""cuda engram ops against the torch references: hash (TileLang and tile_kernels) exact, gather exact, with
and without ``check``; the check-free Engram paths make no synchronising CUDA call (torch's sync debug mode)."""

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


@pytest.mark.parametrize(
    ("t", "n", "layers", "heads"), [(1, 4, 2, 8), (1000, 4, 2, 8), (77, 3, 1, 2), (0, 4, 2, 8)]
)
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
    assert torch.equal(ce.engram_hash_tilelang(*args, check=False), want)
    assert torch.equal(get_op("engram_hash", "cuda")(*args, check=False), want)
    assert torch.equal(ref(*args, check=False), want)


def test_hash_tile_kernels_adapter() -> None:
    from deepinfer_kernels.cuda import engram as ce

    if not ce._HAVE_TILE_KERNELS:
        pytest.skip("tile_kernels not importable")
    g = torch.Generator().manual_seed(11)
    args = _hash_inputs(4096, 4, 2, 8, g)
    want = get_op("engram_hash", "reference")(*args)
    assert torch.equal(ce.engram_hash_tile_kernels(*args), want)
    assert torch.equal(ce.engram_hash_tile_kernels(*args, check=False), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(1,), (3, 17), (0,)])
def test_gather_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    cuda, ref = get_op("engram_gather", "cuda"), get_op("engram_gather", "reference")
    assert cuda is not ref
    g = torch.Generator().manual_seed(len(shape))
    rows, dim = 5003, 256
    table = (torch.randn(rows, dim, generator=g) * 4).to(dtype).cuda()
    scales = (
        torch.randint(100, 140, (rows, 2), generator=g, dtype=torch.uint8).cuda()
        if dtype == torch.float8_e4m3fn
        else None
    )
    ids = torch.randint(0, rows, shape, generator=g).cuda()
    got = cuda(table, ids, scales, torch.bfloat16)
    want = ref(table, ids, scales, torch.bfloat16)
    assert got.shape == (*shape, dim) and torch.equal(got, want)
    assert torch.equal(cuda(table, ids, scales, torch.bfloat16, check=False), want)
    assert torch.equal(cuda(table, ids.to(torch.int32), scales, torch.bfloat16, check=False), want)
    assert torch.equal(ref(table, ids.to(torch.int32), scales, torch.bfloat16, check=False), want)
    with pytest.raises(IndexError, match=rf"row_ids: id {rows} is outside"):
        cuda(table, torch.tensor([rows], device="cuda"), scales)
    with pytest.raises(IndexError, match="row_ids: id -1 is outside"):
        cuda(table, torch.tensor([0, -1], device="cuda"), scales)


def test_unchecked_engram_paths_do_not_synchronise() -> None:
    """The executor's Engram path of a fed step on device tensors (``hash(validate=False)``,
    ``hash_decode_on_device``, ``LocalEngramTable.fetch(check=False)`` on reference- and cuda-backend
    tables, bf16 and fp8) and our TileLang hash with ``check=False`` make no synchronising CUDA call once
    warm (kernels compiled, the hasher's per-device parameters copied): torch's sync debug mode raises on
    one, and does for the checked fetch (so the test can fail). Results equal the checked host paths."""
    import numpy as np

    from deepinfer_core.engram import EngramConfig, EngramHasher, LocalEngramTable
    from deepinfer_core.model.engram_context import hash_decode_on_device
    from deepinfer_kernels.cuda import engram as ce

    cfg = EngramConfig(
        layer_ids=(1, 5),
        max_ngram=4,
        heads_per_order=3,
        table_sizes=(101, 211, 307),
        vocab_size=1000,
        pad_id=0,
    )
    h = EngramHasher(cfg)
    g = torch.Generator().manual_seed(5)
    toks, cu = torch.randint(0, 1000, (40,), generator=g), torch.tensor([0, 15, 40])
    ctx = torch.randint(-1, 1000, (2, 3), generator=g)
    ctx1 = np.random.default_rng(5).integers(-1, 1000, (40, 3))
    d_toks, d_cu, d_ctx = toks.cuda(), cu.cuda(), ctx.cuda()
    vals = torch.randn(h.num_rows(1), 256, generator=g)
    tables = []
    for fmt in ("bf16", "fp8"):
        t = LocalEngramTable.from_values(vals, fmt, device="cuda")
        tables += [t, LocalEngramTable(t.data, t.scales, backend="cuda")]

    def run() -> tuple:
        ids = h.hash(d_toks, d_cu, d_ctx, validate=False)
        ids1 = hash_decode_on_device(h, d_toks, ctx1)
        grams = h.ngram_token_ids(d_toks, d_cu, d_ctx, validate=False)
        ids_tl = ce.engram_hash_tilelang(grams, *h.device_params("cuda"), check=False)
        return ids, ids1, ids_tl, [t.fetch(i[0], check=False) for t in tables for i in (ids, ids1)]

    run()  # warm-up: compiles, parameter and token-map copies
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, ids1, ids_tl, rows = run()
        with pytest.raises(RuntimeError, match="synchroniz"):
            tables[0].fetch(ids[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = h.hash(toks, cu, ctx)
    want1 = torch.from_numpy(h.hash_host(toks.numpy(), np.arange(41), ctx1))
    assert torch.equal(ids.cpu(), want) and torch.equal(ids_tl.cpu(), want) and torch.equal(ids1.cpu(), want1)
    host = [t.to("cpu") for t in tables]
    want_rows = [t.fetch(i[0]) for t in host for i in (want, want1)]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(rows, want_rows))
