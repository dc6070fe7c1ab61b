"""In-place RoPE (``apply_rope_``, issue #24): only the rope dims are read and written.

Oracles: the functional ``apply_rope`` (bitwise, eagerly and both compiled under the fused glue) and an
independent float64 rotation written with complex numbers. CPU: Inductor's C++ code, read back to check
that the compiled function sees only the tail (no full-width tensor, no copy-back epilogue) and that the
bf16 pair form is one loop nest writing in place. GPU (marked ``gpu``): the same under the glue on CUDA,
one Triton kernel for the bf16 pairs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model import fusion
from deepinfer_core.model.layers import rope
from deepinfer_core.model.layers.rope import apply_rope, apply_rope_, rope_inv_freq


def oracle(
    x: torch.Tensor, positions: torch.Tensor, inv: torch.Tensor, r: int, interleave: bool
) -> torch.Tensor:
    """float64 rotation of the last r dims: each pair (re, im) times exp(i * position * inv_freq)."""
    x = x.double()
    d, h = x.shape[-1], r // 2
    tail = x[..., d - r :]
    if interleave:
        re, im = tail[..., 0::2], tail[..., 1::2]
    else:
        re, im = tail[..., :h], tail[..., h:]
    ang = positions.double()[:, None] * inv.double()[None, :]
    ang = ang.view((ang.shape[0],) + (1,) * (x.dim() - 2) + (h,))
    z = torch.complex(re, im) * torch.exp(1j * ang)
    out = x.clone()
    if interleave:
        out[..., d - r :: 2], out[..., d - r + 1 :: 2] = z.real, z.imag
    else:
        out[..., d - r : d - h], out[..., d - h :] = z.real, z.imag
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    t = draw(st.integers(1, 6))
    heads = draw(st.lists(st.integers(1, 4), max_size=2))
    r = 2 * draw(st.integers(1, 8))
    d = r + draw(st.integers(0, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dt = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    x = torch.randn(t, *heads, d, generator=g, dtype=torch.float64).to(dt)
    pos = torch.randint(0, 5000, (t,), generator=g)
    inv = rope_inv_freq(r, draw(st.sampled_from([10000.0, 160000.0])))
    return x, pos, inv, r, draw(st.booleans())


@settings(max_examples=120, deadline=None)
@given(cases())
def test_in_place_equals_functional_and_oracle(case: tuple) -> None:
    x, pos, inv, r, il = case
    want = apply_rope(x, pos, inv, r, il)
    y = x.clone()
    got = apply_rope_(y, pos, inv, r, il)
    assert got is y
    assert torch.equal(got, want)
    d = x.shape[-1]
    assert torch.equal(y[..., : d - r], x[..., : d - r])  # the other dims untouched
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 0.1}[x.dtype]
    assert (got.double() - oracle(x, pos, inv, r, il)).abs().max().item() <= tol * (
        1 + x.double().abs().max().item()
    )


@pytest.fixture
def inductor() -> Iterator[None]:
    fusion.set_backend("inductor")
    try:
        yield
    finally:
        fusion.set_backend(None)


@pytest.mark.parametrize(
    ("shape", "dt", "il"),
    [
        ((6, 4, 48), torch.bfloat16, True),
        ((5, 40), torch.bfloat16, True),
        ((6, 3, 40), torch.bfloat16, False),
        ((4, 2, 40), torch.float32, True),
    ],
)
def test_compiled_in_place_equals_compiled_functional(
    inductor: None, shape: tuple, dt: torch.dtype, il: bool
) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(dt)
    pos, inv = torch.randint(0, 9000, (shape[0],), generator=g), rope_inv_freq(16, 160000.0)
    with fusion.fused_glue():
        want = apply_rope(x, pos, inv, 16, il)
        y = x.clone()
        apply_rope_(y, pos, inv, 16, il)
    assert torch.equal(y, want)
    assert (y.double() - oracle(x, pos, inv, 16, il)).abs().max().item() < (
        0.05 if dt == torch.bfloat16 else 1e-4
    )


def _code(fn: object, *args: object) -> str:
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    fusion.reset()
    with config.patch(force_disable_caches=True), fusion.fused_glue():
        _, codes = run_and_get_code(fn, *args)
    # the angles (rope._angles: positions x inv_freq, cos, sin, casts) compile apart, as ONE kernel
    angles = [c for c in codes if "cos_mul_sin" in c]
    assert len(angles) == 1 and len(re.findall(r"cpp_fused\w* = async_compile", angles[0])) == 1
    return "\n".join(c for c in codes if c not in angles)


def test_compiled_code_touches_only_the_tail(inductor: None) -> None:
    """The compiled functions take the tail view (or its int32 pairs) and nothing of full width; the bf16
    pair form is one loop nest that stores to its input (in place, no separate copy-back)."""
    t, heads, d, r = 6, 4, 48, 16
    pos, inv = torch.arange(t) * 7, rope_inv_freq(r, 10000.0)
    x = torch.randn(t, heads, d).to(torch.bfloat16)
    code = _code(lambda: apply_rope_(x, pos, inv, r, True))
    sizes = re.findall(r"assert_size_stride\(\w+, \(([\d, ]+)\)", code)
    assert sorted(sizes) == sorted([f"{t * heads}, {r // 2}", f"{t}, {r // 2}", f"{t}, {r // 2}"]), sizes
    assert len(re.findall(r"cpp_fused\w* = async_compile", code)) == 1
    loops = re.findall(r"for\(int64_t x0=", code)
    assert len(loops) == 1, code  # one loop nest: the rotation is stored straight into the input
    assert ".copy_(" not in code
    # halves pairing (no pair view): the tail [t, heads, r] in, two loop nests (rotation, copy into the tail)
    code = _code(lambda: apply_rope_(x, pos, inv, r, False))
    sizes = re.findall(r"assert_size_stride\(\w+, \(([\d, ]+)\)", code)
    assert f"{t}, {heads}, {r}" in sizes and all(str(d) not in s.split(", ") for s in sizes), sizes
    assert ".copy_(" not in code


def test_pairs_view_only_for_even_bf16_layouts() -> None:
    x = torch.zeros(3, 2, 40, dtype=torch.bfloat16)
    assert rope._bf16_pairs(x[..., 24:], True).shape == (6, 8)
    assert rope._bf16_pairs(x[..., 24:], False) is None
    assert rope._bf16_pairs(x.float()[..., 24:], True) is None
    assert (
        rope._bf16_pairs(torch.zeros(3, 41, dtype=torch.bfloat16)[:, 25:], True) is None
    )  # odd offset / stride
    assert rope._bf16_pairs(x.transpose(0, 1)[..., 24:], True) is None  # heads not evenly strided over tokens


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("il", [True, False])
def test_glue_in_place_on_cuda_equals_functional(inductor: None, dt: torch.dtype, il: bool) -> None:
    """V4.1 query shapes (64 heads x 512, rope 64) under the glue on CUDA: bitwise the functional form;
    the bf16 interleaved pairs in one kernel."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 64, 512, generator=g, device="cuda").to(dt)
    pos = torch.randint(0, 60000, (64,), generator=g, device="cuda")
    inv = rope_inv_freq(64, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536}).cuda()
    with fusion.fused_glue(), rope.cached_angles():  # the angles cached: the profile sees the rotation alone
        want = apply_rope(x, pos, inv, 64, il)
        y = x.clone()
        apply_rope_(y, pos, inv, 64, il)
        y2 = x.clone()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            apply_rope_(y2, pos, inv, 64, il)
            torch.cuda.synchronize()
    assert torch.equal(y, want) and torch.equal(y2, want)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # bf16 pairs: one kernel, in place; otherwise the rotation and its copy into the tail
    assert len(kernels) == 1 if dt == torch.bfloat16 and il else len(kernels) <= 2, kernels
    assert (y.double() - oracle(x, pos, inv, 64, il)).abs().max().item() < (
        0.1 if dt == torch.bfloat16 else 1e-3
    )


@pytest.mark.parametrize(
    ("shape", "dt", "il"),
    [
        ((6, 40), torch.bfloat16, True),
        ((5, 40), torch.float32, True),
        ((7, 48), torch.float64, False),
        ((3, 2, 24), torch.bfloat16, False),
    ],
)
def test_norm_rope_equals_norm_then_rope(inductor: None, shape: tuple, dt: torch.dtype, il: bool) -> None:
    """``norm_rope`` (the SWA key's norm and rotation, one compiled function under the glue): eagerly the
    reference's calls bitwise; compiled, against a float64 oracle (the norm in float64, then the complex
    rotation) at the dtype's rounding, and one loop nest in Inductor's code."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from deepinfer_core.model.layers.norm import rms_norm

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dt)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dt)
    pos, inv = torch.randint(0, 9000, (shape[0],), generator=g), rope_inv_freq(16, 160000.0)
    eager = rope.norm_rope(x, w, 1e-6, pos, inv, 16, il)
    assert torch.equal(eager, apply_rope_(rms_norm(x, w, 1e-6), pos, inv, 16, il))
    fusion.reset()
    with config.patch(force_disable_caches=True), fusion.fused_glue():
        fused, codes = run_and_get_code(rope.norm_rope, x, w, 1e-6, pos, inv, 16, il)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    want = oracle(normed, pos, inv, 16, il)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dt]
    assert fused.dtype == dt and (fused.double() - want).abs().max().item() <= tol * want.abs().max().item()
    body = [c for c in codes if "cos_mul_sin" not in c]  # the angles compile apart (rope._angles)
    assert len(re.findall(r"cpp_fused\w* = async_compile", "\n".join(body))) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("il", [True, False])
def test_norm_rope_on_cuda_is_few_kernels_and_accurate(inductor: None, il: bool) -> None:
    """The V4.1 SWA key (512 dims, rope 64, bf16) under the glue on CUDA: one reduction and at most two
    pointwise kernels (the angles cached), fewer launches than the unfused calls, within bf16 rounding of
    the float64 norm-then-rotate oracle, and as close to it as the unfused calls.

    Inductor's CUDA code splits what its CPU code keeps in one loop nest: the row's mean of squares as a
    persistent reduction, then the output's rotated tail and its plain head as two pointwise kernels (the
    two parts of one cat); seen on the H200, 2026-12-05 (the earlier one-kernel bound was the CPU's)."""
    from deepinfer_core.model.layers.norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    x = (3 * torch.randn(64, 512, generator=g, device="cuda")).bfloat16()
    w = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).bfloat16()
    pos = torch.randint(0, 60000, (64,), generator=g, device="cuda")
    inv = rope_inv_freq(64, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536}).cuda()
    with fusion.fused_glue(), rope.cached_angles():
        got = rope.norm_rope(x, w, 1e-20, pos, inv, 64, il)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            rope.norm_rope(x, w, 1e-20, pos, inv, 64, il)
            torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof_unfused:
        unfused = apply_rope_(rms_norm(x, w, 1e-20), pos, inv, 64, il)
        torch.cuda.synchronize()

    def kernels(p: torch.profiler.profile) -> list[str]:
        return [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    fused_k, unfused_k = kernels(prof), kernels(prof_unfused)
    assert len(fused_k) <= 3 and len(fused_k) < len(unfused_k), (fused_k, unfused_k)
    assert sum(k.startswith(("triton_per_", "triton_red_")) for k in fused_k) == 1, fused_k
    xd = x.double()
    want = oracle(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-20) * w.double(), pos, inv, 64, il)
    err, err_unfused = ((t.double() - want).abs().max().item() for t in (got, unfused))
    assert err <= 2e-2 * want.abs().max().item() and err <= 1.5 * err_unfused + 1e-6, (err, err_unfused)
