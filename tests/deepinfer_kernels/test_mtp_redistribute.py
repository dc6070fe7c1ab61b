"""mtp_redistribute (device-side, batched) equals the CPU greedy restricted to the same total."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.spec import MTPVarlen, redistribute
from deepinfer_kernels import get_op


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    R, D = int(rng.integers(1, 300)), int(rng.integers(1, 6))
    if rng.random() < 0.4:  # exact ties across and within requests
        a = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(R, D))
    else:
        a = rng.beta(3.0, 1.0, size=(R, D)).astype(rng.choice([np.float32, np.float64]))
    n = rng.integers(0, D + 1, size=R).astype(np.int32)
    return a, n, int(rng.integers(0, n.sum() + 1))


def test_equals_cpu_greedy_restricted_to_total() -> None:
    rng = np.random.default_rng()
    op = get_op("mtp_redistribute")
    for _ in range(200):
        a, n, total = _random_case(rng)
        cpu = MTPVarlen(max_drafts=a.shape[1]).plan_total(a, total, n).lengths
        dev = op(total, torch.from_numpy(a), torch.from_numpy(n))
        assert dev.dtype == torch.int32
        assert dev.tolist() == cpu.tolist()
        assert int(dev.sum()) == total


def test_async_total_with_fresh_confidences_and_tensor_total() -> None:
    rng = np.random.default_rng()
    pol = MTPVarlen()
    stale = rng.beta(3.0, 1.0, size=(128, 5))
    total = pol.plan(stale).total_drafts  # the CPU fixes the size from last step's confidences
    fresh = np.clip(stale + rng.normal(0.0, 0.1, size=stale.shape), 0.0, 1.0)
    got = redistribute(torch.tensor(total), torch.from_numpy(fresh))
    assert got.tolist() == pol.plan_total(fresh, total).lengths.tolist()
    # With unchanged confidences it reproduces the CPU plan itself.
    assert redistribute(total, torch.from_numpy(stale)).tolist() == pol.plan(stale).lengths.tolist()


def test_total_beyond_valid_drafts_selects_them_all() -> None:
    a = torch.full((3, 4), 0.5)
    n = torch.tensor([1, 0, 2])
    assert redistribute(10, a, n).tolist() == [1, 0, 2]


@pytest.mark.parametrize(
    ("total", "conf", "nd", "match"),
    [
        (13, torch.full((3, 4), 0.5), None, r"total=13: must be an integer in \[0, 12\]"),
        (-1, torch.full((3, 4), 0.5), None, r"total=-1"),
        (1, torch.full((3,), 0.5), None, r"confidences: must be \[requests, drafts\]"),
        (1, torch.ones(3, 4, dtype=torch.int64), None, r"confidences: must be floating point"),
        (1, torch.full((3, 4), 0.5), torch.tensor([1, 2]), r"num_drafts: must have shape \(3,\)"),
    ],
)
def test_bad_input_names_the_field(
    total: int, conf: torch.Tensor, nd: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        redistribute(total, conf, nd)


@pytest.mark.gpu
def test_cuda_equals_cpu_greedy() -> None:
    rng = np.random.default_rng()
    for _ in range(50):
        a, n, total = _random_case(rng)
        cpu = MTPVarlen(max_drafts=a.shape[1]).plan_total(a, total, n).lengths
        dev = redistribute(total, torch.from_numpy(a).cuda(), torch.from_numpy(n).cuda(), backend="cuda")
        assert dev.cpu().tolist() == cpu.tolist()
