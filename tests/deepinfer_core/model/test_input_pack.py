"""``Attention.input_products``: the projections that read a layer's input (query latent, SWA key, the
compressors' value / gate, the indexer's head weights) as row blocks of one tensor, one GEMM at decode
(issue #24). Oracles: each product computed alone from an unpacked copy (float64, to rounding), and
``torch.cat`` of the compressors' own ``project`` for the compressor state; the parameters keep their
values and names; a pack something undid is never read stale; under autograd nothing is packed."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, tiny_config
from deepinfer_core.model.layers.attention import Attention
from deepinfer_core.model.layers.packing import is_packed, pack_parts

D64 = torch.float64
CFG = tiny_config()
# one layer of each kind: SWA, Full (ratio 2), Full (ratio 1), Reindex
LAYERS = [0, 2, 4, 6]


def _attn(lid: int, seed: int) -> Attention:
    a = Attention(CFG, lid).to(D64)
    a.reset_parameters(torch.Generator().manual_seed(seed))
    return a


def _oracle(a: Attention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    want = {"q": x @ a.wq_a.t(), "kv": x @ a.wkv.t()}
    if a.kind == LAYER_FULL:
        want["comp"] = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
    if a.kind in (LAYER_FULL, LAYER_REINDEX):
        want["iw"] = x @ a.indexer.weights_proj.t()
    return want


@settings(max_examples=12, deadline=None)
@given(lid=st.sampled_from(LAYERS), seed=st.integers(0, 2**16), n=st.integers(1, 33))
def test_packed_products_equal_the_separate_ones(lid: int, seed: int, n: int) -> None:
    a = _attn(lid, seed)
    ref = copy.deepcopy(a)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    x = torch.randn(n, CFG.hidden_size, dtype=D64, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        got = a.input_products(x)
        want = _oracle(ref, x)
    assert is_packed(a._x_pack, a.input_weights(), 0)  # packed on the first call
    after = a.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    # the step's own functions from the products equal the layer's methods
    pos = torch.arange(n) * 3 + 1
    with torch.no_grad():
        q, lat = a.queries_from(got["q"], pos)
        q0, lat0 = ref.queries(x, pos)
        torch.testing.assert_close(q, q0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lat, lat0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.swa_kv_from(got["kv"], pos), ref.swa_kv(x, pos), rtol=1e-12, atol=1e-12)
        if "iw" in got:
            qi, wi = a.indexer.from_products(got["iw"], lat, pos, a.inv_freq)
            qi0, wi0 = ref.indexer(x, lat0, pos, ref.inv_freq)
            torch.testing.assert_close(qi, qi0, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(wi, wi0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lid", LAYERS)
def test_a_replaced_parameter_undoes_the_pack_and_is_read_fresh(lid: int) -> None:
    a = _attn(lid, 5)
    x = torch.randn(4, CFG.hidden_size, dtype=D64)
    with torch.no_grad():
        a.input_products(x)
        assert is_packed(a._x_pack, a.input_weights(), 0)
        a.wkv.data = a.wkv.data.clone() * 2  # a load with assign, say: the pack is stale
        assert not is_packed(a._x_pack, a.input_weights(), 0)
        got = a.input_products(x)  # repacks from the current values
        torch.testing.assert_close(got["kv"], x @ a.wkv.t(), rtol=1e-12, atol=1e-12)
    b = copy.deepcopy(a).to(torch.float32)  # .to() replaces every parameter
    assert not is_packed(b._x_pack, b.input_weights(), 0)


def test_autograd_does_not_pack_and_gradients_reach_each_weight() -> None:
    a = _attn(2, 9)
    x = torch.randn(3, CFG.hidden_size, dtype=D64)
    out = a.input_products(x)
    assert a._x_pack is None
    sum(v.sum() for v in out.values()).backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in a.input_weights())


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    cols=st.integers(1, 6),
    dim=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_pack_parts_blocks_keep_values_and_alias_the_pack(
    rows: list[int], cols: int, dim: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn((r, cols) if dim == 0 else (cols, r), generator=g)) for r in rows]
    vals = [p.detach().clone() for p in ps]
    both = pack_parts(ps, dim)
    assert both.shape[dim] == sum(rows) and is_packed(both, ps, dim)
    assert all(torch.equal(p, v) for p, v in zip(ps, vals))
    assert torch.equal(both, torch.cat(vals, dim))
    with torch.no_grad():
        ps[-1].add_(1.0)  # a write through a parameter lands in the pack (a view, not a copy)
    assert torch.equal(both.narrow(dim, sum(rows) - rows[-1], rows[-1]), vals[-1] + 1)
    assert not is_packed(both, ps[::-1], dim) or (len(set(rows)) == 1 and len(ps) == 1)
    assert not is_packed(None, ps, dim)


@settings(max_examples=10, deadline=None)
@given(lid=st.sampled_from(LAYERS), seed=st.integers(0, 2**16), n=st.integers(1, 17))
def test_output_without_autograd_equals_the_einsum_form(lid: int, seed: int, n: int) -> None:
    """``Attention.output`` without autograd (the grouped product written into [N, G, R] through an out
    view, no copy) equals the einsum form used under autograd (float64), which gradients still reach."""
    a = _attn(lid, seed)
    o = torch.randn(n, a.n_heads, a.head_dim, dtype=D64, generator=torch.Generator().manual_seed(seed + 2))
    want = torch.einsum("ngk,grk->ngr", o.reshape(n, a.o_groups, -1), a.wo_a).reshape(n, -1) @ a.wo_b.t()
    with torch.no_grad():
        got = a.output(o)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    a.output(o).sum().backward()
    assert a.wo_a.grad is not None and a.wo_a.grad.abs().sum() > 0
