"""``mhc_sinkhorn``: the reference against the model's Sinkhorn (CPU), the TileLang kernel against the
reference and inside a CUDA graph (GPU), and the executor's opt-in fused path (GPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.mhc import sinkhorn, sinkhorn_impl
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_kernels import get_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_is_the_models_sinkhorn(dtype: torch.dtype) -> None:
    x = 4 * torch.randn(37, 2, 4, 4, dtype=dtype, generator=torch.Generator().manual_seed(1))
    got = get_backend("reference").op("mhc_sinkhorn")(x, 20)
    assert torch.equal(got, sinkhorn(x, 20))
    assert torch.allclose(got.sum(-2), torch.ones((), dtype=dtype))  # columns exactly normalised last


def test_reference_refuses_bad_input() -> None:
    op = get_backend("reference").op("mhc_sinkhorn")
    with pytest.raises(ValueError, match="logits"):
        op(torch.zeros(3, 4, 5), 20)
    with pytest.raises(ValueError, match="iters"):
        op(torch.zeros(3, 4, 4), -1)


def test_sinkhorn_impl_routes_the_mhc_residual() -> None:
    model = DeepSeekV41.from_config(tiny_config(), seed=2, dtype=torch.float64)
    toks = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(2))
    want = model.forward_full(toks)[0]
    calls = []

    def spy(x: torch.Tensor, iters: int) -> torch.Tensor:
        calls.append(x.shape)
        return get_backend("reference").op("mhc_sinkhorn")(x, iters)

    with sinkhorn_impl(spy):
        got = model.forward_full(toks)[0]
    assert calls and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("iters", [0, 1, 20])
def test_kernel_matches_reference(n: int, iters: int) -> None:
    cuda, ref = get_backend("cuda").op("mhc_sinkhorn"), get_backend("reference").op("mhc_sinkhorn")
    for t in (1, 64, 300):
        x = 6 * torch.randn(t, 2, n, n, generator=torch.Generator().manual_seed(t + n)).cuda()
        want = ref(x.double(), iters)
        out = torch.full_like(x, float("nan"))
        got = cuda(x, iters)
        out.copy_(got)
        assert not out.isnan().any()
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5, (t, n, iters)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph() -> None:
    cuda = get_backend("cuda").op("mhc_sinkhorn")
    x = torch.randn(64, 2, 4, 4, device="cuda")
    want = cuda(x, 20)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cuda(x, 20)
    x.copy_(torch.randn(64, 2, 4, 4, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert ((y - cuda(x, 20)).abs().max()).item() == 0 and not torch.equal(y, want)


@pytest.mark.gpu
def test_executor_fused_sinkhorn_keeps_greedy_tokens() -> None:
    from tests.deepinfer_core.model.test_cuda_graphs import greedy_plain_and_flagged

    model = DeepSeekV41.from_config(tiny_config(), seed=8, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(31)
    prompts = {i: torch.randint(0, 512, (30 + 9 * i,), generator=g) for i in range(3)}
    (tp, lp), (tf, lf), fused = greedy_plain_and_flagged(model, False, prompts, 12, 5, fused_sinkhorn=True)
    assert not fused.ex.graphs().failed and tp == tf
    assert max(((a - b).norm() / a.norm()).item() for a, b in zip(lp, lf)) < 1e-4
