"""rebalance_experts: EPLB's output conventions, exact agreement with the public greedy before refinement,
and balance never worse than it after (oracle: reference_greedy.py, a loop-per-layer implementation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.eplb import rebalance_experts

from .reference_greedy import gpu_balance, reference_rebalance


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, int, int, int, int]:
    """Random (weight, replicas, groups, nodes, gpus), hierarchical or global, loads from flat to Zipf-skewed."""
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * draw(st.integers(1, 4))
    groups = draw(st.sampled_from([nodes, 2 * nodes, 3]))  # 3 with 2 or 4 nodes -> global policy
    experts = groups * draw(st.integers(1, 6))
    if experts < gpus:
        experts = groups * (-(-gpus // groups))
    reps = gpus * (-(-experts // gpus) + draw(st.integers(0, 3)))
    layers = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["int", "zipf", "zeros", "ties"]))
    if kind == "int":
        w = rng.integers(0, 100, (layers, experts)).astype(np.float64)
    elif kind == "zipf":
        s = rng.uniform(0.0, 1.5)
        w = (1.0 / np.arange(1, experts + 1) ** s)[np.argsort(rng.random((layers, experts)), axis=1)]
    elif kind == "zeros":
        w = np.zeros((layers, experts))
    else:
        w = rng.integers(0, 3, (layers, experts)).astype(np.float64)
    return w, reps, groups, nodes, gpus


def check_conventions(
    w: np.ndarray,
    reps: int,
    groups: int,
    nodes: int,
    gpus: int,
    phy2log: np.ndarray,
    log2phy: np.ndarray,
    logcnt: np.ndarray,
) -> None:
    layers, experts = w.shape
    assert phy2log.shape == (layers, reps)
    assert log2phy.shape == (layers, experts, reps - experts + 1)
    assert logcnt.shape == (layers, experts)
    assert (logcnt >= 1).all(), "every logical expert needs a replica"
    assert (logcnt.sum(axis=1) == reps).all()
    counted = np.stack([np.bincount(row, minlength=experts) for row in phy2log])
    assert (counted == logcnt).all()
    # Each GPU holds reps/gpus slots by layout; log2phy lists exactly the slots of each expert, -1 after.
    for ly in range(layers):
        seen = []
        for e in range(experts):
            row = log2phy[ly, e]
            k = logcnt[ly, e]
            assert (row[k:] == -1).all() and (row[:k] >= 0).all()
            assert (phy2log[ly, row[:k]] == e).all()
            seen.extend(row[:k].tolist())
        assert sorted(seen) == list(range(reps))
    if groups % nodes == 0 and nodes > 1:
        # Hierarchical: all replicas of a group's experts sit on one node.
        node_of_slot = np.arange(reps) // (reps // nodes)
        gsize = experts // groups
        for ly in range(layers):
            for g in range(groups):
                on = node_of_slot[np.isin(phy2log[ly], np.arange(g * gsize, (g + 1) * gsize))]
                assert np.unique(on).size == 1


@given(problems())
def test_conventions_and_never_worse_than_public_greedy(p: tuple[np.ndarray, int, int, int, int]) -> None:
    w, reps, groups, nodes, gpus = p
    phy2log, log2phy, logcnt = rebalance_experts(w, reps, groups, nodes, gpus)
    check_conventions(w, reps, groups, nodes, gpus, phy2log, log2phy, logcnt)
    ref_p2l, ref_cnt = reference_rebalance(w, reps, groups, nodes, gpus)
    ours = gpu_balance(w + 1e-300, phy2log, logcnt, gpus)
    theirs = gpu_balance(w + 1e-300, ref_p2l, ref_cnt, gpus)
    assert (ours <= theirs * (1 + 1e-12)).all(), (ours, theirs)
    # Without refinement the vectorised code is the public greedy, slot for slot.
    p0, _, c0 = rebalance_experts(w, reps, groups, nodes, gpus, refine_passes=0)
    assert np.array_equal(p0, ref_p2l) and np.array_equal(c0, ref_cnt)


def test_realistic_shape_fresh_random_loads() -> None:
    """EP64-like shape (fewer layers for speed): conventions, and refinement strictly helps on average."""
    rng = np.random.default_rng()
    layers, experts, reps, gpus = 4, 384, 448, 64
    w = rng.poisson(1e4 * rng.pareto(1.5, (layers, experts)) + 10).astype(np.float64)
    out = rebalance_experts(w, reps, 8, 1, gpus)
    check_conventions(w, reps, 8, 1, gpus, *out)
    ref_p2l, ref_cnt = reference_rebalance(w, reps, 8, 1, gpus)
    ours, theirs = gpu_balance(w, out[0], out[2], gpus), gpu_balance(w, ref_p2l, ref_cnt, gpus)
    assert (ours <= theirs * (1 + 1e-12)).all()
    assert ours.mean() < theirs.mean()


@pytest.mark.parametrize(("skew", "seed_figure"), [(0.6, 1.004), (1.0, 1.009)])
def test_zipf_in_sample_matches_seed_measurement(skew: float, seed_figure: float) -> None:
    """The seed measured the public policy at 1.004 / 1.009 on Zipf loads, 384 experts, 448 slots, EP64."""
    rng = np.random.default_rng()
    w = (1.0 / np.arange(1, 385) ** skew)[np.argsort(rng.random((2, 384)), axis=1)]
    phy2log, _, logcnt = rebalance_experts(w, 448, 1, 1, 64)
    plain = w.reshape(2, 64, 6).sum(axis=2)
    assert (plain.max(axis=1) / plain.mean(axis=1)).min() > 2.0  # the skew is real
    assert gpu_balance(w, phy2log, logcnt, 64).max() <= seed_figure + 0.002


def test_torch_in_torch_out() -> None:
    w = torch.randint(0, 50, (2, 12)).float()
    p, l2p, c = rebalance_experts(w, 16, 4, 2, 4)
    pn, ln, cn = rebalance_experts(w.numpy(), 16, 4, 2, 4)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in (p, l2p, c))
    assert np.array_equal(p.numpy(), pn) and np.array_equal(l2p.numpy(), ln) and np.array_equal(c.numpy(), cn)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight": np.ones(4)}, "2-D"),
        ({"weight": -np.ones((1, 4))}, "non-negative"),
        ({"weight": np.full((1, 4), np.nan)}, "finite"),
        ({"num_replicas": 3}, "num_replicas"),
        ({"num_replicas": 6}, "multiple of num_gpus"),
        ({"num_groups": 3}, "num_groups"),
        ({"num_gpus": 0}, "num_gpus"),
        ({"num_replicas": 8.0}, "num_replicas"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict, match: str) -> None:
    args = {"weight": np.ones((1, 4)), "num_replicas": 8, "num_groups": 2, "num_nodes": 1, "num_gpus": 4}
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        rebalance_experts(**args)
