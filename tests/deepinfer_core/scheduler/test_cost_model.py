"""Cost model: least-squares fit on synthetic data with known coefficients; chunk solver vs brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.scheduler import CostModel


def synthetic(model: CostModel, rng: np.random.Generator, n: int, noise: float) -> tuple[np.ndarray, ...]:
    q = rng.integers(1, 32768, size=n)  # the full chunk range: the q^2 term is well identified
    c = rng.integers(0, 65536, size=n)
    ns = model.predict(q, c)
    return q, c, ns * (1 + noise * rng.standard_normal(n))


def test_fit_recovers_known_coefficients_exactly_without_noise() -> None:
    rng = np.random.default_rng()
    true = CostModel(base_ns=2.0e6, token_ns=40.0, quad_ns=2.5e-3, ctx_ns=5.0e-3)
    q, c, ns = synthetic(true, rng, 200, 0.0)
    got = CostModel.fit(q, c, ns)
    np.testing.assert_allclose(got.as_tuple(), true.as_tuple(), rtol=1e-6)


def test_fit_with_noise_is_close_and_predicts_well() -> None:
    rng = np.random.default_rng()
    true = CostModel(base_ns=1.5e6, token_ns=55.0, quad_ns=1.0e-3, ctx_ns=3.0e-3)
    q, c, ns = synthetic(true, rng, 4000, 0.01)
    got = CostModel.fit(q, c, ns)
    np.testing.assert_allclose(got.as_tuple(), true.as_tuple(), rtol=0.1)
    qt, ct, _ = synthetic(true, rng, 500, 0.0)
    np.testing.assert_allclose(got.predict(qt, ct), true.predict(qt, ct), rtol=0.02)


def test_fit_never_returns_negative_coefficients_and_is_nnls_optimal() -> None:
    # True model has no quadratic or context term; noise pushes plain least squares below zero on
    # some draws. The fit must keep every coefficient >= 0 and satisfy the NNLS optimality (KKT)
    # conditions: zero gradient on positive coefficients, non-negative gradient on zero ones.
    rng = np.random.default_rng()
    true = CostModel(base_ns=1e5, token_ns=10.0)
    clipped = 0
    for _ in range(10):
        q, c, ns = synthetic(true, rng, 60, 0.05)
        for relative in (False, True):
            got = CostModel.fit(q, c, ns, relative=relative)
            x = np.array(got.as_tuple())
            assert x.min() >= 0.0
            a = np.stack([np.ones(q.size), q, q * q, q * c], axis=1).astype(float)
            y = ns.copy()
            if relative:
                a, y = a / ns[:, None], y / ns
            norms = np.linalg.norm(a, axis=0)
            an, xn = a / norms, x * norms
            g = an.T @ (an @ xn - y)
            scale = np.linalg.norm(y) * np.linalg.norm(an, axis=0)
            pos = xn > 1e-12 * np.abs(xn).max()
            assert np.all(np.abs(g[pos]) <= 1e-6 * scale[pos])
            assert np.all(g[~pos] >= -1e-6 * scale[~pos])
            clipped += int((~pos).sum())
    assert clipped > 0  # the constraint was active at least once, so the check above was not vacuous


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="same length"):
        CostModel.fit([1, 2, 3, 4], [0, 0, 0], [1, 2, 3, 4])
    with pytest.raises(ValueError, match=">= 4 samples"):
        CostModel.fit([1, 2], [0, 0], [1, 2])
    with pytest.raises(ValueError, match="q >= 1"):
        CostModel.fit([0, 2, 3, 4], [0, 0, 0, 0], [1, 2, 3, 4])


def test_coefficients_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="quad_ns"):
        CostModel(quad_ns=-1.0)
    with pytest.raises(ValueError, match="base_ns"):
        CostModel(base_ns=float("nan"))


coef = st.floats(0, 100, allow_nan=False)


@given(
    base=st.floats(0, 1e6),
    token=coef,
    quad=st.floats(0, 1e-2),
    ctx=st.floats(0, 1e-2),
    c=st.integers(0, 200_000),
    spent_frac=st.floats(0, 1),
    budget=st.floats(0, 5e7),
    cap=st.integers(0, 40_000),
)
def test_max_chunk_is_the_largest_fitting_q(
    base: float, token: float, quad: float, ctx: float, c: int, spent_frac: float, budget: float, cap: int
) -> None:
    m = CostModel(base, token, quad, ctx)
    spent = base + spent_frac * budget
    got = m.max_chunk(c, budget, spent_ns=spent, cap=cap)
    # Brute force over every q in [0, cap] with the same float64 formula.
    qs = np.arange(cap + 1)
    ok = (spent + m.chunk_ns(qs, c) <= budget)[1:]
    want = int(np.count_nonzero(ok))
    assert ok[:want].all()  # cost grows with q, so the fitting q form a prefix
    assert got == want


def test_max_chunk_unbounded_budget_returns_cap() -> None:
    m = CostModel(1.0, 1.0, 1.0, 1.0)
    assert m.max_chunk(10, float("inf"), cap=32768) == 32768
    assert CostModel().max_chunk(10, 5.0, cap=123) == 123
