"""The MoE's static mode (layers.moe.static_shapes): the routing's ranked top-k, the counting-sort dispatch
and the gather combine, against brute-force oracles (a stable sort, a float64 per-token dense MoE) over
hypothesis-drawn routings, with empty experts and padded (masked) rows, plain and traced for the glue."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model import fusion
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.layers import moe as moe_mod
from deepinfer_kernels import get_backend


@pytest.fixture
def traced() -> Iterator[None]:
    """Marked functions compiled with aot_eager inside fused_glue (torch.compiler.is_compiling() is true
    while they are traced, so the glue's forms run)."""
    fusion.set_backend("aot_eager")
    try:
        yield
    finally:
        fusion.set_backend(None)


def _stable_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """The oracle's order: value descending, id ascending (a stable descending sort)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@given(st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_order_key_orders_as_the_values(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            fi.tiny,
            -fi.tiny,
            fi.max,
            -fi.max,
            fi.tiny / 4,
            -fi.tiny / 4,
        ],
        dtype=torch.float64,
    )
    v = torch.cat(
        (
            special,
            torch.randn(200, generator=g, dtype=torch.float64)
            * torch.exp2(torch.randint(-30, 30, (200,), generator=g)),
        )
    ).to(dtype)
    key = moe_mod._order_key(v)

    def cmp(
        a: torch.Tensor,
    ) -> torch.Tensor:  # -1 / 0 / 1 for every pair (no integer difference: it overflows)
        return (a[:, None] > a[None, :]).long() - (a[:, None] < a[None, :]).long()

    assert torch.equal(cmp(key), cmp(v.double()))


@given(
    st.integers(1, 70),
    st.integers(1, 12),
    st.integers(1, 9),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_rank_topk_is_the_stable_descending_order(
    e: int, n: int, levels: int, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, e + 1, (1,), generator=g))
    # few distinct levels: many ties, including at the k-th place; +-0.0 compare equal
    v = (torch.randint(0, levels, (n, e), generator=g).float() - levels // 2) * 0.25
    v[v == 0] = torch.where(torch.rand(int((v == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    v = v.to(dtype)
    got = moe_mod.rank_topk(v, k)
    assert got.dtype == torch.long and torch.equal(got, _stable_topk(v, k))
    d = (
        torch.randperm(n * e, generator=g).view(n, e).to(dtype) - n * e / 2
    )  # distinct values (exact in fp16 / bf16)
    d = d if dtype not in (torch.float16, torch.bfloat16) or n * e <= 256 else d.double().to(dtype)
    if torch.unique(d).numel() == d.numel():  # torch.topk's ids and order
        assert torch.equal(moe_mod.rank_topk(d, k), torch.topk(d, k, dim=-1).indices)


def test_route_traced_for_the_glue_equals_plain(traced: None) -> None:
    """_route compiled (ranked top-k) against plain (torch.topk), 8 experts top-6 as in the wide config,
    and with E past RANK_TOPK_MAX_EXPERTS (torch.topk in both)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    for e in (8, moe_mod.RANK_TOPK_MAX_EXPERTS + 3):
        x, gate, bias = (
            torch.randn(33, 48, generator=g),
            torch.randn(e, 48, generator=g),
            torch.randn(e, generator=g),
        )
        want = moe_mod._route(x, gate, bias, 6, "sqrtsoftplus", True, 2.5)
        with fusion.fused_glue():
            got = moe_mod._route(x, gate, bias, 6, "sqrtsoftplus", True, 2.5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@given(st.integers(1, 384), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_dispatch_rows_is_the_stable_sort_by_expert(e: int, n: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = min(k, e)
    # distinct experts per token (a top-k), drawn from a subset so that some experts stay empty
    pool = torch.randperm(e, generator=g)[: max(k, e // 2)]
    flat = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n)]).reshape(-1)
    mask = torch.rand(n, generator=g) < 0.7
    counts, tok, place, offs = moe_mod._dispatch_rows(flat, e, k, mask)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(tok, order // k)
    assert torch.equal(place[order], torch.arange(n * k))  # place is the inverse of the sorted order
    assert torch.equal(counts, torch.bincount(flat.view(n, k)[mask].reshape(-1), minlength=e))
    assert offs.dtype == torch.int32 and torch.equal(
        offs.long(), torch.cumsum(torch.bincount(flat, minlength=e), 0)
    )
    c2, order2, offs2 = moe_mod._dispatch(flat, e, k, mask)
    assert torch.equal(order2, order) and torch.equal(c2, counts) and torch.equal(offs2, offs)


def _dense_oracle(m: moe_mod.MoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per token, the routed experts' clamped SwiGLU outputs weighted and summed, plus the shared expert,
    written out in float64 (no sort, no grouping)."""
    p = {name: t.detach().double() for name, t in m.named_parameters()}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = moe_mod.clamped_swiglu(p["w1"][e] @ xt, p["w3"][e] @ xt, m.limit)
            out[t] += w[t, j].double() * (p["w2"][e] @ h)
        if m.shared:
            out[t] += p["s_w2"] @ moe_mod.clamped_swiglu(p["s_w1"] @ xt, p["s_w3"] @ xt, m.shared_limit)
    return out


@given(st.integers(1, 20), st.integers(2, 12), st.integers(0, 2**31 - 1), st.booleans())
@settings(max_examples=15, deadline=None)
def test_static_moe_equals_the_dense_oracle_over_drawn_routings(
    n: int, e: int, seed: int, glue: bool
) -> None:
    """Routings drawn directly (distinct experts per token, some experts never chosen), padded rows
    masked out of the counts only, through the grouped contract (the reference op), float64."""
    cfg = tiny_config(n_routed_experts=e, num_experts_per_tok=min(6, e))
    m = moe_mod.MoE(cfg).double()
    m.reset_parameters(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    k = m.top_k
    used = torch.randperm(e, generator=g)[: max(k, (e + 1) // 2)]
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(n)])
    w = torch.rand(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.75
    m.route = lambda _x: (ids, w)  # type: ignore[method-assign]
    op = get_backend("reference").op("moe_grouped_gemm")
    fusion.set_backend("aot_eager")
    try:
        with (
            torch.no_grad(),
            moe_mod.static_shapes(row_mask=mask),
            moe_mod.grouped_gemm_impl(op),
            fusion.fused_glue(glue),
        ):
            out, counts = m(x)
    finally:
        fusion.set_backend(None)
    torch.testing.assert_close(out, _dense_oracle(m, x, ids, w), rtol=1e-10, atol=1e-10)
    assert torch.equal(counts, torch.bincount(ids[mask].reshape(-1), minlength=e))


def test_static_moe_equals_the_grouped_loop_with_its_own_routing(traced: None) -> None:
    """End to end with the layer's router (ranked top-k under the glue), against the grouped loop."""
    cfg = tiny_config()
    m = moe_mod.MoE(cfg).double()
    m.reset_parameters(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,)))))
    x = torch.randn(29, cfg.hidden_size, dtype=torch.float64)
    want, wc = m._forward_loop(x)
    op = get_backend("reference").op("moe_grouped_gemm")
    for glue in (False, True):
        with torch.no_grad(), moe_mod.static_shapes(), moe_mod.grouped_gemm_impl(op), fusion.fused_glue(glue):
            got, gc = m(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert torch.equal(gc, wc)


@pytest.mark.gpu
def test_glue_forms_on_cuda_under_inductor() -> None:
    """Inductor (Triton) on the GPU, wide shapes. The ranked top-k on stored bf16 values with many ties is
    the stable order exactly. The compiled routing is a top-k of the scores up to near-ties: Inductor keeps
    fused bf16 intermediates in float32, so its scores may differ from eager ones by an ulp (as they did
    with torch.topk compiled in), and ids chosen or ordered by that ulp are allowed. The dispatch equals its
    plain form; the combine is within bf16 rounding of the float64 sum."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    dev = "cuda"
    n, d, e, k = 64, 4096, 8, 6
    ties = (torch.randint(0, 4, (n, e), generator=g).float() * 0.25).to(dev, torch.bfloat16)
    x = torch.randn(n, d, generator=g).to(dev, torch.bfloat16)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(dev, torch.bfloat16)
    bias = (0.1 * torch.randn(e, generator=g)).to(dev, torch.bfloat16)
    mask = (torch.rand(n, generator=g) < 0.8).to(dev)
    y = torch.randn(n * k, d, generator=g).to(dev, torch.bfloat16)
    fusion.set_backend("inductor")
    try:
        ranked = torch.compile(moe_mod.rank_topk, fullgraph=True)(ties, k)
        with fusion.fused_glue():
            ids, w = moe_mod._route(x, gate, bias, k, "sqrtsoftplus", True, 2.5)
            flat = ids.reshape(-1)
            got_rows = moe_mod._dispatch_rows(flat, e, k, mask)
            got_out = moe_mod._combine(y, w, got_rows[2], n, k)
    finally:
        fusion.set_backend(None)
    assert torch.equal(ranked, _stable_topk(ties.cpu(), k).to(dev))
    v = (torch.sqrt(torch.nn.functional.softplus((x @ gate.t()).float())) + bias.float()).double()
    ulp = 2.0 * 2.0**-8 * v.abs().amax(-1, keepdim=True)  # two bf16 ulps of the row's largest score
    chosen = v.gather(1, ids)
    others = v.masked_fill(torch.zeros_like(v, dtype=torch.bool).scatter_(1, ids, True), -float("inf"))
    assert (chosen.amin(-1) >= others.amax(-1) - ulp[:, 0]).all()  # a top-k up to near-ties
    assert (chosen[:, 1:] <= chosen[:, :-1] + ulp).all()  # in descending order up to near-ties
    assert all(len(set(r)) == k for r in ids.tolist())  # distinct ids per token
    want_rows = moe_mod._dispatch_rows(flat, e, k, mask)
    assert all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))
    terms = y.double()[got_rows[2]].view(n, k, -1) * w.double()[:, :, None]
    exact = terms.sum(1)
    # products rounded to bf16 (or not), then the float32 sum rounded to bf16 once
    allow = 2.0**-8 * (terms.abs().sum(1) + exact.abs()) + 1e-6
    assert ((got_out.double() - exact).abs() <= allow).all()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 4), d=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_combine_with_the_shared_output_is_the_combine_plus_it(n: int, k: int, d: int, seed: int) -> None:
    """``_combine(..., shared)`` = ``_combine(...) + shared`` bitwise eagerly (the static MoE adds the shared
    experts there, one fused kernel under the glue); against a float64 per-pair loop oracle too."""
    g = torch.Generator().manual_seed(seed)
    y, w, shared = (
        torch.randn(n * k, d, generator=g),
        torch.rand(n, k, generator=g),
        torch.randn(n, d, generator=g),
    )
    place = torch.randperm(n * k, generator=g)
    got = moe_mod._combine(y, w, place, n, k, shared)
    assert torch.equal(got, moe_mod._combine(y, w, place, n, k) + shared)
    want = shared.double().clone()
    for t in range(n):
        for j in range(k):
            want[t] += y.double()[place[t * k + j]] * w.double()[t, j]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
