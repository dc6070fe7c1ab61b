"""The drifting trace and the online simulator: shapes, token conservation, re-plan bookkeeping."""

from __future__ import annotations

import attrs
import numpy as np

from deepinfer_core.eplb import EPLBConfig
from deepinfer_core.eplb.simulate import DECODE_TRACE, PREFILL_TRACE, DriftingTrace, simulate


def test_trace_is_reproducible_and_conserves_tokens() -> None:
    tc = attrs.evolve(DECODE_TRACE, num_layers=2)
    a, b = DriftingTrace(tc, seed=5).steps(50), DriftingTrace(tc, seed=5).steps(50)
    assert np.array_equal(a, b) and a.shape == (50, 2, 384) and a.dtype.kind == "i"
    # Poisson around requests x tokens x top_k assignments per layer: mean within a few sd.
    expect = tc.requests_per_step * tc.tokens_per_request * tc.top_k
    per_layer = a.sum(axis=2)
    assert abs(per_layer.mean() - expect) < 4 * np.sqrt(expect / per_layer.size)


def test_trace_drifts_and_prefill_is_burstier() -> None:
    tc = attrs.evolve(PREFILL_TRACE, num_layers=1)
    tr = DriftingTrace(tc, seed=1)
    early, late = tr.steps(200).sum(axis=0), (tr.steps(6_000), tr.steps(200))[1].sum(axis=0)
    share = lambda x: x / x.sum()  # noqa: E731
    assert np.abs(share(early) - share(late)).sum() > 0.05  # the mix moved
    dec = DriftingTrace(attrs.evolve(DECODE_TRACE, num_layers=1), seed=1).steps(200)
    pre = DriftingTrace(tc, seed=1).steps(200)
    cv = lambda x: (x[:, 0] / x[:, 0].sum(axis=1, keepdims=True)).std(axis=0).mean()  # noqa: E731
    assert cv(pre) > cv(dec)  # few long prompts per prefill step: noisier step-to-step shares


def test_simulate_replans_on_schedule_and_migrates_less() -> None:
    tc = attrs.evolve(DECODE_TRACE, num_layers=2, num_experts=64)
    cfg = EPLBConfig(window_steps=50, replan_interval=200, redundant_per_gpu=1)
    r = simulate(DriftingTrace(tc, seed=2), cfg, 16, 700, expert_bytes=1, chunk=64)
    assert r.replan_steps == [250, 450, 650]
    assert len(r.window_loads) == 4
    assert r.steps[0] == 50 and r.steps[-1] == 699 and r.steps.size == 650
    assert (r.moe_lb_scratch >= 1).all() and (r.moe_lb_migration >= 1).all()
    assert r.moe_lb_plain.mean() > r.moe_lb_scratch.mean()
    assert sum(r.moved_bytes_migration) < sum(r.moved_bytes_scratch)
    assert all(m <= s * 1.01 + 1e-9 for m, s in zip(r.balance_migration, r.balance_scratch))
