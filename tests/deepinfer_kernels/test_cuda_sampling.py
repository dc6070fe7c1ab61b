"""cuda ``sample`` (TileLang) against the torch reference on the same GPU: same tokens, batch-invariant."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _ops():
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG
    cuda, ref = get_op("sample", "cuda"), get_op("sample", "reference")
    assert cuda is not ref
    return cuda, ref


def _batch(b: int, vocab: int, g: torch.Generator, dtype: torch.dtype):
    logits = (torch.randn(b, vocab, generator=g) * 3).to(dtype)
    if b > 2:
        logits[1, vocab // 2 :] = float("-inf")  # grammar-masked half
        logits[2] = float("-inf")  # nothing allowed -> -1
    temperature = torch.rand(b, generator=g) * 1.5
    temperature[::4] = 0.0  # greedy rows
    top_k = torch.randint(-1, 60, (b,), generator=g)
    top_k[::3] = 0
    top_p = torch.rand(b, generator=g) * 0.5 + 0.5
    top_p[::2] = 1.0
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    positions = torch.randint(0, 100_000, (b,), generator=g)
    return [t.cuda() for t in (logits, temperature, top_k, top_p, seeds, positions)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "vocab"), [(1, 129_280), (33, 129_280), (16, 1000), (0, 1000)])
def test_same_tokens_as_reference(b: int, vocab: int, dtype: torch.dtype) -> None:
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(b * 1000 + vocab)
    for _ in range(3):
        args = _batch(b, vocab, g, dtype)
        got, want = cuda(*args), ref(*args)
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {b} rows differ"
        if b > 2:
            assert got[2] == -1 and got[1] < vocab // 2


def test_batch_invariant() -> None:
    cuda, _ = _ops()
    g = torch.Generator().manual_seed(9)
    args = _batch(24, 129_280, g, torch.float32)
    full = cuda(*args)
    for idx in (torch.tensor([5]), torch.tensor([23, 0, 7]), torch.arange(24).flip(0)):
        part = cuda(*[a[idx.cuda()] for a in args])
        assert torch.equal(part, full[idx.cuda()])


def test_distribution_follows_softmax() -> None:
    """Many positions of one request: token frequencies match softmax(logits / T) (chi-square, 8 tokens)."""
    cuda, _ = _ops()
    n = 20_000
    logits = (
        torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]], device="cuda").expand(n, -1).contiguous()
    )
    t = torch.full((n,), 0.8, device="cuda")
    toks = cuda(
        logits,
        t,
        torch.zeros(n, dtype=torch.int64, device="cuda"),
        torch.ones(n, device="cuda"),
        torch.full((n,), 1234, device="cuda"),
        torch.arange(n, device="cuda"),
    )
    counts = torch.bincount(toks, minlength=8).double().cpu()
    p = torch.softmax(logits[0].double().cpu() / 0.8, dim=0)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.3  # chi-square(7 dof) 99.9% quantile
