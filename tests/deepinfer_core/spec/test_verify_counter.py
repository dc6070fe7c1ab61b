"""verify() in counter mode (seeds / positions instead of a torch.Generator): lossless, batch-invariant,
and equal to a per-row oracle written from the documented streams."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.spec import verify
from deepinfer_kernels.ops.sampling import counter_uniform
from deepinfer_kernels.ops.spec_verify import ACCEPT_SALT, RESAMPLE_SALT

from .test_verify import P_MIN, _emit_sequences, _joint_pvalue, _tables, chi_square_pvalue


def _counter_verifier(seed: int):  # type: ignore[no-untyped-def]
    """A verifier for the chi-square harness: fresh per-sequence seeds, positions advancing by D + 1 a step
    so no (seed, position) stream is reused across steps."""
    state = {"step": 0, "seeds": None}

    def run(draft_tokens, draft_probs, target_probs, lengths, g):  # type: ignore[no-untyped-def]
        n, d = draft_tokens.shape
        if state["seeds"] is None:
            state["seeds"] = torch.randint(
                -(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(seed)
            )
        pos = torch.full((n,), state["step"] * (d + 1), dtype=torch.int64)
        state["step"] += 1
        r = verify(draft_tokens, draft_probs, target_probs, lengths, seeds=state["seeds"], positions=pos)
        return r.num_accepted, r.next_token

    return run


def test_counter_mode_emits_the_target_distribution() -> None:
    seed = int(torch.seed())
    p = _joint_pvalue(_counter_verifier(seed ^ 0x5A5A), seed)
    assert p > P_MIN, f"counter mode deviates from the target (chi-square p={p:.2e}, seed={seed})"


def test_counter_mode_harness_catches_a_shared_stream() -> None:
    """Power check: reusing one position for every step (correlated uniforms) must be caught."""
    seed = int(torch.seed())
    g = torch.Generator().manual_seed(seed)
    V, D, L, N = 4, 3, 3, 20_000
    P, Q = _tables(g, V)
    seeds = torch.randint(0, 2**62, (N,), generator=g)

    def stuck(draft_tokens, draft_probs, target_probs, lengths, _g):  # type: ignore[no-untyped-def]
        r = verify(
            draft_tokens,
            draft_probs,
            target_probs,
            lengths,
            seeds=seeds,
            positions=torch.zeros(N, dtype=torch.int64),
        )
        return r.num_accepted, r.next_token

    seq = _emit_sequences(stuck, g, P, Q, N, D, L)
    # Tokens 0 and 1 of one sequence come from the same stream when a step emits one token: dependent.
    cells = seq[:, 0] * V + seq[:, 1]
    observed = torch.bincount(cells, minlength=V * V)
    x = torch.arange(V * V)
    expected = N * P[V, x // V] * P[x // V, x % V]
    p = chi_square_pvalue(observed, expected)
    assert p < P_MIN, f"the harness missed correlated streams (p={p:.2e}, seed={seed})"


def _oracle(drafts, q, p, lengths, seeds, positions, greedy):  # type: ignore[no-untyped-def]
    """Per-row loops over the documented streams (no batching, no torch.where)."""
    acc, nxt = [], []
    for i in range(drafts.shape[0]):
        k = 0
        while k < int(lengths[i]):
            t = int(drafts[i, k])
            if bool(greedy[i]):
                ok = t == int(p[i, k].argmax())
            else:
                u = float(counter_uniform(seeds[i : i + 1] ^ ACCEPT_SALT, positions[i : i + 1] + k, 1)[0, 0])
                ok = u * float(q[i, k, t]) < float(p[i, k, t])
            if not ok:
                break
            k += 1
        acc.append(k)
        if bool(greedy[i]):
            nxt.append(int(p[i, k].argmax()))
            continue
        u = counter_uniform(seeds[i : i + 1] ^ RESAMPLE_SALT, positions[i : i + 1] + k, p.shape[2])[0]
        w = p[i, k].float()
        if k < int(lengths[i]):
            res = (p[i, k].float() - q[i, k].float()).clamp_min(0)
            if bool((res > 0).any()):
                w = res
        scores = torch.log(w) - torch.log(-torch.log(u))
        nxt.append(int(scores.argmax()))
    return acc, nxt


def _batch(g: torch.Generator, R: int, D: int, V: int):  # type: ignore[no-untyped-def]
    p = torch.softmax(torch.randn(R, D + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(R, D, V, generator=g) * 2, -1)
    q[: R // 4] = p[: R // 4, :D]  # drafter == target: all accepted, bonus tokens
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(R, D)
    lengths = torch.randint(0, D + 1, (R,), generator=g)
    seeds = torch.randint(-(2**62), 2**62, (R,), generator=g)
    positions = torch.randint(0, 10_000, (R,), generator=g)
    return drafts, q, p, lengths, seeds, positions


def test_counter_mode_equals_per_row_oracle() -> None:
    g = torch.Generator().manual_seed(int(torch.seed()))
    R, D, V = 48, 4, 37
    drafts, q, p, lengths, seeds, positions = _batch(g, R, D, V)
    greedy = torch.rand(R, generator=g) < 0.25
    r = verify(drafts, q, p, lengths, greedy=greedy, seeds=seeds, positions=positions)
    acc, nxt = _oracle(drafts, q, p, lengths, seeds, positions, greedy)
    assert r.num_accepted.tolist() == acc and r.next_token.tolist() == nxt
    sampled = ~greedy[: R // 4]  # drafter == target: a sampled row accepts every verified draft
    assert (r.num_accepted[: R // 4][sampled] == lengths[: R // 4][sampled]).all()


def test_counter_mode_is_batch_invariant_and_reproducible() -> None:
    g = torch.Generator().manual_seed(int(torch.seed()))
    R, D, V = 40, 5, 50
    drafts, q, p, lengths, seeds, positions = _batch(g, R, D, V)
    full = verify(drafts, q, p, lengths, seeds=seeds, positions=positions)
    again = verify(drafts, q, p, lengths, seeds=seeds, positions=positions)
    assert torch.equal(full.output_tokens, again.output_tokens)
    perm = torch.randperm(R, generator=g)
    sub = perm[: R // 3]
    part = verify(drafts[sub], q[sub], p[sub], lengths[sub], seeds=seeds[sub], positions=positions[sub])
    assert torch.equal(part.output_tokens, full.output_tokens[sub])
    # A different position is a different stream: over 40 rows some outcome changes.
    moved = verify(drafts, q, p, lengths, seeds=seeds, positions=positions + 1)
    assert not torch.equal(moved.output_tokens, full.output_tokens)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"seeds": torch.zeros(2, dtype=torch.int64)}, r"seeds / positions: counter mode needs both"),
        (
            {"seeds": torch.zeros(3, dtype=torch.int64), "positions": torch.zeros(3, dtype=torch.int64)},
            r"seeds: must be an integer tensor of shape \(2,\)",
        ),
        (
            {"seeds": torch.zeros(2), "positions": torch.zeros(2, dtype=torch.int64)},
            r"seeds: must be an integer tensor",
        ),
        (
            {
                "seeds": torch.zeros(2, dtype=torch.int64),
                "positions": torch.zeros(2, dtype=torch.int64),
                "generator": torch.Generator(),
            },
            r"generator: not used in counter mode",
        ),
    ],
)
def test_counter_mode_bad_input(kw: dict, match: str) -> None:
    args = {"generator": None, **kw}
    p = torch.full((2, 4, 4), 0.25)
    with pytest.raises(ValueError, match=match):
        verify(
            torch.zeros(2, 3, dtype=torch.int64),
            torch.full((2, 3, 4), 0.25),
            p,
            torch.tensor([1, 2]),
            args.pop("generator"),
            **args,
        )
