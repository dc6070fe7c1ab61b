"""``sink_attention`` / ``sink_softmax`` against a brute-force oracle: per row and head, a float64 softmax
over the concatenated logits of both key sets and the sink logit, then the weighted sum of the keys
(values are the keys). Fresh random shapes, masks (rows with every key masked included) and sinks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model.layers.attention import sink_attention, sink_softmax


def oracle(q, k_a, mask_a, k_b, mask_b, sink, scale):
    n, h, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        ka = (k_a if k_a.dim() == 2 else k_a[i]).double()
        keys, ok = [ka], [mask_a[i]]
        if k_b is not None:
            keys.append((k_b if k_b.dim() == 2 else k_b[i]).double())
            ok.append(mask_b[i])
        kk, mm = torch.cat(keys), torch.cat(ok)
        for j in range(h):
            lg = (kk @ q[i, j].double()) * scale
            lg = torch.cat([lg[mm], sink[j : j + 1].double()])
            p = torch.softmax(lg, 0)
            out[i, j] = p[:-1] @ kk[mm]
    return out


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 5),
    h=st.integers(1, 4),
    d=st.sampled_from([4, 8]),
    a=st.integers(1, 7),
    b=st.integers(0, 6),
    per_row=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_concatenated_softmax(n, h, d, a, b, per_row, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    k_a = torch.randn(*((n, a) if per_row else (a,)), d, generator=g, dtype=torch.float64)
    mask_a = torch.rand(n, a, generator=g) < 0.7
    mask_a[0] = False  # one row sees no window key at all: only the sink (and the second set)
    k_b = mask_b = None
    if b:
        k_b = torch.randn(n, b, d, generator=g, dtype=torch.float64)
        mask_b = torch.rand(n, b, generator=g) < 0.6
    sink = torch.randn(h, generator=g, dtype=torch.float64) * 2
    got = sink_attention(q, k_a, mask_a, k_b, mask_b, sink, 0.7)
    want = oracle(q, k_a, mask_a, k_b, mask_b, sink, 0.7)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bf16_within_rounding_and_weights_contiguous():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 8, 64, generator=g)
    k_a, k_b = torch.randn(6, 32, 64, generator=g), torch.randn(6, 24, 64, generator=g)
    m_a, m_b = torch.rand(6, 32, generator=g) < 0.8, torch.rand(6, 24, generator=g) < 0.8
    sink = torch.randn(8, generator=g)
    want = oracle(q, k_a, m_a, k_b, m_b, sink, 0.125)
    got = sink_attention(q.bfloat16(), k_a.bfloat16(), m_a, k_b.bfloat16(), m_b, sink.bfloat16(), 0.125)
    assert got.dtype == torch.bfloat16
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel  # bf16 inputs (keys and queries rounded) against the float64 oracle
    # the weights each product reads are their own contiguous tensors (no odd-stride slice of one softmax)
    ws, den = sink_softmax([torch.randn(6, 8, 33), torch.randn(6, 8, 17)], torch.randn(1, 8, 1))
    assert all(w.is_contiguous() for w in ws) and den.shape == (6, 8, 1)
    # and they are one softmax: the weights over the denominator sum with the sink's share to 1
    total = sum(w.sum(-1, keepdim=True) for w in ws) / den
    assert bool((total < 1).all()) and bool((total > 0).all())
