"""Layers against independent float64 references: RoPE (complex numbers), MoE (per-token loop),
compressor (per-group formula), indexer top-k and candidate blocks (brute force)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.layers.compressor import Compressor
from deepinfer_core.model.layers.indexer import candidate_pool, index_scores, select_topk
from deepinfer_core.model.layers.moe import MoE
from deepinfer_core.model.layers.rope import apply_rope, rope_inv_freq

D64 = torch.float64


def test_rope_matches_complex_rotation_and_is_relative() -> None:
    x = torch.randn(9, 3, 24, dtype=D64)
    pos = torch.randint(0, 10_000, (9,))
    inv = rope_inv_freq(16, 10000.0)
    y = apply_rope(x, pos, inv, 16)
    assert torch.equal(y[..., :8], x[..., :8])
    z = torch.view_as_complex(x[..., 8:].reshape(9, 3, 8, 2).contiguous())
    rot = torch.polar(torch.ones(9, 8, dtype=D64), pos[:, None].to(D64) * inv[None])[:, None, :]
    want = torch.view_as_real(z * rot).flatten(-2)
    assert torch.allclose(y[..., 8:], want, atol=1e-12)
    # <rope(q, m), rope(k, n)> depends on m - n only
    q, k = torch.randn(1, 16, dtype=D64), torch.randn(1, 16, dtype=D64)

    def dot(m: int, n: int) -> float:
        return (
            (apply_rope(q, torch.tensor([m]), inv, 16) * apply_rope(k, torch.tensor([n]), inv, 16))
            .sum()
            .item()
        )

    assert math.isclose(dot(5, 2), dot(1003, 1000), rel_tol=1e-9)


def test_yarn_keeps_high_and_stretches_low_frequencies() -> None:
    plain = rope_inv_freq(64, 160000.0)
    yarn = rope_inv_freq(
        64,
        160000.0,
        {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
    )
    assert torch.equal(yarn[0], plain[0])  # fastest rotation untouched
    assert torch.allclose(yarn[-1], plain[-1] / 16)  # slowest interpolated by the factor
    assert (yarn <= plain).all()


def test_moe_matches_per_token_reference() -> None:
    cfg = tiny_config()
    moe = MoE(cfg).to(D64)
    moe.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.gate_bias.mul_(30)  # a large bias so selection visibly differs from raw-score top-k
    x = torch.randn(37, cfg.hidden_size, dtype=D64) * 3
    y, counts = moe(x)
    lim, g, b = cfg.swiglu_limit, moe.gate.detach(), moe.gate_bias.detach()
    want = torch.zeros_like(x)
    want_counts = torch.zeros(cfg.n_routed_experts, dtype=torch.long)
    differs = 0
    for t in range(37):
        s = torch.sqrt(F.softplus(x[t] @ g.t()))
        order = sorted(range(cfg.n_routed_experts), key=lambda e: -(s[e] + b[e]).item())[
            : cfg.num_experts_per_tok
        ]
        differs += set(order) != set(torch.topk(s, cfg.num_experts_per_tok).indices.tolist())
        w = s[order] / s[order].sum() * cfg.routed_scaling_factor

        def ffn(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            a, u = v @ w1.t(), v @ w3.t()
            return (F.silu(a.clamp(max=lim)) * u.clamp(-lim, lim)) @ w2.t()

        for e, we in zip(order, w):
            want[t] += we * ffn(moe.w1[e], moe.w3[e], moe.w2[e], x[t])
            want_counts[e] += 1
        want[t] += ffn(moe.s_w1, moe.s_w3, moe.s_w2, x[t])
    assert differs > 0
    assert torch.allclose(y, want, atol=1e-10)
    assert torch.equal(counts, want_counts)


def test_compressor_pools_groups_by_softmax_gate() -> None:
    c = Compressor(32, 16, 2, 8, 1e-6, "first").to(D64)
    c.reset_parameters(torch.Generator().manual_seed(1))
    x = torch.randn(10, 32, dtype=D64)
    inv = rope_inv_freq(8, 10000.0)
    ent = c.pool(c.project(x), 3, inv)
    for j in range(5):
        v = x[2 * j : 2 * j + 2] @ c.wkv.t()
        sc = x[2 * j : 2 * j + 2] @ c.wgate.t() + c.ape
        pooled = (torch.softmax(sc, 0) * v).sum(0, keepdim=True)
        normed = pooled / pooled.pow(2).mean().add(1e-6).sqrt() * c.norm.weight
        want = apply_rope(normed, torch.tensor([(3 + j) * 2]), inv, 8)
        assert torch.allclose(ent[j : j + 1], want, atol=1e-12)


def test_indexer_topk_and_candidate_blocks_brute_force() -> None:
    g = torch.Generator().manual_seed(5)
    q, w, k = (
        torch.randn(6, 4, 8, generator=g, dtype=D64),
        torch.randn(6, 4, generator=g, dtype=D64),
        torch.randn(23, 8, generator=g, dtype=D64),
    )
    sc = index_scores(q, w, k)
    brute = torch.tensor(
        [
            [sum(w[n, h] * max(0.0, (q[n, h] @ k[e]).item()) for h in range(4)) for e in range(23)]
            for n in range(6)
        ]
    )
    assert torch.allclose(sc, brute.to(D64), atol=1e-12)
    visible = torch.tensor([23, 20, 9, 3, 17, 0])
    sc = sc.masked_fill(torch.arange(23)[None] >= visible[:, None], float("-inf"))
    ids, valid = select_topk(sc, 5)
    pool = candidate_pool(sc, visible, 4, 2)
    for n in range(6):
        v = int(visible[n])
        order = sorted(range(v), key=lambda e: (-sc[n, e].item(), e))
        assert ids[n][valid[n]].tolist() == order[:5]
        blocks = list(range(-(-v // 4)))
        bscore = {
            b: (
                math.inf
                if (b == v // 4 and v % 4)
                else max(sc[n, e].item() for e in range(4 * b, min(4 * b + 4, v)))
            )
            for b in blocks
        }
        keep = sorted(blocks, key=lambda b: (-bscore[b], b))[:2]
        want = sorted(e for b in keep for e in range(4 * b, min(4 * b + 4, v)))
        assert torch.nonzero(pool[n]).flatten().tolist() == want


def test_rope_halves_variant_matches_complex_rotation() -> None:
    x = torch.randn(7, 2, 20, dtype=D64)
    pos = torch.randint(0, 5000, (7,))
    inv = rope_inv_freq(12, 10000.0)
    y = apply_rope(x, pos, inv, 12, interleave=False)
    z = torch.complex(x[..., 8:14], x[..., 14:])  # dim i pairs with i + 6
    rot = torch.polar(torch.ones(7, 6, dtype=D64), pos[:, None].to(D64) * inv[None])[:, None, :]
    want = z * rot
    assert torch.equal(y[..., :8], x[..., :8])
    assert torch.allclose(y[..., 8:14], want.real, atol=1e-12) and torch.allclose(
        y[..., 14:], want.imag, atol=1e-12
    )
