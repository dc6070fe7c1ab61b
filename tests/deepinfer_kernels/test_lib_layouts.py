"""The conversions to FlashMLA's / DeepGEMM's / DeepSelect's layouts (libs.layouts), on the CPU.

Oracles: our formats' own decoders (V32Format, MXFP4Format), brute-force index arithmetic, and torch
simulations of what each library computes from its layout (DeepGEMM's grouped GEMM reads row m with
expert m_indices[m]; its logits are sum_h w relu(q . k scale)) compared with the project's torch
references (moe_grouped_gemm, indexer_scores, sink_attention_rows).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.kv.formats import MXFP4Format, V32Format
from deepinfer_kernels.libs import layouts as L
from deepinfer_kernels.ops import grouped_gemm as gg_ref
from deepinfer_kernels.ops import indexer as ix_ref
from deepinfer_kernels.ops.sink_attention import sink_attention_rows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- FlashMLA ---------------------------------------------------------------------------------------


def _paged_v32(b: int, ctx: int, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shuffled paged pool holding b sequences of ctx tokens: (pool uint8 [blocks, page, 656], block
    table [b, W], logical tokens float [b, ctx, 576])."""
    g = _gen(seed)
    w = -(-ctx // page)
    n_blocks = b * w + 3  # spare blocks stay zero
    perm = torch.randperm(n_blocks, generator=g)[: b * w].view(b, w)
    tokens = torch.randn(b, w * page, 576, generator=g) * torch.logspace(-3, 1, 576)
    pool = torch.zeros(n_blocks, page, 656, dtype=torch.uint8)
    pool[perm.flatten()] = V32Format().quantize(tokens).view(b * w, page, 656)
    return pool, perm, tokens[:, :ctx]


@pytest.mark.parametrize(("b", "ctx", "page", "k"), [(1, 5, 4, 3), (3, 130, 64, 70), (2, 33, 16, 64)])
def test_flash_mla_cache_view_and_indices_read_the_right_tokens(b: int, ctx: int, page: int, k: int) -> None:
    pool, table, tokens = _paged_v32(b, ctx, page, seed=b * 100 + ctx)
    kc = L.flash_mla_kv_cache(pool, page)
    assert kc.shape == (pool.shape[0], page, 1, 656) and kc.data_ptr() == pool.data_ptr()
    assert torch.equal(L.flash_mla_kv_cache(pool.view(-1, 656), page), kc)
    g = _gen(k)
    pos = torch.randint(-2, ctx, (b, 1, k), generator=g)  # negatives: no key
    idx = L.flash_mla_indices(pos, table, page)
    assert idx.dtype == torch.int32 and idx.shape == (b, 1, -(-k // 64) * 64)
    assert (idx[..., k:] == -1).all()
    rows, valid = L.v32_rows(kc, idx[..., :k])
    assert torch.equal(valid, pos >= 0)
    want = V32Format().dequantize(V32Format().quantize(tokens))  # what the cache holds, decoded
    for bi in range(b):
        for j in range(k):
            p = int(pos[bi, 0, j])
            if p >= 0:
                assert torch.equal(rows[bi, 0, j], want[bi, p])
                # the flat index is block * page + offset through the table
                assert int(idx[bi, 0, j]) == int(table[bi, p // page]) * page + p % page


def test_flash_mla_indices_edges() -> None:
    table = torch.tensor([[5, -1, 2]])
    pos = torch.tensor([[0, 3, 4, 8, 11, 12, 100, -7]])  # [b, k]: s_q = 1 implied
    got = L.flash_mla_indices(pos, table, 4, align=8)
    # block 1 is unmapped (-1), 12 and 100 are past the table, -7 is no key
    assert got.tolist() == [[[20, 23, -1, 8, 11, -1, -1, -1]]]
    flat = L.flash_mla_indices(torch.tensor([[10, 13]]), table, 4, seq_start=torch.tensor([10]), align=1)
    assert flat.tolist() == [[[20, 23]]]
    assert L.flash_mla_indices(
        torch.full((2, 3, 64), -1), torch.zeros(2, 1, dtype=torch.int32), 64
    ).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="batch"):
        L.flash_mla_indices(torch.zeros(2, 1, 3, dtype=torch.int64), table, 4)
    with pytest.raises(ValueError, match="656"):
        L.flash_mla_kv_cache(torch.zeros(4, 655, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="pages"):
        L.flash_mla_kv_cache(torch.zeros(5, 656, dtype=torch.uint8), 4)


def test_flash_mla_gather_matches_attention_over_the_logical_sequence() -> None:
    """The converted indices give the same sparse attention (our reference) as attending the chosen
    positions of the logical sequence directly: the conversion loses and reorders nothing."""
    b, ctx, page, k, h = 2, 90, 16, 40, 4
    pool, table, tokens = _paged_v32(b, ctx, page, seed=7)
    g = _gen(8)
    pos = torch.stack([torch.randperm(ctx, generator=g)[:k] for _ in range(b)]).unsqueeze(1)
    pos[0, 0, :5] = -1
    idx = L.flash_mla_indices(pos, table, page)
    rows, valid = L.v32_rows(L.flash_mla_kv_cache(pool, page), idx)
    q = torch.randn(b, h, 576, generator=g)
    sink = torch.full((h,), float("-inf"))
    got = sink_attention_rows(q, rows[:, 0], valid[:, 0], None, None, sink, 576**-0.5)[..., :512]
    logical = V32Format().dequantize(V32Format().quantize(tokens))
    direct = torch.stack([logical[i, pos[i, 0].clamp(min=0)] for i in range(b)])
    want = sink_attention_rows(q, direct, pos[:, 0] >= 0, None, None, sink, 576**-0.5)[..., :512]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- DeepGEMM: FP8 quantisers -------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(256, 512), (200, 300), (1, 128)])
def test_fp8_blocks_bound_and_layout(n: int, k: int) -> None:
    w = torch.randn(3, n, k, generator=_gen(n)) * torch.logspace(-4, 1, k)
    w8, s = L.quantize_fp8_blocks(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    assert s.shape == (3, -(-n // 128), -(-k // 128)) and s.is_contiguous()
    deq = L.dequantize_fp8_blocks(w8, s)
    full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    # e4m3 rounding: relative 2^-4 for normals, absolute 2^-10 (half the subnormal step) below
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, full * 2**-10) * (1 + 1e-6)).all()
    # every block's largest magnitude maps to 448 (or the floor keeps it below)
    assert float(w8.float().abs().max()) == 448.0
    if k % 128 == 0:
        L.check_fp8_block_weights(w8.contiguous(), s)


def test_fp8_block_layout_checks_name_the_field() -> None:
    w8, s = L.quantize_fp8_blocks(torch.randn(2, 256, 256))
    with pytest.raises(ValueError, match="scale"):
        L.check_fp8_block_weights(w8, s[:, :1])
    with pytest.raises(ValueError, match="w8"):
        L.check_fp8_block_weights(w8.float(), s)  # type: ignore[arg-type]


def test_fp8_tokens_bound() -> None:
    x = torch.randn(37, 384, generator=_gen(3)) * 10
    x[0] = 0  # an all-zero token takes the floor scale
    x8, sf = L.quantize_fp8_tokens(x)
    assert sf.shape == (37, 3) and float(sf[0, 0]) == pytest.approx(1e-4 / 448)
    deq = L.dequantize_fp8_tokens(x8, sf)
    full = sf.repeat_interleave(128, -1)
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, full * 2**-10) * (1 + 1e-6)).all()


# --- DeepGEMM: grouped layouts, checked by simulating the library on them ---------------------------


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _simulate_contiguous(x: torch.Tensor, m_indices: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1])
    for m in range(x.shape[0]):  # DeepGEMM: row m uses expert m_indices[m]; -1 rows are skipped
        e = int(m_indices[m])
        if e >= 0:
            out[m] = x[m] @ w[e].t()
    return out


@pytest.mark.parametrize(
    ("counts", "extra"),
    [([3, 0, 5, 1], 0), ([0, 0, 0], 0), ([1], 0), ([130, 2], 0), ([2, 0, 3], 4), ([0, 7], 0)],
)
@pytest.mark.parametrize("static", [True, False])
def test_contiguous_layout_simulated_equals_reference(counts: list[int], extra: int, static: bool) -> None:
    r = sum(counts) + extra  # extra rows past offs[-1]: the reference's contract gives them zeros
    g = _gen(sum(counts) + len(counts))
    x = torch.randn(r, 64, generator=g)
    w = torch.randn(len(counts), 32, 64, generator=g)
    offs = _offs(counts)
    lay = L.contiguous_layout(x, offs, align=128, static=static)
    m = lay.x.shape[0]
    assert m % 128 == 0 and lay.groups.dtype == torch.int32 and lay.groups.shape == (m,)
    if not static:
        assert m == sum(-(-c // 128) * 128 for c in counts)
    # segments start at multiples of 128, in expert order, with -1 (and zero rows) as padding
    start = 0
    for e, c in enumerate(counts):
        assert (lay.groups[start : start + c] == e).all()
        padded = -(-c // 128) * 128
        assert (lay.groups[start + c : start + padded] == -1).all()
        assert (lay.x[start + c : start + padded] == 0).all()
        start += padded
    assert (lay.groups[start:] == -1).all()
    assert (lay.rows[sum(counts) :] == -1).all()
    got = L.gather_rows(_simulate_contiguous(lay.x, lay.groups, w), lay.rows)
    torch.testing.assert_close(got, gg_ref.moe_grouped_gemm(x, w, offs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("counts", "extra"), [([3, 0, 5, 1], 0), ([0, 0], 0), ([1], 0), ([4, 6], 3)])
def test_masked_layout_simulated_equals_reference(counts: list[int], extra: int) -> None:
    r = sum(counts) + extra
    g = _gen(r + 11)
    x = torch.randn(r, 64, generator=g)
    w = torch.randn(len(counts), 16, 64, generator=g)
    offs = _offs(counts)
    lay = L.masked_layout(x, offs)
    e, max_m, _ = lay.x.shape
    assert e == len(counts) and max_m >= max(r, 1) and max_m % 128 == 0
    assert lay.groups.tolist() == counts
    out = torch.zeros(e, max_m, 16)
    for j in range(e):  # DeepGEMM: expert j's first masked_m[j] rows
        out[j, : counts[j]] = lay.x[j, : counts[j]] @ w[j].t()
        assert (lay.x[j, counts[j] :] == 0).all()
    got = L.gather_rows(out, lay.rows)
    torch.testing.assert_close(got, gg_ref.moe_grouped_gemm(x, w, offs), rtol=1e-5, atol=1e-5)


def test_masked_layout_refuses_to_drop_rows() -> None:
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="max_m"):
        L.masked_layout(x, _offs([8, 2]), max_m=4)
    lay = L.masked_layout(x, _offs([4, 6]), max_m=6)  # fits exactly
    assert lay.groups.tolist() == [4, 6] and (lay.rows >= 0).all()


def test_grouped_fp8_pipeline_dequantises_to_reference() -> None:
    """The adapter's numerics on the CPU: per-token FP8 activations x block-FP8 weights, placed by the
    contiguous layout, equal the reference GEMM of the dequantised operands (fp32 accumulation)."""
    counts = [5, 0, 9]
    g = _gen(21)
    x = torch.randn(sum(counts), 256, generator=g)
    w = torch.randn(3, 128, 256, generator=g)
    offs = _offs(counts)
    w8, ws = L.quantize_fp8_blocks(w)
    lay = L.contiguous_layout(x, offs)
    a8, asf = L.quantize_fp8_tokens(lay.x)
    sim = _simulate_contiguous(L.dequantize_fp8_tokens(a8, asf), lay.groups, L.dequantize_fp8_blocks(w8, ws))
    got = L.gather_rows(sim, lay.rows)
    xq = L.dequantize_fp8_tokens(*L.quantize_fp8_tokens(x))
    want = gg_ref.moe_grouped_gemm(xq, L.dequantize_fp8_blocks(w8, ws), offs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # and FP8 stays near the bf16-free product: the error the GPU test allows
    exact = gg_ref.moe_grouped_gemm(x, w, offs)
    assert float((got - exact).norm() / exact.norm()) < 0.05


# --- DeepGEMM: the indexer's logits -------------------------------------------------------------------


def test_fold_q_scales_is_exact_on_the_rounded_q() -> None:
    g = _gen(5)
    q = torch.randn(6, 32, 128, generator=g) * torch.logspace(-3, 2, 32)[None, :, None]
    wts = torch.randn(6, 32, generator=g)
    q8, w2 = L.fold_q_scales(q, wts)
    s = w2 / wts
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # powers of two
    assert float(q8.float().abs().amax()) <= 448.0
    keys = torch.randn(50, 128, generator=g)
    k8, ksf = L.fp8_index_keys(keys)
    ks, ke = torch.zeros(6, dtype=torch.int32), torch.tensor([50, 1, 0, 17, 50, 49], dtype=torch.int32)
    # DeepGEMM's formula on the converted tensors ...
    kdq = k8.float() * ksf[:, None]
    sim = (
        torch.einsum("thd,sd->ths", q8.float().double(), kdq.double()).relu() * w2.double()[..., None]
    ).sum(1)
    sim = sim.masked_fill(torch.arange(50)[None] >= ke[:, None], float("-inf"))
    # ... equals the reference on the FP8-rounded q with the original weights
    qdq = q8.float() * s[..., None]
    want = ix_ref.indexer_scores(qdq, wts, kdq, ks, ke)  # float32 accumulation
    torch.testing.assert_close(sim.float(), want, rtol=1e-5, atol=1e-3)
    # and FP8 rounding keeps the scores near the unrounded ones (the GPU test's tolerance)
    exact = ix_ref.indexer_scores(q, wts, keys, ks, ke)
    fin = torch.isfinite(exact)
    assert torch.equal(fin, torch.isfinite(want))
    assert float((want.float()[fin] - exact[fin]).norm() / exact[fin].norm()) < 0.05


def test_mxfp4_keys_convert_exactly() -> None:
    g = _gen(9)
    keys = torch.randn(200, 128, generator=g) * torch.logspace(-2, 2, 128)  # group spreads up to ~13
    keys[0] = 0
    keys[1, :32] = 0  # an all-zero group
    b = MXFP4Format().quantize(keys)
    k8, s = L.mxfp4_keys_to_fp8(b)
    assert k8.dtype == torch.float8_e4m3fn and s.shape == (200,) and float(s[0]) == 1.0
    assert torch.equal(k8.float() * s[:, None], MXFP4Format().dequantize(b))
    # a key spread wider than 14 exponents rounds only its smallest group, within half an e4m3 step
    wide = torch.zeros(1, 128)
    wide[0, :32], wide[0, 32:64] = 1000.0, 1e-3
    kw, sw = L.mxfp4_keys_to_fp8(MXFP4Format().quantize(wide))
    deq = MXFP4Format().dequantize(MXFP4Format().quantize(wide))
    err = (kw.float() * sw[:, None] - deq).abs()
    assert float(err[0, :32].max()) == 0.0 and float(err.max()) <= float(sw[0]) * 2**-10


@pytest.mark.parametrize("page", [64, 128])
def test_mxfp4_pool_to_deep_gemm_reads_the_same_keys(page: int) -> None:
    g = _gen(page)
    b, w = 3, 3
    n_pages = b * w + 1
    pool_f = torch.randn(n_pages * page, 128, generator=g)
    pool = MXFP4Format().quantize(pool_f).view(n_pages, page, 68)
    table = torch.randperm(n_pages, generator=g)[: b * w].view(b, w).to(torch.int32)
    table[2, 2] = -1  # an unmapped page
    cache, t2 = L.mxfp4_pool_to_deep_gemm(pool, table, page)
    assert cache.shape == (n_pages * page // 64, 64, 1, 132) and cache.dtype == torch.uint8
    assert t2.shape == (b, w * page // 64) and t2.dtype == torch.int32
    vals, scale = L.split_deep_gemm_paged_cache(cache)
    keys = vals * scale[..., None]
    want = MXFP4Format().dequantize(pool.view(-1, 68))
    for bi in range(b):
        for p in range(0, w * page, 7):
            blk = int(t2[bi, p // 64])
            if int(table[bi, p // page]) < 0:
                assert blk < 0
                continue
            assert torch.equal(keys[blk, p % 64], want[int(table[bi, p // page]) * page + p % page])
    with pytest.raises(ValueError, match="multiple of 64"):
        L.mxfp4_pool_to_deep_gemm(pool.view(-1, 68), table, 32)


def test_deep_gemm_paged_cache_layout_is_values_then_scales() -> None:
    k8 = torch.randn(2, 64, 128).clamp(-400, 400).to(torch.float8_e4m3fn)
    sc = torch.rand(2, 64) + 0.5
    c = L.deep_gemm_paged_cache(k8, sc)
    flat = c.view(2, -1)
    assert torch.equal(flat[:, : 64 * 128].view(torch.float8_e4m3fn).float(), k8.float().view(2, -1))
    assert torch.equal(flat[:, 64 * 128 :].contiguous().view(torch.float32), sc)


def test_context_lens_2d() -> None:
    got = L.context_lens_2d(torch.tensor([5, 1, 0], dtype=torch.int32), 3)
    assert got.tolist() == [[3, 4, 5], [0, 0, 1], [0, 0, 0]] and got.dtype == torch.int32


# --- DeepSelect ---------------------------------------------------------------------------------------


def test_aligned_rows() -> None:
    x = torch.randn(3, 100)
    assert L.aligned_rows(x, 16).data_ptr() == x.data_ptr()  # 400-byte rows are 16-aligned
    y = L.aligned_rows(x, 256)
    assert torch.equal(y, x) and (y.stride(0) * 4) % 256 == 0
    z = L.aligned_rows(x[:, :7], 16)  # a column slice: stride 100 floats = 400 B, aligned, kept
    assert torch.equal(z, x[:, :7])


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 10, 4), (4, 50, 64), (3, 5, 8)])
def test_topk_to_indices_matches_reference_sets(rows: int, n: int, k: int) -> None:
    g = _gen(n + k)
    scores = torch.randn(rows, n, generator=g)
    scores[0, : n // 2] = float("-inf")  # masked keys
    ref = ix_ref.indexer_topk(scores, k)
    # a DeepSelect-like answer: the top-k in a shuffled order, short rows padded with (-inf, -1)
    kk = min(k, n)
    vals, idx = torch.topk(scores, kk, dim=1)
    perm = torch.randperm(kk, generator=g)
    vals, idx = vals[:, perm], idx[:, perm]
    if kk < k:
        vals = torch.cat([vals, torch.full((rows, k - kk), float("-inf"))], 1)
        idx = torch.cat([idx, torch.full((rows, k - kk), -1)], 1)
    got = L.topk_to_indices(vals, idx, n)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    for r in range(rows):
        nv = int((ref[r] >= 0).sum())
        assert (got[r, :nv] >= 0).all() and (got[r, nv:] == -1).all()
        assert sorted(got[r, :nv].tolist()) == sorted(ref[r, :nv].tolist())
