"""StepTimeProfile: the published curve, extrapolation, validation and fitting from samples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.spec import StepTimeProfile

from .oracle import curve_ms


def test_published_points_and_extrapolation() -> None:
    prof = StepTimeProfile.published()
    np.testing.assert_allclose(prof([32, 256, 512, 1024]), [9.99, 13.20, 18.21, 31.53])
    # Past the last knot the 512 -> 1,024 slope continues: (31.53 - 18.21) / 512 ms per token.
    assert prof.step_ms(2048) == pytest.approx(31.53 + (31.53 - 18.21) / 512 * 1024)
    # Between knots: linear; below the first: flat.
    assert prof.step_ms(384) == pytest.approx((13.20 + 18.21) / 2)
    assert prof.step_ms(1) == pytest.approx(9.99)


@given(
    st.lists(st.floats(0.0, 1e4), min_size=1, max_size=6, unique=True),
    st.lists(st.floats(0.0, 10.0), min_size=6, max_size=6),
    st.lists(st.floats(0.0, 2e4), min_size=1, max_size=20),
)
def test_evaluation_is_monotone_and_matches_oracle(
    xs: list[float], steps: list[float], n: list[float]
) -> None:
    x = np.array(sorted(xs))
    y = 0.1 + np.cumsum(steps[: len(x)])
    prof = StepTimeProfile(x, y)
    grid = np.sort(np.array(n))
    got = prof(grid)
    np.testing.assert_allclose(got, curve_ms(x, y, grid), rtol=1e-9, atol=1e-9)
    assert np.all(np.diff(got) >= -1e-9)


@pytest.mark.parametrize(
    ("xs", "ys", "match"),
    [
        ([1, 1], [1, 2], "knots_x: must be strictly increasing"),
        ([1, 2], [2, 1], "knots_y: must be non-decreasing"),
        ([1, 2], [0, 1], r"knots_y: every step time must be > 0"),
        ([1, 2], [1], r"must have the same length"),
        ([], [], "knots_x: must be a non-empty"),
        ([1, np.inf], [1, 2], "knots_x: must be finite"),
    ],
)
def test_bad_knots_name_the_field(xs: list[float], ys: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepTimeProfile(xs, ys)


def test_fit_reproduces_exact_points() -> None:
    pub = StepTimeProfile.published()
    fit = StepTimeProfile.fit(pub.knots_x, pub.knots_y)
    np.testing.assert_allclose(fit.knots_x, pub.knots_x)
    np.testing.assert_allclose(fit.knots_y, pub.knots_y)


def test_fit_recovers_published_curve_from_noisy_samples() -> None:
    rng = np.random.default_rng()
    pub = StepTimeProfile.published()
    tokens = rng.choice([32, 64, 128, 256, 384, 512, 768, 1024], size=800)
    ms = pub(tokens) * rng.lognormal(0.0, 0.03, size=tokens.size)
    # A few profiler-inflated steps (up to +50%) must not drag the medians.
    ms[rng.choice(tokens.size, 20, replace=False)] *= 1.5
    fit = StepTimeProfile.fit(tokens, ms)
    grid = np.array([32, 100, 256, 400, 512, 900, 1024, 1500])
    np.testing.assert_allclose(fit(grid), pub(grid), rtol=0.03)
    assert np.all(np.diff(fit.knots_y) >= 0)


@given(st.lists(st.tuples(st.integers(0, 2000), st.floats(0.01, 100.0)), min_size=1, max_size=60))
def test_fit_is_always_monotone(samples: list[tuple[int, float]]) -> None:
    t, y = (np.array(v) for v in zip(*samples))
    fit = StepTimeProfile.fit(t, y, max_knots=8)
    assert fit.knots_x.size <= 8
    assert np.all(np.diff(fit.knots_x) > 0) and np.all(np.diff(fit.knots_y) >= 0)
    # Isotonic regression preserves the weighted mean of the group medians: fitted values stay in range.
    assert fit.knots_y.min() >= y.min() - 1e-9 and fit.knots_y.max() <= y.max() + 1e-9


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match=r"tokens \(2\) and ms \(1\)"):
        StepTimeProfile.fit([1, 2], [1.0])
    with pytest.raises(ValueError, match="ms > 0"):
        StepTimeProfile.fit([1, 2], [1.0, -1.0])
    with pytest.raises(ValueError, match="at least one"):
        StepTimeProfile.fit([], [])


def test_profile_copies_its_knots() -> None:
    xs, ys = np.array([1.0, 2.0]), np.array([1.0, 3.0])
    prof = StepTimeProfile(xs, ys)
    ys[1] = 0.5  # the caller's arrays stay writable and changing them does not change the profile
    assert prof.step_ms(2.0) == 3.0 and not prof.knots_y.flags.writeable
