"""verify(): lossless speculative sampling (chi-square against the target) and greedy exact match.

The statistical tests use fresh seeds each run (printed on failure) and a p-value threshold of 1e-4 with
~60k samples: a correct sampler fails about once in 10,000 runs, a biased one essentially always (the
power test below shows a plausible bug is caught by the same harness).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer_core.spec import verify
from deepinfer_kernels import get_op

P_MIN = 1e-4


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; sf of chi2(k) at x is the regularised upper gamma Q(k/2, x/2)."""
    obs, exp = observed.double(), expected.double()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((exp.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def _tables(g: torch.Generator, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order-1 Markov target P and drafter Q over V tokens (row V is the start state), deliberately
    different, every entry bounded away from 0 so every chi-square cell is well populated."""

    def dirichlet(n: int) -> torch.Tensor:
        e = -torch.log(torch.rand(n, V, generator=g, dtype=torch.float64))
        return e / e.sum(1, keepdim=True)

    P = 0.5 * dirichlet(V + 1) + 0.5 / V
    Q = 0.2 * P + 0.8 * dirichlet(V + 1)
    return P, Q


Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _emit_sequences(
    verifier: Verifier, g: torch.Generator, P: torch.Tensor, Q: torch.Tensor, N: int, D: int, L: int
) -> torch.Tensor:
    """Run draft/verify steps on N independent sequences until each has L emitted tokens; return [N, L].

    The drafter samples D tokens from Q given its own prefix; the target's distribution after each draft
    prefix is P given that prefix; verify lengths are random per row and step (0..D)."""
    V = P.shape[1]
    seq = torch.full((N, L), -1, dtype=torch.int64)
    count = torch.zeros(N, dtype=torch.int64)
    last = torch.full((N,), V, dtype=torch.int64)  # start state
    rows = torch.arange(N)
    for _ in range(L):
        ctx = [last]
        drafts = []
        for _k in range(D):
            d = torch.multinomial(Q[ctx[-1]], 1, generator=g).squeeze(1)
            drafts.append(d)
            ctx.append(d)
        draft_tokens = torch.stack(drafts, 1)
        draft_probs = torch.stack([Q[c] for c in ctx[:D]], 1)
        target_probs = torch.stack([P[c] for c in ctx], 1)
        lengths = torch.randint(0, D + 1, (N,), generator=g)
        num_acc, nxt = verifier(draft_tokens, draft_probs, target_probs, lengths, g)
        emitted = torch.cat([draft_tokens, torch.zeros(N, 1, dtype=torch.int64)], 1)
        emitted[rows, num_acc] = nxt
        for j in range(D + 1):
            put = (j <= num_acc) & (count < L)
            seq[rows[put], count[put]] = emitted[put, j]
            count = count + put.long()
        last = torch.where(count > 0, seq[rows, (count - 1).clamp_min(0)], last)
        if bool((count >= L).all()):
            break
    assert bool((count >= L).all())
    return seq


def _joint_pvalue(verifier: Verifier, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    V, D, L, N = 4, 3, 3, 60_000
    P, Q = _tables(g, V)
    seq = _emit_sequences(verifier, g, P, Q, N, D, L)
    cells = (seq[:, 0] * V + seq[:, 1]) * V + seq[:, 2]
    observed = torch.bincount(cells, minlength=V**L)
    # Target joint of the first three tokens: P(x0 | start) P(x1 | x0) P(x2 | x1).
    x = torch.arange(V**L)
    x0, x1, x2 = x // (V * V), (x // V) % V, x % V
    expected = N * P[V, x0] * P[x0, x1] * P[x1, x2]
    return chi_square_pvalue(observed, expected)


def _reference(draft_tokens, draft_probs, target_probs, lengths, g):  # type: ignore[no-untyped-def]
    r = verify(draft_tokens, draft_probs, target_probs, lengths, g)
    return r.num_accepted, r.next_token


def test_emitted_tokens_follow_target_distribution() -> None:
    seed = int(torch.seed())
    p = _joint_pvalue(_reference, seed)
    assert p > P_MIN, f"emitted tokens deviate from the target (chi-square p={p:.2e}, seed={seed})"


def test_chi_square_harness_catches_resampling_from_target_on_rejection() -> None:
    """A classic bug: on rejection, sample from p instead of the residual max(0, p - q)."""

    def biased(draft_tokens, draft_probs, target_probs, lengths, g):  # type: ignore[no-untyped-def]
        num_acc, nxt = get_op("spec_verify")(draft_tokens, draft_probs, target_probs, lengths, g)
        rows = torch.arange(lengths.shape[0])
        wrong = torch.multinomial(target_probs[rows, num_acc], 1, generator=g).squeeze(1)
        return num_acc, torch.where(num_acc < lengths, wrong, nxt)

    seed = int(torch.seed())
    p = _joint_pvalue(biased, seed)
    assert p < P_MIN, f"the harness missed a biased sampler (p={p:.2e}, seed={seed})"


def _greedy_oracle(
    draft_tokens: torch.Tensor, target_probs: torch.Tensor, lengths: torch.Tensor
) -> tuple[list[int], list[int]]:
    acc, nxt = [], []
    for i in range(draft_tokens.shape[0]):
        k = 0
        while k < int(lengths[i]) and int(draft_tokens[i, k]) == int(target_probs[i, k].argmax()):
            k += 1
        acc.append(k)
        nxt.append(int(target_probs[i, k].argmax()))
    return acc, nxt


def test_greedy_rows_are_exact_match() -> None:
    g = torch.Generator().manual_seed(int(torch.seed()))
    R, D, V = 200, 5, 7
    target = torch.softmax(torch.randn(R, D + 1, V, generator=g) * 3, -1)
    # Drafts equal the target argmax 70% of the time so accepted lengths vary.
    hit = torch.rand(R, D, generator=g) < 0.7
    drafts = torch.where(hit, target[:, :D].argmax(-1), torch.randint(0, V, (R, D), generator=g))
    lengths = torch.randint(0, D + 1, (R,), generator=g)
    exp_acc, exp_next = _greedy_oracle(drafts, target, lengths)
    r = verify(drafts, None, target, lengths, g, greedy=True)
    assert r.num_accepted.tolist() == exp_acc and r.next_token.tolist() == exp_next
    # Mixed batch: greedy rows still exact; the others go through sampling (given draft probs).
    mask = torch.rand(R, generator=g) < 0.5
    draft_probs = torch.softmax(torch.randn(R, D, V, generator=g), -1)
    r2 = verify(drafts, draft_probs, target, lengths, g, greedy=mask)
    sel = mask.nonzero().squeeze(1).tolist()
    assert [r2.num_accepted[i].item() for i in sel] == [exp_acc[i] for i in sel]
    assert [r2.next_token[i].item() for i in sel] == [exp_next[i] for i in sel]


def test_output_layout_and_edge_cases() -> None:
    g = torch.Generator().manual_seed(int(torch.seed()))
    R, D, V = 64, 4, 9
    probs = torch.softmax(torch.randn(R, D + 1, V, generator=g), -1)
    drafts = torch.multinomial(probs[:, :D].reshape(-1, V), 1, generator=g).view(R, D)
    lengths = torch.randint(0, D + 1, (R,), generator=g)
    # Drafter == target: every verified draft is accepted (u * q < p with u < 1), then a bonus token.
    r = verify(drafts, probs[:, :D], probs, lengths, g)
    assert r.num_accepted.tolist() == lengths.tolist()
    for i in range(R):
        n = int(r.num_accepted[i])
        assert r.output_tokens[i, :n].tolist() == drafts[i, :n].tolist()
        assert int(r.output_tokens[i, n]) == int(r.next_token[i])
        assert (r.output_tokens[i, n + 1 :] == -1).all()
    assert (r.num_emitted == r.num_accepted + 1).all()
    # A draft the target gives probability 0 is never accepted, and the correction avoids it too.
    target = probs.clone()
    target[torch.arange(R), 0, drafts[:, 0]] = 0.0
    target[:, 0] /= target[:, 0].sum(-1, keepdim=True)
    r = verify(drafts, probs[:, :D], target, torch.full((R,), D), g)
    assert (r.num_accepted == 0).all() and (r.next_token != drafts[:, 0]).all()
    # No drafts at all: the bonus comes from the first target row.
    r = verify(
        torch.zeros(R, 0, dtype=torch.int64),
        torch.zeros(R, 0, V),
        probs[:, :1],
        torch.zeros(R, dtype=torch.int64),
        g,
    )
    assert (r.num_accepted == 0).all() and r.output_tokens.shape == (R, 1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"verify_lengths": torch.tensor([0, 5])}, r"verify_lengths\[1\]=5: must be in \[0, 3\]"),
        (
            {"draft_tokens": torch.tensor([[0, 9, 0], [0, 0, 0]])},
            r"draft_tokens\[0, 1\]=9: must be a token id in \[0, 4\)",
        ),
        (
            {"target_probs": torch.full((2, 3, 4), 0.25)},
            r"target_probs: must be \[requests, drafts \+ 1, vocab\]",
        ),
        ({"draft_probs": torch.full((2, 3, 5), 0.2)}, r"draft_probs: must be \[requests, drafts, vocab\]"),
        ({"draft_probs": None}, r"draft_probs: required unless every row is greedy"),
    ],
)
def test_bad_input_names_the_field(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "draft_tokens": torch.zeros(2, 3, dtype=torch.int64),
        "draft_probs": torch.full((2, 3, 4), 0.25),
        "target_probs": torch.full((2, 4, 4), 0.25),
        "verify_lengths": torch.tensor([3, 2]),
    }
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        verify(**args)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_verify_on_cuda_matches_greedy_oracle() -> None:
    g = torch.Generator(device="cuda").manual_seed(int(torch.seed()))
    R, D, V = 128, 5, 11
    target = torch.softmax(torch.randn(R, D + 1, V, device="cuda", generator=g) * 3, -1)
    drafts = target[:, :D].argmax(-1)
    drafts[:, 2] = (drafts[:, 2] + 1) % V
    lengths = torch.randint(0, D + 1, (R,), device="cuda", generator=g)
    r = verify(drafts, None, target, lengths, g, greedy=True, backend="cuda")
    exp_acc, exp_next = _greedy_oracle(drafts.cpu(), target.cpu(), lengths.cpu())
    assert r.num_accepted.cpu().tolist() == exp_acc and r.next_token.cpu().tolist() == exp_next
