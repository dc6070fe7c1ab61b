"""cuda spec_verify (TileLang, counter mode) against the torch reference run on the same GPU: exact
accepted counts and tokens; batch invariance; edge cases (no drafts, zero-probability drafts, p == q)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _ops():  # type: ignore[no-untyped-def]
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG, "tilelang must import on the GPU machine, else the cuda op is the reference"
    cuda, ref = get_op("spec_verify", "cuda"), get_op("spec_verify", "reference")
    assert cuda is not ref
    return cuda, ref


def _batch(R: int, D: int, V: int, seed: int, sharp: float = 2.0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(R, D + 1, V, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(R, D, V, generator=g) * sharp, -1)
    if R >= 4 and D:
        q[: R // 4] = p[: R // 4, :D]  # drafter == target: all accepted, bonus token
        p[R // 4 : R // 2, 0, :] = torch.where(
            torch.rand(R // 2 - R // 4, V, generator=g) < 0.5, 0.0, p[R // 4 : R // 2, 0]
        )
    drafts = (
        torch.multinomial(q.reshape(-1, V), 1, generator=g).view(R, D)
        if D
        else torch.zeros(R, 0, dtype=torch.int64)
    )
    if R >= 4 and D:
        drafts[-1, 0] = V - 1
    lengths = torch.randint(0, D + 1, (R,), generator=g)
    seeds = torch.randint(-(2**62), 2**62, (R,), generator=g)
    positions = torch.randint(0, 1 << 20, (R,), generator=g)
    greedy = torch.rand(R, generator=g) < 0.3
    return [t.cuda() for t in (drafts, q, p, lengths, seeds, positions, greedy)]


@pytest.mark.parametrize(
    ("R", "D", "V"),
    [(1, 5, 129_280), (64, 5, 129_280), (97, 3, 1000), (33, 1, 37), (16, 0, 513), (200, 6, 31)],
)
def test_kernel_equals_reference_on_gpu(R: int, D: int, V: int) -> None:
    cuda, ref = _ops()
    drafts, q, p, lengths, seeds, positions, greedy = _batch(R, D, V, R * 1000 + D * 10 + V)
    for gr in (greedy, False):
        want = ref(drafts, q, p, lengths, None, gr, seeds=seeds, positions=positions)
        got = cuda(drafts, q, p, lengths, None, gr, seeds=seeds, positions=positions)
        assert torch.equal(got[0], want[0]), (
            f"accepted counts differ in {(got[0] != want[0]).sum().item()} rows"
        )
        assert torch.equal(got[1], want[1]), f"tokens differ in {(got[1] != want[1]).sum().item()} rows"


def test_all_greedy_without_draft_probs_and_bf16_probs() -> None:
    cuda, ref = _ops()
    drafts, q, p, lengths, seeds, positions, _ = _batch(50, 4, 4099, 7)
    want = ref(drafts, None, p, lengths, None, True, seeds=seeds, positions=positions)
    got = cuda(drafts, None, p, lengths, None, True, seeds=seeds, positions=positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    pb, qb = p.to(torch.bfloat16), q.to(torch.bfloat16)
    want = ref(drafts, qb, pb, lengths, seeds=seeds, positions=positions)
    got = cuda(drafts, qb, pb, lengths, seeds=seeds, positions=positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_residual_all_zero_falls_back_to_target() -> None:
    """q == p and the draft has p = 0 at its position: rejected, residual zero everywhere -> drawn from p."""
    cuda, ref = _ops()
    R, D, V = 8, 2, 300
    drafts, _, p, _, seeds, positions, _ = _batch(R, D, V, 9)
    p[torch.arange(R), 0, drafts[:, 0]] = 0.0
    q = p[:, :D].clone()
    lengths = torch.full((R,), D, device="cuda")
    want = ref(drafts, q, p, lengths, seeds=seeds, positions=positions)
    got = cuda(drafts, q, p, lengths, seeds=seeds, positions=positions)
    assert (got[0] == 0).all() and torch.equal(got[1], want[1])
    assert (got[1] != drafts[:, 0]).all()


def test_batch_invariance() -> None:
    cuda, _ = _ops()
    drafts, q, p, lengths, seeds, positions, greedy = _batch(120, 5, 2000, 11)
    full = cuda(drafts, q, p, lengths, None, greedy, seeds=seeds, positions=positions)
    idx = torch.randperm(120, generator=torch.Generator().manual_seed(2))[:17].cuda()
    part = cuda(
        drafts[idx],
        q[idx],
        p[idx],
        lengths[idx],
        None,
        greedy[idx],
        seeds=seeds[idx],
        positions=positions[idx],
    )
    assert torch.equal(part[0], full[0][idx]) and torch.equal(part[1], full[1][idx])
    one = cuda(
        drafts[5:6],
        q[5:6],
        p[5:6],
        lengths[5:6],
        None,
        greedy[5:6],
        seeds=seeds[5:6],
        positions=positions[5:6],
    )
    assert int(one[0]) == int(full[0][5]) and int(one[1]) == int(full[1][5])


def test_generator_mode_and_empty_batch_use_the_reference() -> None:
    cuda, _ = _ops()
    drafts, q, p, lengths, _, _, _ = _batch(6, 3, 50, 13)
    a = cuda(drafts, q, p, lengths, torch.Generator(device="cuda").manual_seed(1))
    assert a[0].shape == (6,) and bool(((a[0] >= 0) & (a[0] <= lengths)).all())
    z = torch.zeros(0, dtype=torch.int64, device="cuda")
    e = cuda(drafts[:0], q[:0], p[:0], lengths[:0], seeds=z, positions=z)
    assert e[0].shape == (0,) and e[1].shape == (0,)
