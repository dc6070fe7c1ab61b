"""cuda ``apply_token_bitmask`` (TileLang) against the torch reference: exact, incl. spec rows and odd sizes."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _ops():
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG, "tilelang must import on the GPU machine, else the cuda op is the reference"
    cuda, ref = get_op("apply_token_bitmask", "cuda"), get_op("apply_token_bitmask", "reference")
    assert cuda is not ref
    return cuda, ref


def _random_mask(rows: int, words: int, g: torch.Generator) -> torch.Tensor:
    m = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    if rows:  # some all-allowed and all-banned words, as grammars produce
        m[:, : words // 8] = -1
        m[:, words // 8 : words // 4] = 0
    return m.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 129_280), (37, 129_280), (5, 1000), (3, 31), (0, 129_280)])
def test_all_rows_exact(rows: int, vocab: int, dtype: torch.dtype) -> None:
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=g).to(dtype).cuda()
    mask = _random_mask(rows, words, g)
    want = ref(logits.clone(), mask)
    got = cuda(logits.clone(), mask)
    assert torch.equal(got, want)
    # independent check of one row: allowed logits untouched, banned ones -inf
    if rows:
        bits = ((mask[0].cpu().to(torch.int64)[:, None] >> torch.arange(32)) & 1).reshape(-1)[:vocab].bool()
        assert torch.equal(got[0].cpu()[bits], logits[0].cpu()[bits])
        assert torch.isneginf(got[0].cpu()[~bits]).all()


def test_columns_past_the_mask_are_banned() -> None:
    cuda, ref = _ops()
    logits = torch.randn(4, 1100, device="cuda")
    mask = torch.full((4, 33), -1, dtype=torch.int32, device="cuda")  # covers 1056 < 1100 columns
    got = cuda(logits.clone(), mask)
    assert torch.equal(got, ref(logits.clone(), mask))
    assert torch.isneginf(got[:, 1056:]).all() and torch.isfinite(got[:, :1056]).all()


@pytest.mark.parametrize("vocab", [129_280, 1000])
def test_spec_rows_layout(vocab: int) -> None:
    """Mixed batch: request i owns 1 + drafts_i rows; only constrained requests' rows are masked."""
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(vocab)
    drafts = [5, 0, 3, 5, 1]
    constrained = [True, False, True, False, True]
    offsets = [0]
    for d in drafts:
        offsets.append(offsets[-1] + 1 + d)
    rows = torch.tensor(
        [r for i, c in enumerate(constrained) if c for r in range(offsets[i], offsets[i + 1])],
        dtype=torch.int64,
    )
    n = offsets[-1]
    logits = torch.randn(n, vocab, generator=g).cuda()
    mask = _random_mask(n, (vocab + 31) // 32, g)
    got = cuda(logits.clone(), mask, rows.cuda())
    assert torch.equal(got, ref(logits.clone(), mask, rows))
    free = torch.ones(n, dtype=torch.bool)
    free[rows] = False
    assert torch.equal(got[free.cuda()], logits[free.cuda()])  # unconstrained rows untouched
    assert torch.equal(cuda(logits.clone(), mask, torch.empty(0, dtype=torch.int64)), logits)


def test_bad_input_named() -> None:
    cuda, _ = _ops()
    logits = torch.randn(2, 64, device="cuda")
    with pytest.raises(ValueError, match="bitmask"):
        cuda(logits, torch.zeros(3, 2, dtype=torch.int32, device="cuda"))
    with pytest.raises(IndexError, match="rows"):
        cuda(logits, torch.zeros(2, 2, dtype=torch.int32, device="cuda"), torch.tensor([0, 2]))
