"""mHC residual streams and Engram layers (tiny config, float64), against invariants and the oracle."""

from __future__ import annotations

import attrs
import pytest
import torch

from deepinfer_core.model.config import ConfigError, tiny_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.mhc import MHCResidual, sinkhorn
from deepinfer_core.model.model import DeepSeekV41

from .session import Session

TOL = 1e-9


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _variant(model: DeepSeekV41, **over: object) -> DeepSeekV41:
    m = DeepSeekV41.from_config(attrs.evolve(model.cfg, **over), seed=5, dtype=torch.float64)
    own = m.state_dict()
    # everything whose shape still fits comes from ``model``; the rest (e.g. per-stream keys) stays seeded
    m.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k in own and own[k].shape == v.shape}, strict=False
    )
    return m


def test_sinkhorn_is_a_doubly_stochastic_scaling_of_exp() -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    logits = torch.randn(50, 4, 4, generator=g, dtype=torch.float64)
    m = sinkhorn(logits, 20)
    assert (m > 0).all()
    assert torch.allclose(m.sum(-2), torch.ones(50, 4, dtype=torch.float64), atol=1e-12)  # columns: last step
    # rows converge: 20 iterations leave <= ~1e-3 on unit-scale logits (measured max 8e-4 over 10,000)
    assert torch.allclose(m.sum(-1), torch.ones(50, 4, dtype=torch.float64), atol=5e-3)
    # Sinkhorn's characterisation: M = diag(a) exp(L) diag(b), so log(M / exp(L)) is a sum a_i + b_j
    r = torch.log(m) - logits
    mixed = r - r[:, :, :1] - r[:, :1, :] + r[:, :1, :1]
    assert mixed.abs().max() < 1e-10
    # and more iterations only move it towards the same fixed point
    far = sinkhorn(logits, 500)
    assert torch.allclose(far.sum(-1), torch.ones(50, 4, dtype=torch.float64), atol=1e-9)
    assert (far - m).abs().max() < 1e-2


def test_mhc_coefficients_are_in_their_ranges_and_streams_differ(model64: DeepSeekV41) -> None:
    res = model64.residual
    assert isinstance(res, MHCResidual) and res.n == 4
    state = res.begin(torch.randn(30, 256, dtype=torch.float64))
    pre, post, mix = res.coefficients(state, 3, 1)
    assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()
    assert torch.allclose(mix.sum(-1), torch.ones(30, 4, dtype=torch.float64), atol=5e-2)
    assert torch.allclose(mix.sum(-2), torch.ones(30, 4, dtype=torch.float64), atol=1e-12)
    # one sublayer update against the formula written out per token and stream
    out = torch.randn(30, 256, dtype=torch.float64)
    x_in = res.sublayer_input(state, 3, 1)
    new = res.sublayer_output(state, out, 3, 1)
    for t in (0, 17):
        want_in = sum(pre[t, j] * state[t, j] for j in range(4))
        assert torch.allclose(x_in[t], want_in, atol=1e-12)
        for i in range(4):
            want = sum(mix[t, i, j] * state[t, j] for j in range(4)) + post[t, i] * out[t]
            assert torch.allclose(new[t, i], want, atol=1e-12)
    assert (new[:, 0] - new[:, 1]).abs().max() > 1e-3  # the streams carry different states


@pytest.mark.parametrize("over", [{"hc_single_pass": False}, {"hc_mult": 1}, {"engram_layer_ids": []}])
def test_mhc_and_engram_switches_are_live_and_exact(model64: DeepSeekV41, over: dict) -> None:
    seq = _tokens(3, 110)
    base = model64.forward_full(seq)[0]
    m = _variant(model64, **over)
    want = m.forward_full(seq)[0]
    assert (want - base).abs().max() > 1e-3, over
    got = Session(m).run(0, seq, [50, 33, 20, 1, 1, 5])
    assert (got - want).abs().max().item() < TOL


def test_engram_context_continues_across_steps(model64: DeepSeekV41) -> None:
    """Rows of a chunk hashed with the sequence's previous tokens as context equal the rows of the whole
    sequence; without the context the first max_ngram - 1 rows differ (so the context is needed)."""
    seq = _tokens(5, 80)
    full = model64.engram_rows(seq)
    n = model64.cfg.engram_max_ngram - 1
    ctx = torch.stack([seq[59 - j] for j in range(n)])[None]
    cont = model64.engram_rows(seq[60:], torch.tensor([0, 20]), ctx)
    alone = model64.engram_rows(seq[60:])
    for lid in model64.cfg.engram_layer_ids:
        assert torch.equal(cont[lid], full[lid][60:])
        assert not torch.equal(alone[lid][:n], full[lid][60 : 60 + n]) and torch.equal(
            alone[lid][n:], full[lid][60 + n :]
        )


def test_engram_gate_is_a_probability_per_stream(model64: DeepSeekV41) -> None:
    seq = _tokens(9, 40)
    rows = model64.engram_rows(seq)[1]
    layer = model64.engram["1"]
    state = model64.residual.begin(model64.embed[seq]) + torch.randn(40, 4, 256, dtype=torch.float64)
    g = layer.gates(state, rows)
    assert g.shape == (40, 4) and ((g > 0) & (g < 1)).all()
    assert (g[:, 0] - g[:, 1]).abs().max() > 1e-3  # one gate per stream
    # h_i + g_i * W_v e, per stream
    out = layer(state, rows)
    v = rows @ layer.w_v.t()
    assert torch.allclose(out, state + g[..., None] * v[:, None, :], atol=1e-12)


def test_host_placement_gives_the_same_logits(model64: DeepSeekV41) -> None:
    seq = _tokens(4, 100)
    local = Session(model64)
    host = Session(model64)
    host.ex = ModelExecutor(
        model64,
        host.ex.num_blocks,
        host.ex.block_size,
        host.ex.num_slots,
        quantize=False,
        engram_placement="host",
    )
    assert type(host.ex.engram_tables[1]).__name__ == "HostEngramTable"
    a, b = local.run(0, seq, [64, 30, 1, 5]), host.run(0, seq, [64, 30, 1, 5])
    assert torch.equal(a, b)


def test_bad_placement_and_config_are_named(model64: DeepSeekV41) -> None:
    with pytest.raises(ValueError, match="engram_placement"):
        ModelExecutor(model64, 8, 16, 2, engram_placement="disk")
    with pytest.raises(ConfigError, match="engram_table_sizes"):
        tiny_config(engram_table_sizes=[1009, 2003, 4001])
    with pytest.raises(ConfigError, match="hc_sinkhorn_iters"):
        tiny_config(hc_sinkhorn_iters=0)
    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        tiny_config(dspark_noise_token_id=None)


@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("glue", [False, True])
def test_residual_handover_equals_output_then_normed_input(single_pass: bool, glue: bool) -> None:
    """``sublayer_input_normed`` and ``handover`` (one compiled function each under the fused glue) against
    the separate calls they replace and the per-token formula, for mHC (single pass: the next sublayer's
    coefficients pending; paper form: computed from the new state) and the plain residual."""
    from deepinfer_core.model import fusion
    from deepinfer_core.model.layers.norm import RMSNorm
    from deepinfer_core.model.model import PlainResidual

    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    cfg = attrs.evolve(tiny_config(), hc_single_pass=single_pass)
    res = MHCResidual(cfg).to(torch.float64)
    res.reset_parameters(g)
    n1, n2 = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(torch.float64) for _ in range(2))
    with torch.no_grad():
        for nm in (n1, n2):
            nm.weight.copy_(torch.rand(cfg.hidden_size, generator=g, dtype=torch.float64) + 0.5)
    state = res.begin(torch.randn(7, cfg.hidden_size, generator=g, dtype=torch.float64))
    out = torch.randn(7, cfg.hidden_size, generator=g, dtype=torch.float64)
    # the oracle: the separate calls, eagerly
    want_x0 = n1(res.sublayer_input(state, 2, 0))
    want_s = res.sublayer_output(state, out, 2, 0)
    want_x1 = n2(res.sublayer_input(want_s, 2, 1))
    res.end(want_s)
    fusion.set_backend("aot_eager")
    try:
        with fusion.fused_glue(glue):
            x0 = res.sublayer_input_normed(state, 2, 0, n1)
            s, x1 = res.handover(state, out, 2, 0, n2)
    finally:
        fusion.set_backend(None)
    assert (2, 1) in res._pending and (2, 0) not in res._pending  # sublayer 1's coefficients await its output
    res.end(s)
    for got, want in ((x0, want_x0), (s, want_s), (x1, want_x1)):
        assert (got - want).abs().max().item() < 1e-12, seed
    # the normalised input written out: rms over D of sum_j pre_j state_j, times the weight
    pre = res.coefficients(state, 2, 0)[0]
    mixed = (pre[:, :, None] * state).sum(1)
    manual = mixed / mixed.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt() * n1.weight
    assert (x0 - manual).abs().max().item() < 1e-12
    plain = PlainResidual()
    ps, px = plain.handover(mixed, out, 0, 0, n2)
    assert torch.equal(ps, mixed + out) and torch.equal(px, n2(mixed + out))
    assert torch.equal(plain.sublayer_input_normed(mixed, 0, 0, n1), n1(mixed))


def test_both_residuals_have_the_protocols_methods() -> None:
    import inspect

    from deepinfer_core.model.model import PlainResidual, Residual

    want = {n for n, v in vars(Residual).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert {"begin", "handover", "sublayer_input_normed", "end"} <= want
    for cls in (PlainResidual, MHCResidual):
        for name in want:
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(inspect.signature(getattr(Residual, name)).parameters), (cls, name)
