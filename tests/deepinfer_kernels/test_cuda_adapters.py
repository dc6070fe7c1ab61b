"""Adapters to DeepSeek's libraries: absent ones fail with a clear error; tile_kernels' gating vs torch."""

from __future__ import annotations

import pytest
import torch


def test_missing_library_is_named() -> None:
    from deepinfer_kernels.registry import available_libraries

    if available_libraries()["deep_select"]:
        pytest.skip("deep_select is installed here")
    import importlib

    if not torch.cuda.is_available():  # the cuda package refuses to import without a device
        pytest.skip("needs a CUDA device to import deepinfer_kernels.cuda")
    ad = importlib.import_module("deepinfer_kernels.cuda.adapters")
    with pytest.raises(RuntimeError, match="deep_select"):
        ad.deep_select_topk(torch.zeros(1, 4, device="cuda"), 2)
    with pytest.raises(ValueError, match="lib"):
        ad.available("nope")


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 384, 6), (1000, 384, 6), (77, 8, 2), (0, 64, 4)])
def test_tile_kernels_topk_gate_matches_torch(tokens: int, experts: int, k: int) -> None:
    from deepinfer_kernels.cuda import adapters as ad

    if not ad.available("tile_kernels"):
        pytest.skip("tile_kernels not importable")
    g = torch.Generator().manual_seed(tokens + experts)
    scores = torch.randn(tokens, experts, generator=g)
    if tokens:
        scores[0, :10] = 1.5  # exact ties: the smaller expert id must win
    got = ad.tile_kernels_topk_gate(scores.cuda(), k).cpu()
    assert got.shape == (tokens, k) and got.dtype == torch.int64
    # oracle: stable sort by (-score, id)
    want = torch.sort(-scores, dim=1, stable=True).indices[:, :k]
    assert torch.equal(torch.sort(got, dim=1).values, torch.sort(want, dim=1).values)
