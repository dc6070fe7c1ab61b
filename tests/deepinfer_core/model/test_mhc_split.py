"""The fused glue's mHC coefficient GEMM (mhc.SPLIT_GEMM): the bf16 state times phi as bf16 parts
(mhc.split_bf16), the norm applied after, against a float64 oracle with fresh random inputs.

The bound asserted is the numerical argument of mhc.split_bf16: for a float32 phi the parts miss phi by
<= 2**-16 |phi| per element (so the product by <= 2**-16 of sum_c |x_c phi_c|, x the normalised state); the
products of bf16 values are exact in float32, so what remains is float32 accumulation, allowed 2**-20 of
the same sum (the float32 reference GEMM's own error on these inputs is ~2**-26 of it). CPU runs the split
form through a float32 GEMM of the same exact products; the GPU test (marked ``gpu``) runs cuBLAS's bf16
GEMM with float32 output, eagerly and compiled by Inductor inside the glue.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model import fusion, mhc
from deepinfer_core.model.config import tiny_config

ACC = 2.0**-20  # float32 accumulation allowance, of sum |x_c phi_c|


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)))


def _inputs(
    seed: int, t: int, d: int, phi_dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # per-token scales over several octaves: the norm factor is applied after the product in the split form
    state = torch.randn(t, 4, d, generator=g) * torch.exp2(
        torch.randint(-6, 7, (t, 1, 1), generator=g).float()
    )
    phi = torch.randn(2, 24, 4 * d, generator=g) / (4 * d) ** 0.5
    return state.to(torch.bfloat16).to(device), phi.to(phi_dtype).to(device)


def _oracle(state: torch.Tensor, phi: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, sum_c |x_c phi_c|) [T, S, k] in float64 from the same (rounded) inputs."""
    s = state.double().reshape(state.shape[0], -1)
    x = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    p = phi.double()
    return torch.einsum("tc,skc->tsk", x, p), torch.einsum("tc,skc->tsk", x.abs(), p.abs())


def _check(state: torch.Tensor, phi: torch.Tensor, got: torch.Tensor) -> None:
    want, mag = _oracle(state.cpu(), phi.cpu(), 1e-6)
    allow = mag * (ACC + (2.0**-16 if phi.dtype != torch.bfloat16 else 0.0))
    err = (got.double().cpu() - want).abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (err <= allow).all(), f"max err / allowance {(err / allow).max().item():.3g}"


@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_split_bf16_parts_sum_to_phi(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over a wide exponent range (the bound is relative, per element)
    phi = (
        torch.randn(2, 3, 64, generator=g, dtype=torch.float64)
        * torch.exp2(torch.randint(-40, 40, (2, 3, 64), generator=g))
    ).to(dtype)
    parts = mhc.split_bf16(phi)
    assert parts.dtype == torch.bfloat16 and parts.shape[1:] == phi.shape
    if dtype == torch.bfloat16:
        assert parts.shape[0] == 1 and torch.equal(parts[0], phi)
        return
    assert parts.shape[0] == 2
    p = phi.to(torch.float32).double()  # the split starts from phi in float32
    assert ((parts.double().sum(0) - p).abs() <= 2.0**-16 * p.abs()).all()


@pytest.mark.parametrize("phi_dtype", [torch.float32, torch.bfloat16])
def test_split_product_is_within_the_bound_of_float64(phi_dtype: torch.dtype) -> None:
    """Wide widths (C = 4 x 5120, K of the V4.1-Flash product), fresh random inputs."""
    state, phi = _inputs(_fresh_seed(), 16, 5120, phi_dtype)
    got = mhc._raw(state, None, mhc.split_bf16(phi), torch.float32, 1e-6)
    _check(state, phi, got)
    # the reference form on the same inputs: the same bound holds for it (the split changes no order)
    _check(state, phi, mhc._raw(state, phi, None, torch.float32, 1e-6))


def test_module_uses_the_split_under_the_glue_only_and_refreshes_it() -> None:
    """MHCResidual: the split form runs inside the fused glue for a bf16 state (both the plain-Sinkhorn and
    the Sinkhorn-kernel branches), is cached per layer, rebuilt when phi changes, and gives the float64
    oracle's coefficients to bf16 rounding; outside the glue nothing is split."""
    cfg = tiny_config()
    res = mhc.MHCResidual(cfg)
    res.reset_parameters(torch.Generator().manual_seed(_fresh_seed()))
    res64 = mhc.MHCResidual(cfg).double()
    res64.load_state_dict(res.state_dict())
    g = torch.Generator().manual_seed(_fresh_seed())
    state = torch.randn(9, cfg.hc_mult, cfg.hidden_size, generator=g).to(torch.bfloat16)
    want = res64.coefficients(state.double(), 2, 0)
    fusion.set_backend("aot_eager")
    try:
        with torch.no_grad():
            res.coefficients(state, 2, 0)
            assert res._splits == {}  # no glue: the reference form
            for sk in (None, mhc.sinkhorn):
                with fusion.fused_glue(), mhc.sinkhorn_impl(sk):
                    got = res.coefficients(state, 2, 0)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a.double(), b, rtol=2**-7, atol=2**-8)
            assert list(res._splits) == [(2, 0, 1)]
            split = res._splits[(2, 0, 1)][1]
            res.phi[2, 0].mul_(-1)  # a weight load: the cached split must not be used again
            res64.phi[2, 0].mul_(-1)
            want = res64.coefficients(state.double(), 2, 0)
            with fusion.fused_glue():
                got = res.coefficients(state, 2, 0)
            assert res._splits[(2, 0, 1)][1] is not split
            for a, b in zip(got, want):
                torch.testing.assert_close(a.double(), b, rtol=2**-7, atol=2**-8)
    finally:
        fusion.set_backend(None)


@pytest.mark.gpu
@pytest.mark.parametrize("phi_dtype", [torch.float32, torch.bfloat16])
def test_split_product_on_cuda_is_within_the_bound(phi_dtype: torch.dtype) -> None:
    """cuBLAS's bf16 GEMM with float32 output (``torch.mm(out_dtype=)``), eagerly and compiled by Inductor
    as the glue runs it, at the wide decode shape (T = 64, C = 20480, N = 48 / 96)."""
    state, phi = _inputs(_fresh_seed(), 64, 5120, phi_dtype, "cuda")
    split = mhc.split_bf16(phi)
    _check(state, phi, mhc._raw(state, None, split, torch.float32, 1e-6))
    compiled = torch.compile(mhc._raw, fullgraph=True)
    _check(state, phi, compiled(state, None, split, torch.float32, 1e-6))
