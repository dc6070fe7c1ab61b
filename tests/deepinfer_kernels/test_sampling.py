"""The counter-based sampler draws from the right distribution and is batch-invariant."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_kernels import get_op
from deepinfer_kernels.ops.sampling import counter_uniform, greedy_tokens

sample = get_op("sample")


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    m = exp > 0
    df = int(m.sum()) - 1
    if df == 0:  # one survivor (top-p over a dominant token): every draw must be it, no statistic to take
        return 1.0 if bool(counts[m].sum() == n) else 0.0
    stat = (((counts[m] - exp[m]) ** 2) / exp[m]).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _draw(logits: torch.Tensor, n: int, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    seed = torch.randint(0, 2**62, ()).item()
    big = logits.expand(n, -1)
    return sample(
        big,
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.full((n,), seed, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),  # one request, n positions: n independent draws
    )


def _target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    # Independent float64 oracle of the filtered distribution.
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True, stable=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    pk = p.clone()
    if top_k >= 1:
        pk[order[top_k:]] = 0
    pk = pk / pk.sum()
    limit = top_k if top_k >= 1 else len(p)
    for kept, i in enumerate(order.tolist()):
        if kept >= limit or (kept > 0 and mass >= top_p):
            break
        keep[i] = True
        mass += float(pk[i])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.8), (1.0, 5, 0.9)]
)
def test_distribution_matches_filtered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(12) * 1.5
    draws = _draw(logits, 60_000, temperature, top_k, top_p)
    counts = torch.bincount(draws, minlength=12).double()
    target = _target(logits, temperature, top_k, top_p)
    assert counts[target == 0].sum() == 0, "a filtered-out token was drawn"
    assert _chi2_pvalue(counts, target) > 1e-4


def test_batch_invariance_and_greedy() -> None:
    b, v = 37, 1000
    logits = torch.randn(b, v)
    temp = torch.rand(b) * 1.5
    temp[::5] = 0.0
    top_k = torch.randint(-1, 50, (b,))
    top_p = torch.rand(b) * 0.5 + 0.5
    seeds = torch.randint(0, 2**62, (b,))
    pos = torch.randint(0, 10_000, (b,))
    full = sample(logits, temp, top_k, top_p, seeds, pos)
    perm = torch.randperm(b)
    shuffled = sample(logits[perm], temp[perm], top_k[perm], top_p[perm], seeds[perm], pos[perm])
    assert torch.equal(shuffled, full[perm])
    for i in torch.randint(0, b, (5,)).tolist():  # alone == in the batch
        one = sample(
            logits[i : i + 1],
            temp[i : i + 1],
            top_k[i : i + 1],
            top_p[i : i + 1],
            seeds[i : i + 1],
            pos[i : i + 1],
        )
        assert one.item() == full[i].item()
    g = temp == 0
    assert torch.equal(full[g], logits[g].argmax(-1))


def test_masked_tokens_never_drawn_and_dead_rows() -> None:
    v = 64
    logits = torch.randn(200, v)
    allowed = torch.rand(200, v) < 0.1
    allowed[:, 0] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits[7] = float("-inf")  # a dead row
    n = logits.shape[0]
    out = sample(
        logits,
        torch.ones(n),
        torch.full((n,), -1),
        torch.ones(n),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
    )
    assert out[7].item() == -1
    rows = torch.arange(n) != 7
    assert bool(allowed[rows, out[rows]].all())


def test_counter_uniform_is_uniform_and_keyed() -> None:
    u = counter_uniform(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), 50_000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    for row in u:  # mean and variance of U(0,1) within 5 sigma
        assert abs(float(row.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / row.numel())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, counter_uniform(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), 50_000))


def test_bad_shapes_name_the_argument() -> None:
    with pytest.raises(ValueError, match="top_p"):
        sample(
            torch.randn(3, 5),
            torch.ones(3),
            torch.ones(3, dtype=torch.int64),
            torch.ones(2),
            torch.zeros(3),
            torch.zeros(3),
        )


@given(st.integers(1, 9), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_greedy_tokens_equal_the_sampler_at_temperature_zero(rows: int, vocab: int, seed: int) -> None:
    """The engine's all-greedy shortcut against ``sample`` with every temperature 0: integer-valued logits
    (many ties: lowest id wins), masked entries, rows with no finite logit, a NaN or +inf entry."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()
    logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
    special = torch.randint(0, 4, (rows,), generator=g)
    for r in range(rows):
        col = int(torch.randint(0, vocab, (1,), generator=g))
        if special[r] == 1:
            logits[r] = float("-inf")
        elif special[r] == 2:
            logits[r, col] = float("nan")
        elif special[r] == 3:
            logits[r, col] = float("inf")
    z = torch.zeros(rows)
    want = get_op("sample")(
        logits,
        z,
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows),
        torch.arange(rows),
        torch.arange(rows),
    )
    assert torch.equal(greedy_tokens(logits), want)
