"""The MTPVarlen greedy is the exact optimum over prefix-closed draft selections (brute-force oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core import _C
from deepinfer_core.spec import FixedLength, MTPVarlen, NoSpec, StepTimeProfile, make_policy

from .oracle import brute_force, curve_ms, expected_tokens, top_total_lengths

# Probabilities mixing exact ties (0, 1, repeated values) with arbitrary floats.
prob = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), st.floats(0.0, 1.0))


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    R = draw(st.integers(1, 4))
    D = draw(st.integers(1, 5))
    a = np.array(draw(st.lists(st.lists(prob, min_size=D, max_size=D), min_size=R, max_size=R)))
    n = np.array(draw(st.lists(st.integers(0, D), min_size=R, max_size=R)), dtype=np.int32)
    # A random monotone (generally non-convex) curve whose knots fall inside the token range in play.
    k = draw(st.integers(1, min(5, R * (D + 1) + 2)))
    xs = np.array(
        sorted(draw(st.sets(st.integers(1, R * (D + 1) + 2), min_size=k, max_size=k))), dtype=np.float64
    )
    steps = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 5.0)), min_size=k - 1, max_size=k - 1))
    ys = draw(st.floats(0.5, 5.0)) + np.concatenate([[0.0], np.cumsum(steps)])
    return a, n, xs, ys


def _check_optimal(a: np.ndarray, n: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> None:
    plan = MTPVarlen(StepTimeProfile(xs, ys), max_drafts=a.shape[1]).plan(a, n)
    best = brute_force(a, n, xs, ys)
    assert np.all((plan.lengths >= 0) & (plan.lengths <= n))
    # The plan's own accounting, recomputed independently, must be what it claims...
    e = expected_tokens(a, plan.lengths)
    t = float(curve_ms(xs, ys, np.array(a.shape[0] + plan.lengths.sum())))
    assert plan.query_tokens == a.shape[0] + int(plan.lengths.sum())
    assert plan.expected_tokens == pytest.approx(e, rel=1e-12)
    assert plan.step_ms == pytest.approx(t, rel=1e-12)
    # ...and equal the brute-force optimum over all prefix-closed selections.
    assert e / t == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert plan.tokens_per_ms == pytest.approx(best, rel=1e-12, abs=1e-15)


@given(cases())
def test_greedy_equals_brute_force(case: tuple[np.ndarray, ...]) -> None:
    _check_optimal(*case)


def test_greedy_equals_brute_force_random_batches() -> None:
    rng = np.random.default_rng()
    for _ in range(150):
        R, D = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        a = rng.beta(3.0, 1.0, size=(R, D))
        n = rng.integers(0, D + 1, size=R).astype(np.int32)
        k = int(rng.integers(2, 6))
        xs = np.sort(
            rng.choice(np.arange(1, R * (D + 1) + 3), size=min(k, R * (D + 1) + 2), replace=False)
        ).astype(float)
        ys = rng.uniform(0.5, 3.0) + np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, xs.size - 1))])
        _check_optimal(a, n, xs, ys)


def test_scan_does_not_stop_at_first_local_peak() -> None:
    # E/T peaks at m=0 (1 token / 1 ms), dips at m=1 (2 / 2.2), then climbs to 6 / 2.2 at m=5:
    # a procedure that stopped at the first local peak would verify nothing.
    a = np.ones((1, 5))
    plan = MTPVarlen(StepTimeProfile([1.0, 2.0, 6.0], [1.0, 2.2, 2.2])).plan(a)
    assert plan.lengths.tolist() == [5]
    assert plan.tokens_per_ms == pytest.approx(6 / 2.2)


def test_published_curve_keeps_all_drafts_when_steps_are_flat() -> None:
    # 4 requests x 6 tokens = 24 query tokens, below the first knot (32) where the curve is flat: every
    # draft with a nonzero cumulative rate is free, so all five stay.
    rng = np.random.default_rng()
    a = rng.uniform(0.05, 0.95, size=(4, 5))
    assert MTPVarlen().plan(a).lengths.tolist() == [5] * 4


def test_cut_is_prefix_of_cumulative_rates_and_drops_low_tail_first() -> None:
    rng = np.random.default_rng()
    a = rng.beta(3.0, 1.0, size=(256, 5))
    plan = MTPVarlen().plan(a)
    assert 0 < plan.total_drafts < 256 * 5
    c = np.cumprod(a, axis=1)
    kept = np.arange(5)[None, :] < plan.lengths[:, None]
    # Every kept draft has a cumulative rate at least that of every dropped draft.
    assert c[kept].min() >= c[~kept].max()


def test_plan_total_is_top_total_by_cumulative_rate_with_ties() -> None:
    rng = np.random.default_rng()
    for _ in range(60):
        # up to 1,500 drafts: covers both the comparison-sort (< 512) and the radix path of the C++
        R, D = int(rng.integers(1, 300)), int(rng.integers(1, 6))
        a = rng.choice([0.0, 0.5, 0.8, 1.0], size=(R, D)) if rng.random() < 0.5 else rng.random((R, D))
        n = rng.integers(0, D + 1, size=R).astype(np.int32)
        total = int(rng.integers(0, n.sum() + 1))
        plan = MTPVarlen(max_drafts=D).plan_total(a, total, n)
        assert plan.lengths.tolist() == top_total_lengths(a, n, total).tolist()
        assert plan.total_drafts == total


def test_plan_total_of_optimal_size_reproduces_plan() -> None:
    rng = np.random.default_rng()
    a = rng.beta(3.0, 1.0, size=(96, 5))
    pol = MTPVarlen()
    plan = pol.plan(a)
    again = pol.plan_total(a, plan.total_drafts)
    assert again.lengths.tolist() == plan.lengths.tolist()
    assert again.tokens_per_ms == pytest.approx(plan.tokens_per_ms)


def test_fixed_length_and_off_accounting() -> None:
    rng = np.random.default_rng()
    a = rng.random((40, 5))
    n = rng.integers(0, 6, size=40).astype(np.int32)
    prof = StepTimeProfile.published()
    fixed = FixedLength(prof, max_drafts=3).plan(a, n)
    assert fixed.lengths.tolist() == np.minimum(n, 3).tolist()
    assert fixed.expected_tokens == pytest.approx(expected_tokens(a, np.minimum(n, 3)), rel=1e-12)
    assert fixed.step_ms == pytest.approx(
        float(curve_ms(prof.knots_x, prof.knots_y, np.array(fixed.query_tokens)))
    )
    off = NoSpec(prof).plan(a, n)
    assert off.lengths.tolist() == [0] * 40 and off.query_tokens == 40 and off.expected_tokens == 40.0
    best = MTPVarlen(prof).plan(a, n)
    # The greedy's feasible set contains both other policies' choices.
    assert (
        best.tokens_per_ms >= fixed.tokens_per_ms - 1e-12 and best.tokens_per_ms >= off.tokens_per_ms - 1e-12
    )


def test_make_policy_follows_switches() -> None:
    assert isinstance(make_policy(True, 5), MTPVarlen)
    assert isinstance(make_policy(False, 5), FixedLength)
    assert isinstance(make_policy(True, 0), NoSpec)
    assert make_policy(True, 3).max_drafts == 3


def test_max_drafts_caps_the_greedy() -> None:
    a = np.ones((4, 5))
    assert MTPVarlen(max_drafts=2).plan(a).lengths.tolist() == [2] * 4


def test_empty_batch() -> None:
    plan = MTPVarlen().plan(np.zeros((0, 5)))
    assert plan.lengths.shape == (0,) and plan.query_tokens == 0 and plan.tokens_per_ms == 0.0


@pytest.mark.parametrize(
    ("acceptance", "num_drafts", "match"),
    [
        (np.full((2, 3), 1.5), None, r"acceptance\[0, 0\]=1\.5.*\[0, 1\]"),
        (np.array([[0.5, np.nan, 0.1]]), None, r"acceptance\[0, 1\]=-?nan"),
        (np.full((2, 3), 0.5), np.array([1, 4]), r"num_drafts\[1\]=4: must be in \[0, 3\]"),
        (np.full((2, 3), 0.5), np.array([1]), r"num_drafts: must have shape \(2,\)"),
        (np.full(3, 0.5), None, r"acceptance: must be a 2-D"),
        (np.ones((2, 3), dtype=np.int64), None, r"acceptance: must hold floating-point"),
    ],
)
def test_bad_input_names_the_field(acceptance: np.ndarray, num_drafts: np.ndarray | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MTPVarlen().plan(acceptance, num_drafts)


def test_padding_beyond_num_drafts_is_ignored() -> None:
    a = np.array([[0.9, 0.8, np.nan], [0.7, 5.0, 5.0]])
    plan = MTPVarlen(max_drafts=3).plan(a, np.array([2, 1]))
    assert plan.lengths.tolist() == [2, 1]


def test_plan_total_rejects_bad_total() -> None:
    a = np.full((2, 3), 0.5)
    with pytest.raises(ValueError, match=r"total=7: must be <= the number of drafts \(6\)"):
        MTPVarlen().plan_total(a, 7)
    with pytest.raises(ValueError, match=r"total=-1"):
        MTPVarlen().plan_total(a, -1)


def test_cpp_step_time_matches_python_profile_and_oracle() -> None:
    prof = StepTimeProfile.published()
    n = np.array([0.0, 1, 31, 32, 100, 256, 300, 512, 1000, 1024, 1500, 4096])
    cpp = _C.spec.step_time(prof.knots_x, prof.knots_y, n)
    np.testing.assert_allclose(cpp, prof(n), rtol=1e-14)
    np.testing.assert_allclose(cpp, curve_ms(prof.knots_x, prof.knots_y, n), rtol=1e-14)


def test_order_exact_for_values_equal_in_their_high_bits() -> None:
    # Values that differ only in the low mantissa bits share the radix sort's 32-bit key; the C++ must
    # still order them exactly (then by index), like the float64 oracle.
    rng = np.random.default_rng()
    a = (0.5 + rng.integers(0, 7, size=(300, 1)) * 2.0**-45).astype(np.float64)
    a = np.concatenate([a, rng.choice([0.5, 1.0], size=(300, 1))], axis=1)
    for total in (0, 1, 57, 300, 451, 600):
        got = MTPVarlen(max_drafts=2).plan_total(a, total).lengths
        assert got.tolist() == top_total_lengths(a, np.full(300, 2), total).tolist()


@pytest.mark.parametrize("cls", [MTPVarlen, FixedLength])
def test_one_bad_request_fails_alone_when_asked(cls: type) -> None:
    rng = np.random.default_rng()
    a = rng.beta(3.0, 1.0, size=(96, 5))
    a[7, 2] = np.nan
    a[40, 0] = 1.25
    with pytest.raises(ValueError, match=r"acceptance\[7, 2\]"):
        cls().plan(a)
    plan = cls(invalid="no_drafts").plan(a)
    assert plan.lengths[7] == 0 and plan.lengths[40] == 0
    # The others are planned exactly as if those two requests had offered no drafts.
    n = np.full(96, 5)
    n[[7, 40]] = 0
    clean = np.where(np.isfinite(a) & (a <= 1), a, 0.0)
    assert plan.lengths.tolist() == cls().plan(clean, n).lengths.tolist()
    with pytest.raises(ValueError, match="invalid='skip'"):
        cls(invalid="skip")
