"""The sort-free survivor finder against the full-sort oracle: the same boundary (value and id) and the same
tokens, bit for bit; fixed shapes with no data-dependent step (so it can be captured in a CUDA graph); and
the integer top-p rule against the float softmax + cumsum rule it replaced (the same set unless the boundary
mass is within float rounding of top_p)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_kernels.ops import sampling_filter
from deepinfer_kernels.ops.sampling import sample, sample_sorted
from deepinfer_kernels.ops.sampling_filter import MASS_BITS, survivor_threshold, survivors_sorted


def _oracle_threshold(logits, temperature, top_k, top_p):
    """(tv, ti, live) of the last survivor in the sorted oracle."""
    _, _, vals, idx, keep = survivors_sorted(logits, temperature, top_k, top_p)
    n = keep.sum(dim=1)
    last = (n - 1).clamp(min=0)[:, None]
    return vals.gather(1, last).squeeze(1), idx.gather(1, last).squeeze(1), torch.isfinite(vals[:, 0])


@contextlib.contextmanager
def _candidates(n: int):
    """The eager path's candidate count, lowered so that many rows fall through to the radix select."""
    old = sampling_filter.CANDIDATES
    sampling_filter.CANDIDATES = n
    try:
        yield
    finally:
        sampling_filter.CANDIDATES = old


def _assert_same(logits, temperature, top_k, top_p, seeds=None, positions=None) -> None:
    """Every path of the finder (graph-safe radix; eager candidates + radix, with the default and with 8
    candidates) gives the oracle's last survivor, and ``sample`` (its sparse and dense draws) its tokens."""
    b = logits.shape[0]
    tv0, ti0, live = _oracle_threshold(logits, temperature, top_k, top_p)
    for graph_safe, cands in ((True, None), (False, None), (False, 8)):
        with _candidates(cands or sampling_filter.CANDIDATES):
            _, tv, ti, mode = survivor_threshold(logits, temperature, top_k, top_p, graph_safe=graph_safe)
        assert torch.equal(mode == 2, ~live)
        bad = live & ((tv != tv0) | (ti.long() != ti0))
        assert not bad.any(), (
            f"graph_safe={graph_safe} candidates={cands} rows {bad.nonzero().flatten().tolist()}: finder "
            f"{tv[bad].tolist()}/{ti[bad].tolist()}, oracle {tv0[bad].tolist()}/{ti0[bad].tolist()}, "
            f"top_k {top_k[bad].tolist()}, top_p {top_p[bad].tolist()}"
        )
    seeds = torch.arange(b) * 7919 if seeds is None else seeds
    positions = torch.arange(b) + 3 if positions is None else positions
    args = (logits, temperature, top_k, top_p, seeds, positions)
    want = sample_sorted(*args)  # the dense draw over the sorted survivors
    assert torch.equal(sample(*args), want)  # CPU eager: random numbers for the survivors only
    assert torch.equal(sample(*args, graph_safe=True), want)  # the dense draw
    with _candidates(8):
        assert torch.equal(sample(*args), want)


def _logits(kind: int, b: int, v: int, g: torch.Generator) -> torch.Tensor:
    """Scaled Gaussians (wide and narrow), a small integer grid (ties everywhere), bf16, one dominant token,
    nearly flat values with signed zeros."""
    if kind == 0:
        x = torch.randn(b, v, generator=g) * float(torch.rand((), generator=g) * 30)
    elif kind == 1:
        x = torch.randint(-2, 3, (b, v), generator=g).float()
    elif kind == 2:
        x = (torch.randn(b, v, generator=g) * 4).to(torch.bfloat16)
    elif kind == 3:
        x = torch.randn(b, v, generator=g) - 20
        x[:, int(torch.randint(0, v, (), generator=g))] = 5.0
    else:
        x = torch.randint(-1, 2, (b, v), generator=g).float() * 1e-30
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    return x


@settings(max_examples=120)
@given(
    st.integers(1, 64),
    st.integers(1, 300),
    st.integers(0, 4),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.2, 0.6, 0.97]),
)
def test_same_boundary_and_tokens_as_the_sort(b: int, v: int, kind: int, seed: int, masked: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = _logits(kind, b, v, g)
    logits[torch.rand(b, v, generator=g) < masked] = float("-inf")  # grammar masks
    special = torch.randint(0, 12, (b,), generator=g)
    logits[special == 0] = float("-inf")  # no finite logit: -1
    col = torch.randint(0, v, (b,), generator=g)
    rows = torch.arange(b)
    logits[rows[special == 1], col[special == 1]] = float("nan")
    logits[rows[special == 2], col[special == 2]] = float("inf")
    temperature = torch.rand(b, generator=g) * 2 + 0.05
    temperature[torch.rand(b, generator=g) < 0.2] = 0.0  # greedy rows mixed in
    top_k = torch.randint(-2, v + 3, (b,), generator=g)
    top_k[torch.rand(b, generator=g) < 0.2] = 0
    top_k[torch.rand(b, generator=g) < 0.1] = 1
    top_k[torch.rand(b, generator=g) < 0.1] = v
    top_p = torch.rand(b, generator=g) ** 2
    for value, frac in ((1.0, 0.25), (1e-7, 0.05), (0.0, 0.05), (1.5, 0.03), (float("nan"), 0.03)):
        top_p[torch.rand(b, generator=g) < frac] = value
    _assert_same(logits, temperature, top_k, top_p)


@pytest.mark.parametrize(
    ("vocab", "kind"), [(129_280, 0), (129_280, 1), (129_280, 2), (129_280, 3), (65_536, 4)]
)
def test_full_vocabulary(vocab: int, kind: int) -> None:
    """The real vocabulary (the finder's 16-bit digits), every kind of row, top-k / top-p / both / none,
    top-k beyond the candidates a partial sort would give and top-p cutting inside a tie group."""
    g = torch.Generator().manual_seed(vocab + kind)
    b = 8
    logits = _logits(kind, b, vocab, g)
    logits[torch.rand(b, vocab, generator=g) < 0.3] = float("-inf")
    logits[5, : vocab - 3] = float("-inf")  # three finite tokens left
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.9, 1.0, 0.5, 2.0])
    top_k = torch.tensor([-1, 50, 20_000, 1, 0, 4, vocab, 100_000])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.3, 1.0, 1e-6, 0.999])
    _assert_same(logits, temperature, top_k, top_p)
    _assert_same(logits, temperature, top_k.roll(3), top_p.roll(5))


def test_cut_inside_a_tie_group() -> None:
    """Equal values: the survivors are the lowest ids, as many as the mass rule lets through."""
    v = 40
    logits = torch.zeros(6, v)
    logits[:, 7] = 1.0  # one leader, then 39 tied tokens
    top_p = torch.tensor([0.3, 0.5, 0.7, 0.9, 0.999, 0.0])
    ones = torch.ones(6)
    _, tv, ti, _ = survivor_threshold(logits, ones, torch.zeros(6, dtype=torch.long), top_p)
    e = torch.exp(torch.tensor(-1.0))
    q_lead, q_tie = 2**MASS_BITS, int(e * 2**MASS_BITS)
    z = q_lead + 39 * q_tie
    for r, p in enumerate(top_p.tolist()):
        # brute force: walk the order (7, then 0..39 without 7) with exact integer masses
        bound = max(1, int(torch.ceil(torch.tensor(p, dtype=torch.float64) * z)))
        order = [7] + [i for i in range(v) if i != 7]
        mass, last = 0, 7
        for n, i in enumerate(order):
            if n > 0 and mass >= bound:
                break
            last = i
            mass += q_lead if i == 7 else q_tie
        assert int(ti[r]) == last, (p, int(ti[r]), last)
        assert float(tv[r]) == float(logits[r, last])
    _assert_same(logits, ones, torch.zeros(6, dtype=torch.long), top_p)


@pytest.mark.parametrize("vocab", [4, 8, 65_536])
def test_all_equal_values_exact_fractions(vocab: int) -> None:
    """Equal values have equal integer masses, so ``top_p * Z`` lands exactly on a token's mass before it:
    top-p = j / vocab keeps exactly j tokens (the mass before token j is then not < the bound), the lowest
    ids; a hair above keeps j + 1."""
    fr = [1, vocab // 4, vocab // 2, 3 * vocab // 4]
    top_p = torch.tensor([j / vocab for j in fr] + [(j + 0.01) / vocab for j in fr])
    want = fr + [j + 1 for j in fr]
    b = top_p.shape[0]
    logits = torch.full((b, vocab), 1.5)
    ones, no_k = torch.ones(b), torch.zeros(b, dtype=torch.long)
    _, tv, ti, _ = survivor_threshold(logits, ones, no_k, top_p)
    assert ti.tolist() == [n - 1 for n in want]
    assert torch.all(tv == 1.5)
    _assert_same(logits, ones, no_k, top_p)


def _float_rule(logits, temperature, top_k, top_p):
    """The float rule the integer one replaced, in float64: softmax over the top-k sorted values, cumsum,
    ``before < top_p``. Returns the survivor mask (token order) and, per row, how close a decision came to
    top_p (the smallest float64 distance of ``before`` from top_p inside the top-k)."""
    x = logits.float() / temperature[:, None]
    v = x.shape[1]
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v)[None, :]
    k = torch.where(top_k >= 1, top_k, torch.full_like(top_k, v)).clamp(max=v)
    keep = rank < k[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")).double(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    margin = (before - top_p.double()[:, None]).abs().masked_fill(~keep, float("inf")).amin(dim=1)
    keep &= before < top_p.double()[:, None]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, idx, keep), margin


def test_integer_rule_matches_the_float_rule() -> None:
    """The integer masses change no survivor set unless a cumulative mass lies within 1e-6 of top_p."""
    g = torch.Generator().manual_seed(5)
    b, v = 64, 5000
    logits = torch.randn(b, v, generator=g) * torch.linspace(0.5, 12, b)[:, None]
    temperature = torch.rand(b, generator=g) + 0.3
    top_k = torch.where(torch.rand(b, generator=g) < 0.5, torch.randint(1, 3000, (b,), generator=g), 0)
    top_p = torch.rand(b, generator=g) * 0.98
    want, margin = _float_rule(logits, temperature, top_k, top_p)
    _, tv, ti, _ = survivor_threshold(logits, temperature, top_k, top_p)
    x = logits / temperature[:, None]
    got = (x > tv[:, None]) | ((x == tv[:, None]) & (torch.arange(v)[None, :] <= ti[:, None].long()))
    differ = (got != want).any(dim=1)
    assert not (differ & (margin > 1e-6)).any()
    assert int(differ.sum()) <= 1


def test_no_data_dependent_shape_or_control_flow() -> None:
    """What a CUDA graph needs, checked on the CPU: the finder and ``sample`` run on meta tensors (no value
    is ever read), and Dynamo traces them whole (``fullgraph``: an ``.item()``, a ``nonzero`` or a branch on
    a tensor value would break the graph and raise), giving the eager result."""
    b, v = 5, 300
    g = torch.Generator().manual_seed(1)
    args = [
        torch.randn(b, v, generator=g),
        torch.rand(b, generator=g),
        torch.randint(-1, 20, (b,), generator=g),
        torch.rand(b, generator=g),
    ]
    rng = [torch.arange(b), torch.arange(b)]
    meta = survivor_threshold(*[a.to("meta") for a in args])  # a non-CPU device: the graph-safe path
    assert [tuple(t.shape) for t in meta] == [(b,)] * 4
    assert sample(*[a.to("meta") for a in args + rng]).shape == (b,)
    torch._dynamo.reset()
    compiled = torch.compile(survivor_threshold, fullgraph=True, backend="eager")
    for graph_safe in (None, True):  # None: traced, so graph-safe by itself
        for got, want in zip(compiled(*args, graph_safe=graph_safe), survivor_threshold(*args)):
            assert torch.equal(got, want)
    compiled_sample = torch.compile(sample, fullgraph=True, backend="eager")
    assert torch.equal(compiled_sample(*args, *rng), sample(*args, *rng))


def test_batch_invariant() -> None:
    """A row's boundary does not depend on the other rows (the radix bins and searches are per row)."""
    g = torch.Generator().manual_seed(3)
    b, v = 24, 70_000
    logits = torch.randn(b, v, generator=g) * 3
    temperature = torch.rand(b, generator=g) + 0.5
    top_k = torch.randint(-1, 200, (b,), generator=g)
    top_p = torch.rand(b, generator=g)
    full = survivor_threshold(logits, temperature, top_k, top_p)
    for idx in (torch.tensor([5]), torch.tensor([23, 0, 7])):
        part = survivor_threshold(logits[idx], temperature[idx], top_k[idx], top_p[idx])
        for p, f in zip(part, full):
            assert torch.equal(p, f[idx])
