"""``MoE.pack_gate_up``: the gate and up projections as the two halves of one tensor (issue #24: one
grouped GEMM of twice the width at decode). Oracles: the same layer unpacked (float64, to rounding) and
the grouped-GEMM path without the pack (bf16, forced on the CPU); the parameters keep their values and
names, and a pack that something undid (``.to()``) is ignored, never read stale."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.layers import moe as moe_mod
from deepinfer_core.model.layers.moe import MoE

D64 = torch.float64


def _layer(seed: int, dtype: torch.dtype = D64) -> MoE:
    m = MoE(tiny_config()).to(dtype)
    m.reset_parameters(torch.Generator().manual_seed(seed))
    return m


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40))
def test_packed_equals_unpacked_float64(seed: int, n: int) -> None:
    a = _layer(seed)
    b = copy.deepcopy(a)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    b.pack_gate_up()
    b.pack_gate_up()  # idempotent
    assert b._packed() is not None and b._shared_packed() is not None
    after = b.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(n, a.w1.shape[2], dtype=D64, generator=torch.Generator().manual_seed(seed + 1)) * 2
    for static in (False, True):
        with moe_mod.static_shapes(static), torch.no_grad():  # inference: the packed products are used
            (ya, ca), (yb, cb) = a(x), b(x)
        assert torch.equal(ca, cb)
        assert (ya - yb).abs().max().item() <= 1e-12 * max(1.0, ya.abs().max().item())


def test_writes_through_the_parameters_reach_the_pack() -> None:
    a = _layer(3)
    b = copy.deepcopy(a)
    b.pack_gate_up()
    with torch.no_grad():  # what load_state_dict / an EPLB weight move do: copy_ into the parameter
        a.w3[1].mul_(-0.5)
        b.w3[1].mul_(-0.5)
        a.s_w1.add_(0.25)
        b.s_w1.add_(0.25)
    x = torch.randn(9, a.w1.shape[2], dtype=D64)
    with torch.no_grad():
        assert torch.allclose(a(x)[0], b(x)[0], rtol=0, atol=1e-12)
    assert torch.equal(b._w13[:, b.w1.shape[1] :], b.w3.data)


def test_a_replaced_parameter_disables_the_pack() -> None:
    b = _layer(5)
    b.pack_gate_up()
    b.w1.data = b.w1.data.clone()  # as .to() / load_state_dict(assign=True) would: the pack is stale
    with torch.no_grad():
        b.w1.mul_(2.0)
    assert b._packed() is None
    ref = _layer(5)
    with torch.no_grad():
        ref.w1.mul_(2.0)
    x = torch.randn(7, b.w1.shape[2], dtype=D64)
    with torch.no_grad():
        assert torch.allclose(b(x)[0], ref(x)[0], rtol=0, atol=1e-12)


def test_grouped_static_path_packs_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped-GEMM static path (bf16; forced on the CPU) packs on its first eager call and gives the
    unpacked grouped path's outputs (same products, one GEMM instead of two: rounding only)."""
    monkeypatch.setattr(moe_mod, "_grouped_ok", lambda x: x.dtype == torch.bfloat16)
    a = _layer(11, torch.bfloat16)
    b = copy.deepcopy(a)
    x = torch.randn(21, a.w1.shape[2], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    monkeypatch.setattr(a, "pack_gate_up", lambda: None)  # a stays unpacked
    with moe_mod.static_shapes(), torch.no_grad():
        ya, ca = a(x)
        yb, cb = b(x)
    assert a._packed() is None and b._packed() is not None
    assert torch.equal(ca, cb)
    assert ((yb.float() - ya.float()).norm() / ya.float().norm()).item() < 1e-2


def test_under_autograd_the_parameters_get_their_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack is a plain tensor: with autograd on, every path computes from the parameters, so a packed
    layer's gradients equal an unpacked one's (and the grouped path does not pack)."""
    a = _layer(13)
    b = copy.deepcopy(a)
    b.pack_gate_up()
    x = torch.randn(11, a.w1.shape[2], dtype=D64, generator=torch.Generator().manual_seed(2))
    for m in (a, b):
        with moe_mod.static_shapes():
            m(x)[0].square().sum().backward()
    for name in ("w1", "w3", "w2", "s_w1", "s_w3", "s_w2"):
        ga, gb = getattr(a, name).grad, getattr(b, name).grad
        assert ga is not None and gb is not None and torch.allclose(ga, gb, rtol=0, atol=1e-10), name
    monkeypatch.setattr(moe_mod, "_grouped_ok", lambda x: x.dtype == torch.bfloat16)
    c = _layer(14, torch.bfloat16)
    c(torch.randn(5, c.w1.shape[2]).to(torch.bfloat16))[0].float().sum().backward()
    assert c._packed() is None and c.w1.grad is not None and c.w3.grad is not None


def test_grouped_path_serves_plain_calls_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where grouped GEMMs apply, a call outside static mode (a prefill) takes them too (no bincount /
    .tolist() host synchronisation): its outputs match the grouped loop's and its counts are the same."""
    monkeypatch.setattr(moe_mod, "_grouped_ok", lambda x: x.dtype == torch.bfloat16)
    m = _layer(15, torch.bfloat16)
    x = torch.randn(40, m.w1.shape[2], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    calls: list[int] = []
    real = m._forward_static
    monkeypatch.setattr(m, "_forward_static", lambda x, mask: calls.append(1) or real(x, mask))
    with torch.no_grad():
        y, c = m(x)
        ref, rc = m._forward_loop(x)
    assert calls and torch.equal(c, rc)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.parametrize(
    ("over", "fused"),
    [
        ({}, True),
        ({"shared_expert_clamp": False}, False),
        ({"n_shared_experts": 2}, False),
        ({"n_shared_experts": 0}, False),
        ({"shared_expert_clamp": False, "swiglu_limit": 0.0}, True),
    ],
)
def test_shared_expert_as_one_more_group(over: dict, fused: bool) -> None:
    """``moe.FUSE_SHARED``: with one shared expert of the routed width, clamped as they are, the packed
    tensors gain it as block E and the static path's grouped products carry it as group E (E + 1 weight
    blocks, n more rows); otherwise (another clamp, two shared experts, none) the separate products run.
    Either way the layer equals its grouped loop (float64), the state_dict is unchanged, and a replaced
    shared parameter drops the group (the new value is used, never the stale pack)."""
    from deepinfer_kernels import get_backend

    seed = torch.seed() % 2**31
    cfg = tiny_config(**{"swiglu_limit": 10.0, **over})
    m = MoE(cfg).to(D64)
    m.reset_parameters(torch.Generator().manual_seed(seed))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    op = get_backend("reference").op("moe_grouped_gemm")
    groups: list[int] = []

    def spy(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        groups.append(w.shape[0])
        assert offs.shape[0] == w.shape[0] and int(offs[-1]) == x.shape[0]  # every row is a group's
        return op(x, w, offs)

    x = torch.randn(13, cfg.hidden_size, dtype=D64, generator=torch.Generator().manual_seed(seed + 1)) * 2
    for replace in (False, True):
        if replace:
            with torch.no_grad():
                for name in ("s_w2", "w2") if m.shared else ("w2",):
                    p = getattr(m, name)
                    p.data = p.data.clone() * 0.5  # as .to() / an assigning load would
        want, wc = m._forward_loop(x)
        groups.clear()
        with torch.no_grad(), moe_mod.static_shapes(), moe_mod.grouped_gemm_impl(spy):
            got, gc = m(x)
        e = cfg.n_routed_experts + (1 if fused else 0)
        assert groups == [e, e], (over, groups)  # packed gate / up, then down
        assert (m._shared_group() is not None) == fused
        assert torch.equal(gc, wc)
        assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), seed
        if not replace:
            after = m.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
            if fused:  # the parameters are views of the group tensors' blocks
                a13, a2 = m._shared_group()
                assert m.s_w1.data_ptr() == a13[-1].data_ptr() and m.s_w2.data_ptr() == a2[-1].data_ptr()
