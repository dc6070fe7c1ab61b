"""apply_token_bitmask: the torch reference against a per-token brute force; the cuda op against it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_kernels import get_op
from deepinfer_kernels.ops.token_bitmask import unpack_bitmask

apply = get_op("apply_token_bitmask")


def _random_bitmask(rng: np.random.Generator, rows: int, words: int, p: float) -> torch.Tensor:
    bits = rng.random((rows, words * 32)) < p
    packed = (bits.reshape(rows, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


def _brute(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone().double()
    bm = bitmask.numpy().view(np.uint32)
    for r in range(logits.shape[0]) if rows is None else rows:
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= bm.shape[1] or not (int(bm[r, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, vocab = int(rng.integers(1, 6)), int(rng.integers(1, 300))
    words = (vocab + 31) // 32 + int(rng.integers(-1, 2))  # narrower, exact, and wider than the logits
    words = max(words, 1)
    bitmask = _random_bitmask(rng, rows, words, p=float(rng.random()))
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    sub = (
        sorted(set(rng.integers(0, rows, size=int(rng.integers(0, rows + 1))).tolist())) if seed % 2 else None
    )
    want = _brute(logits, bitmask, sub)
    got = apply(logits.clone(), bitmask, None if sub is None else torch.tensor(sub))
    assert torch.equal(got.double(), want)


def test_unpack_bit_order_and_sign_bit() -> None:
    bm = torch.tensor([[1 | (1 << 5), -(2**31)]], dtype=torch.int32)  # tokens 0, 5 and 63 (the sign bit)
    assert unpack_bitmask(bm, 64)[0].nonzero().flatten().tolist() == [0, 5, 63]


def test_masking_never_makes_nan_and_keeps_allowed_values() -> None:
    logits = torch.tensor([[float("nan"), 1.0, float("inf"), -3.0]])
    bm = torch.tensor([[0b0010]], dtype=torch.int32)  # only token 1
    out = apply(logits, bm)
    assert out.tolist() == [[float("-inf"), 1.0, float("-inf"), float("-inf")]]
    probs = torch.softmax(out, -1)
    assert not probs.isnan().any() and probs[0, 1] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_in_place(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    logits = torch.randn(3, 70).to(dtype)
    bm = _random_bitmask(rng, 3, 3, 0.5)
    out = apply(logits, bm)
    assert out is logits and out.dtype == dtype
    assert torch.equal(torch.isinf(out), ~unpack_bitmask(bm, 70))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bitmask: must be a 2-D int32"):
        apply(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="one row per logits row"):
        apply(torch.zeros(2, 8), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="logits: must be a 2-D floating"):
        apply(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(IndexError, match="rows: indices"):
        apply(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([2]))


@pytest.mark.gpu
def test_cuda_matches_reference() -> None:
    """The "cuda" op (the reference on the GPU until the TileLang kernel lands) equals the CPU reference."""
    rng = np.random.default_rng(7)
    logits = torch.randn(64, 129_280)
    bm = _random_bitmask(rng, 64, (129_280 + 31) // 32, 0.3)
    rows = torch.arange(0, 64, 3)
    want = apply(logits.clone(), bm, rows)
    cuda_op = get_op("apply_token_bitmask", "cuda")
    got = cuda_op(logits.cuda(), bm.cuda(), rows.cuda()).cpu()
    assert torch.equal(got, want)
