"""Weight migration over torch.distributed: 2 and 4 gloo processes on CPU carry out a re-plan's moves."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.eplb import ExpertPlacement
from deepinfer_core.eplb.migration import replan_with_migration
from deepinfer_core.eplb.transfer import execute_moves

pytestmark = pytest.mark.distributed

LAYERS, EXPERTS, SHAPE = 3, 16, (4, 6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expert_tensor(layer: int, expert: int, k: int) -> torch.Tensor:
    """Weights of (layer, expert), tensor k: random but a pure function of its ids (the oracle)."""
    g = torch.Generator().manual_seed(layer * 100_003 + expert * 7 + k)
    return torch.randn(SHAPE if k == 0 else SHAPE[:1], generator=g, dtype=torch.float32 if k == 0 else torch.float64)


def _plans(world: int, seed: int) -> tuple[np.ndarray, np.ndarray, object]:
    rng = np.random.default_rng(seed)
    reps = EXPERTS + 2 * world
    w0 = rng.integers(1, 1000, (LAYERS, EXPERTS))
    old = ExpertPlacement.plan(w0, reps, 1, 1, world)
    w1 = w0 * rng.lognormal(0.0, 1.0, w0.shape)  # strong drift: counts and GPUs change
    plan = replan_with_migration(old, w1, tolerance=0.0, expert_bytes=1)
    return old.phy2log, plan.placement.phy2log, plan.moves


def _migrate_and_check(world: int, seed: int, batch_size: int, group: dist.ProcessGroup | None) -> None:
    rank = dist.get_rank(group)
    old, new, moves = _plans(world, seed)
    per = old.shape[1] // world
    mine = slice(rank * per, (rank + 1) * per)
    weights = [
        torch.stack([torch.stack([_expert_tensor(ly, int(e), k) for e in old[ly, mine]]) for ly in range(LAYERS)])
        for k in range(2)
    ]
    report = execute_moves(moves, weights, group=group, batch_size=batch_size)
    for ly in range(LAYERS):
        for j, e in enumerate(new[ly, mine]):
            for k in range(2):
                assert torch.equal(weights[k][ly, j], _expert_tensor(ly, int(e), k)), (rank, ly, j, k)
    counts = torch.tensor([report.sent, report.received], dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    assert counts[0] == counts[1] == moves.num_remote, (counts, moves.num_remote)


def _corruption_is_caught(world: int, seed: int) -> None:
    """A byte flipped in flight (simulated: the receiver's fingerprint is off by one) fails verification."""
    from deepinfer_core.eplb import transfer

    rank = dist.get_rank()
    _, _, moves = _plans(world, seed)
    per = moves.slots_per_gpu
    weights = [torch.zeros(LAYERS, per, *SHAPE)]
    honest = transfer.fingerprint
    dst_slots = {(int(a), int(b)) for a, b, g in zip(moves.layer, moves.dst_slot % per, moves.dst_gpu) if g == rank}

    def tampered(ts: list[torch.Tensor]) -> int:
        # Called for the received slots after the transfer: pretend one arrived damaged.
        return honest(ts) + (1 if ts[0].data_ptr() in received_ptrs else 0)

    received_ptrs = {weights[0][a, b].data_ptr() for a, b in dst_slots}
    transfer.fingerprint = tampered
    try:
        with pytest.raises(RuntimeError, match="corrupted"):
            execute_moves(moves, weights, batch_size=7)
    finally:
        transfer.fingerprint = honest


def _worker(rank: int, world: int, port: int, seed: int, batch_size: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _migrate_and_check(world, seed, batch_size, None)
        if world == 4:
            # Two independent 2-GPU domains at once, in subgroups: group ranks differ from global ranks.
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            _migrate_and_check(2, seed + 1 + rank // 2, batch_size, pairs[rank // 2])
            _corruption_is_caught(world, seed)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world: int) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    for w, sd in [(world, seed), (2, seed + 1), (2, seed + 2)]:
        assert _plans(w, sd)[2].num_remote > 0, "the drift should force cross-GPU moves"
    # Small batches: several rounds of isend/irecv, sources overwritten in later batches.
    mp.spawn(_worker, args=(world, _free_port(), seed, 5), nprocs=world, join=True)


def test_moves_transfer_weights_exactly_4_ranks_and_2_rank_subgroups() -> None:
    _run(4)


@pytest.mark.slow
def test_moves_transfer_weights_exactly_2_ranks() -> None:
    _run(2)
