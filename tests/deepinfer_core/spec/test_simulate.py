"""The simulator's acceptance model and accounting (accepted tokens counted as accepted)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.spec import FixedLength, MTPVarlen, NoSpec, StepTimeProfile
from deepinfer_core.spec.simulate import AcceptanceModel, simulate


def test_model_mean_and_fixed_five_accepted_length() -> None:
    rng = np.random.default_rng()
    true, reported = AcceptanceModel().draw(rng, 200_000)
    assert reported is true
    # Mean per-position acceptance 0.75 (sd of the mean ~2e-4 at 1M draws).
    assert true.mean() == pytest.approx(0.75, abs=2e-3)
    # Independent positions: E[prod] = 0.75^k, so fixed-five emits 1 + sum 0.75^k = 3.2881 on average.
    expected_len = 1 + np.cumprod(true, axis=1).sum(axis=1).mean()
    assert expected_len == pytest.approx(1 + sum(0.75**k for k in range(1, 6)), abs=0.01)


def test_accounting_counts_accepted_tokens_only() -> None:
    rng = np.random.default_rng()
    prof = StepTimeProfile.published()
    s = simulate({"v": MTPVarlen(prof), "f": FixedLength(prof), "off": NoSpec(prof)}, 60, 300, rng=rng)
    f, off = s["f"], s["off"]
    # Fixed-five emits ~3.29 tokens per request per step (sd of the mean ~0.01 here), not 6.
    assert f.accepted_length == pytest.approx(3.288, abs=0.06)
    assert f.full_acceptance_tokens == 6 * 60 * 300 and f.tokens_emitted < f.full_acceptance_tokens
    assert off.accepted_length == 1.0 and off.drafts_per_request == 0.0
    assert off.time_ms == pytest.approx(300 * prof.step_ms(60))
    assert f.time_ms == pytest.approx(300 * prof.step_ms(360))


def test_varlen_cuts_more_drafts_as_load_grows() -> None:
    rng = np.random.default_rng()
    pols = {"v": MTPVarlen(), "f": FixedLength()}
    d = [simulate(pols, r, 30, rng=rng)["v"].drafts_per_request for r in (8, 60, 256)]
    assert d[0] > d[1] > d[2]


def test_bad_model_parameters() -> None:
    with pytest.raises(ValueError, match=r"mean=1\.0"):
        AcceptanceModel(mean=1.0)
    with pytest.raises(ValueError, match="concentration"):
        AcceptanceModel(concentration=0.0)
    with pytest.raises(ValueError, match="requests=0"):
        simulate({"f": FixedLength()}, 0, 1)
