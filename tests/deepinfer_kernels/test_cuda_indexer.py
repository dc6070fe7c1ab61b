"""cuda ``indexer_scores`` (TileLang GEMM) against a float64 oracle and the reference; top-k by score values."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _inputs(t: int, s: int, h: int, d: int, g: torch.Generator):
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(s, d, generator=g).to(torch.bfloat16).cuda()
    w = torch.rand(t, h, generator=g).cuda()
    ke = torch.randint(0, s + 1, (t,), generator=g)
    ks = (ke - torch.randint(0, s + 1, (t,), generator=g)).clamp(min=0)
    if t:
        ks[0], ke[0] = 0, s  # one full row
    return q, w, k, ks.to(torch.int32).cuda(), ke.to(torch.int32).cuda()


@pytest.mark.parametrize(
    ("t", "s", "h", "d"),
    [(1, 129, 32, 128), (37, 1000, 32, 128), (16, 64, 64, 128), (5, 300, 4, 32), (0, 64, 32, 128)],
)
def test_scores_within_tolerance(t: int, s: int, h: int, d: int) -> None:
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG
    cuda, ref = get_op("indexer_scores", "cuda"), get_op("indexer_scores", "reference")
    assert cuda is not ref
    g = torch.Generator().manual_seed(t * 100 + s)
    q, w, k, ks, ke = _inputs(t, s, h, d, g)
    got = cuda(q, w, k, ks, ke)
    want = ref(q.double(), w.double(), k.double(), ks, ke)  # float64 oracle (bf16 inputs are exact in it)
    assert got.shape == (t, s) and got.dtype == torch.float32
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)  # same -inf pattern, exactly
    if fin.any():
        err = (got[fin].double() - want[fin]).norm() / want[fin].norm().clamp_min(1e-30)
        assert err < 1e-5, f"relative error {err:.2e}"  # fp32 accumulation of exact bf16 products


def test_topk_picks_top_scores() -> None:
    sc, topk = get_op("indexer_scores", "cuda"), get_op("indexer_topk", "cuda")
    g = torch.Generator().manual_seed(3)
    q, w, k, ks, ke = _inputs(9, 2048, 32, 128, g)
    ke[1], ks[1] = 100, 0  # fewer valid keys than k: padded with -1
    scores = sc(q, w, k, ks, ke)
    idx = topk(scores, 512)
    want = get_op("indexer_topk")(scores, 512)
    assert idx.shape == (9, 512) and idx.dtype == torch.int32
    assert torch.equal((idx < 0).sum(1), (want < 0).sum(1))
    for r in range(9):
        a, b = idx[r][idx[r] >= 0], want[r][want[r] >= 0]
        assert torch.equal(torch.sort(scores[r, a.long()]).values, torch.sort(scores[r, b.long()]).values)
