"""FlashMLA, DeepGEMM and DeepSelect through their adapters against the project's torch references (GPU).

Each test skips where CUDA or its library is not importable (build them with
``scripts/build_kernel_libs.sh``; ``scripts/device_kernel_libs.sh`` runs the device sequence). Tolerances:

- FlashMLA: bf16 output within 1e-2 (abs and rel) of ``sink_attention_rows`` over the same dequantised
  rows (the kernel multiplies bf16 q with the e4m3 x power-of-two keys, exact in bf16, in fp32); lse
  within 1e-3; rows without a valid index give 0 and lse +inf.
- DeepGEMM: calc_diff (1 - cosine-like similarity, DeepGEMM's own measure) below 1e-3 against the
  reference on the same FP8-rounded operands, 2e-2 against the unrounded bf16 product; logits below
  1e-5 against the simulated FP8 reference, with -inf in exactly the reference's places.
- DeepSelect: the same sets of indices (values compared, ties allowed) as torch.topk, exact values.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from deepinfer_core.kv.formats import MXFP4Format, V32Format
from deepinfer_kernels.libs import layouts as L
from deepinfer_kernels.ops import grouped_gemm as gg_ref
from deepinfer_kernels.ops import indexer as ix_ref
from deepinfer_kernels.ops.sink_attention import sink_attention_rows

pytestmark = pytest.mark.gpu


def _need(lib: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if importlib.util.find_spec(lib) is None:
        pytest.skip(f"{lib} not importable (scripts/build_kernel_libs.sh build {lib})")


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if float(denom) else 0.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- FlashMLA ---------------------------------------------------------------------------------------


def _v32_pool(b: int, ctx: int, page: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = -(-ctx // page)
    n_blocks = b * w + 2
    table = torch.randperm(n_blocks, generator=g)[: b * w].view(b, w).to(torch.int32)
    tokens = (torch.randn(b * w * page, 576, generator=g) / 4).clamp(-1, 1)
    pool = torch.zeros(n_blocks, page, 656, dtype=torch.uint8)
    pool[table.flatten().long()] = V32Format().quantize(tokens).view(b * w, page, 656)
    return pool.cuda(), table.cuda()


def _sparse_reference(
    q: torch.Tensor, kc: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    b, s_q, h, d = q.shape
    rows, valid = L.v32_rows(kc, idx)
    k = idx.shape[-1]
    qf, rf, vf = q.float().view(b * s_q, h, d), rows.view(b * s_q, k, d), valid.view(b * s_q, k)
    out = sink_attention_rows(qf, rf, vf, None, None, sink, scale)[..., :512]
    # a row with no valid key: FlashMLA gives 0 (lse +inf); the reference gives 0 where the head has a
    # sink and NaN (0 / 0) where its sink is -inf
    out = torch.where(vf.any(-1)[:, None, None], out, torch.zeros((), device=out.device))
    logits = (torch.einsum("nhd,nkd->nhk", qf, rf) * scale).masked_fill(~vf[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    lse = torch.where(torch.isfinite(lse), lse, float("inf"))
    return out.view(b, s_q, h, 512), lse.view(b, s_q, h)


@pytest.mark.parametrize(
    ("b", "s_q", "h", "page", "ctx", "k"),
    [(1, 1, 64, 64, 200, 64), (4, 1, 128, 64, 1000, 128), (3, 2, 64, 16, 300, 100), (2, 1, 128, 64, 64, 512)],
)
def test_flash_mla_sparse_decode(b: int, s_q: int, h: int, page: int, ctx: int, k: int) -> None:
    _need("flash_mla")
    from deepinfer_kernels.cuda import adapters

    g = _gen(b * 1000 + ctx)
    pool, table = _v32_pool(b, ctx, page, g)
    pos = torch.stack([torch.randperm(ctx, generator=g)[: min(k, ctx)] for _ in range(b * s_q)])
    pos = torch.nn.functional.pad(pos, (0, k - pos.shape[1]), value=-1).view(b, s_q, k)
    pos[0, 0, : k // 4] = -1
    if b > 1:
        pos[1, 0] = -1  # a query with no valid key: output 0, lse +inf
    q = (torch.randn(b, s_q, h, 576, generator=g) / 2).clamp(-1, 1).to(torch.bfloat16).cuda()
    sink = torch.randn(h, generator=g)
    sink[: h // 4] = float("-inf")  # no sink on those heads
    sink = sink.cuda()
    scale = 576**-0.5
    out, lse = adapters.flash_mla_sparse_decode(
        q, pool, pos.cuda(), table, page, sm_scale=scale, attn_sink=sink
    )
    assert out.shape == (b, s_q, h, 512) and out.dtype == torch.bfloat16
    idx = L.flash_mla_indices(pos.cuda(), table, page)
    want, want_lse = _sparse_reference(q, L.flash_mla_kv_cache(pool, page), idx, sink, scale)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    lse = lse if lse.shape == (b, s_q, h) else lse.transpose(1, 2)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin], want_lse[fin], atol=1e-3, rtol=1e-3)
    if b > 1:
        assert (out[1, 0] == 0).all()


def test_flash_mla_rejects_what_sm90_cannot_run() -> None:
    _need("flash_mla")
    from deepinfer_kernels.cuda import flash_mla_adapter as fma

    q = torch.zeros(1, 1, 32, 576, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="h_q"):
        fma.sparse_decode_raw(
            q,
            torch.zeros(1, 64, 1, 656, dtype=torch.uint8, device="cuda"),
            torch.zeros(1, 1, 64, dtype=torch.int32, device="cuda"),
        )


@pytest.mark.parametrize(("b", "h", "ctx"), [(1, 64, 100), (4, 128, 700)])
def test_flash_mla_dense_decode(b: int, h: int, ctx: int) -> None:
    _need("flash_mla")
    from deepinfer_kernels.cuda import flash_mla_adapter as fma

    g = _gen(ctx)
    page = 64
    w = -(-ctx // page)
    table = torch.randperm(b * w, generator=g).view(b, w).to(torch.int32)
    kc = (torch.randn(b * w, page, 1, 576, generator=g) / 4).to(torch.bfloat16)
    lens = torch.randint(1, ctx + 1, (b,), generator=g).to(torch.int32)
    q = (torch.randn(b, 1, h, 576, generator=g) / 2).to(torch.bfloat16)
    out, _ = fma.dense_decode(q.cuda(), kc.cuda(), table.cuda(), lens.cuda(), sm_scale=576**-0.5)
    for i in range(b):
        n = int(lens[i])
        slots = (table[i].long()[:, None] * page + torch.arange(page)).flatten()[:n]
        keys = kc.view(-1, 576)[slots].float()
        want = sink_attention_rows(
            q[i, 0].float()[None],
            keys[None],
            torch.ones(1, n, dtype=torch.bool),
            None,
            None,
            torch.full((h,), float("-inf")),
            576**-0.5,
        )[0, :, :512]
        torch.testing.assert_close(out[i, 0].float().cpu(), want, atol=1e-2, rtol=1e-2)


# --- DeepGEMM -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "extra"),
    [([0, 5, 130, 1, 0, 7, 64, 3], 2), ([1], 0), ([0, 0, 3, 0], 0), ([40] * 8, 0)],
)
@pytest.mark.parametrize("masked", [True, False])
def test_deep_gemm_grouped_fp8(counts: list[int], extra: int, masked: bool) -> None:
    _need("deep_gemm")
    from deepinfer_kernels.cuda import adapters

    g = _gen(sum(counts) * 7 + len(counts) + masked)
    e, n, k = len(counts), 256, 512
    x = torch.randn(sum(counts) + extra, k, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16).cuda()
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    w8, ws = L.quantize_fp8_blocks(w)
    got = adapters.deep_gemm_grouped_fp8(x, w8, ws, offs, masked=masked)
    assert got.shape == (x.shape[0], n) and got.dtype == torch.bfloat16
    xq = L.dequantize_fp8_tokens(*L.quantize_fp8_tokens(x))
    want = gg_ref.moe_grouped_gemm(xq, L.dequantize_fp8_blocks(w8, ws), offs)
    assert calc_diff(got, want) < 1e-3
    assert calc_diff(got, gg_ref.moe_grouped_gemm(x.float(), w.float(), offs)) < 2e-2
    if extra:
        assert (got[-extra:] == 0).all()  # rows past offs[-1]


def test_deep_gemm_mqa_logits() -> None:
    _need("deep_gemm")
    from deepinfer_kernels.cuda import deep_gemm_adapter as dga

    g = _gen(11)
    t, h, d, s = 48, 64, 128, 777
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16).cuda()
    wts = torch.randn(t, h, generator=g).cuda()
    keys = torch.randn(s, d, generator=g).to(torch.bfloat16).cuda()
    ks = torch.randint(0, 100, (t,), generator=g).to(torch.int32).cuda()
    ke = torch.minimum(ks + torch.randint(0, s, (t,), generator=g).cuda().int(), torch.tensor(s).cuda()).int()
    got = dga.mqa_logits(q, wts, keys, ks, ke)
    q8, w2 = L.fold_q_scales(q, wts)
    k8, ksf = L.fp8_index_keys(keys)
    s_q = w2 / wts
    sim = ix_ref.indexer_scores(q8.float() * s_q[..., None], wts, k8.float() * ksf[:, None], ks, ke)
    fin = torch.isfinite(sim)
    assert torch.equal(torch.isfinite(got), fin)
    assert calc_diff(got[fin], sim[fin]) < 1e-5
    assert calc_diff(got[fin], ix_ref.indexer_scores(q, wts, keys, ks, ke)[fin]) < 1e-3


@pytest.mark.parametrize(("b", "next_n", "page"), [(1, 1, 64), (4, 2, 128), (6, 1, 64)])
def test_deep_gemm_paged_logits_over_our_mxfp4_pool(b: int, next_n: int, page: int) -> None:
    _need("deep_gemm")
    from deepinfer_kernels.cuda import deep_gemm_adapter as dga

    g = _gen(b * 10 + next_n)
    h, d, max_ctx = 64, 128, 700
    w = -(-max_ctx // page)
    n_pages = b * w + 1
    pool = MXFP4Format().quantize(torch.randn(n_pages * page, d, generator=g)).view(n_pages, page, 68).cuda()
    table = torch.randperm(n_pages, generator=g)[: b * w].view(b, w).to(torch.int32).cuda()
    ctx = torch.randint(next_n, max_ctx + 1, (b,), generator=g).to(torch.int32).cuda()
    q = torch.randn(b, next_n, h, d, generator=g).to(torch.bfloat16).cuda()
    wts = torch.randn(b * next_n, h, generator=g).cuda()
    got = dga.paged_mqa_logits_mxfp4(q, wts, pool, table, page, ctx, w * page)
    assert got.shape == (b * next_n, w * page)
    q8, w2 = L.fold_q_scales(q.view(-1, h, d), wts)
    qdq = q8.float() * (w2 / wts)[..., None]
    keys_all = MXFP4Format().dequantize(pool.view(-1, 68))
    cl = L.context_lens_2d(ctx, next_n)
    for i in range(b):
        slots = (table[i].long()[:, None] * page + torch.arange(page, device="cuda")).flatten()
        keys = keys_all[slots]
        for j in range(next_n):
            r, n = i * next_n + j, int(cl[i, j])
            want = ix_ref.indexer_scores(
                qdq[r : r + 1],
                wts[r : r + 1],
                keys,
                torch.zeros(1, dtype=torch.int32, device="cuda"),
                torch.full((1,), n, dtype=torch.int32, device="cuda"),
            )[0]
            assert torch.equal(torch.isfinite(got[r]), torch.isfinite(want))
            assert calc_diff(got[r, :n], want[:n]) < 1e-5


# --- DeepSelect ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 4096, 64), (64, 8192, 512), (8, 20000, 2048), (3, 100, 128)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deep_select_indexer_topk(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    _need("deep_select")
    from deepinfer_kernels.cuda import deep_select_adapter as dsa

    g = _gen(rows + n + k)
    scores = torch.randn(rows, n, generator=g).to(dtype)
    scores[0, n // 3 :] = float("-inf")  # a causal row with fewer valid keys than k (when n/3 < k)
    scores = scores.cuda()
    got = dsa.indexer_topk(scores, k)
    want = ix_ref.indexer_topk(scores, k)
    assert got.shape == (rows, k) and got.dtype == torch.int32
    for r in range(rows):
        nv = int((want[r] >= 0).sum())
        assert int((got[r] >= 0).sum()) == nv and (got[r, nv:] == -1).all()
        gv = torch.sort(scores[r, got[r, :nv].long()].float()).values
        wv = torch.sort(scores[r, want[r, :nv].long()].float()).values
        assert torch.equal(gv, wv)  # the same multiset of values: ties may pick other indices


@pytest.mark.parametrize(("rows", "k"), [(1, 1), (4, 50), (32, 1024)])
def test_deep_select_sampling_topk_sorted(rows: int, k: int) -> None:
    _need("deep_select")
    from deepinfer_kernels.cuda import adapters

    logits = torch.randn(rows, 129280, generator=_gen(k)).cuda() * 3
    vals, idx = adapters.deep_select_topk(logits, k, sorted=True)
    want = torch.topk(logits, k, dim=1).values
    assert torch.equal(vals, want)
    assert torch.equal(torch.gather(logits, 1, idx.long()), vals)


def test_switch_routes_the_cuda_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_KERNEL_LIBS=deep_select sends the cuda backend's indexer_topk through DeepSelect."""
    _need("deep_select")
    from deepinfer_kernels import get_op
    from deepinfer_kernels.cuda import deep_select_adapter as dsa

    calls = []
    real = dsa.indexer_topk
    monkeypatch.setattr(dsa, "indexer_topk", lambda s, k: calls.append(k) or real(s, k))
    scores = torch.randn(4, 1000, device="cuda")
    monkeypatch.setenv("DEEPINFER_KERNEL_LIBS", "none")
    get_op("indexer_topk", "cuda")(scores, 16)
    assert not calls
    monkeypatch.setenv("DEEPINFER_KERNEL_LIBS", "deep_select")
    got = get_op("indexer_topk", "cuda")(scores, 16)
    assert calls == [16] and got.shape == (4, 16)
    assert math.isclose(
        float(scores.gather(1, got.long()).sum()), float(torch.topk(scores, 16).values.sum()), rel_tol=1e-6
    )
