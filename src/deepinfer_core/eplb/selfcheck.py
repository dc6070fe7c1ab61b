"""Multi-process check of weight migration: plan, drift, re-plan, move real tensors, compare to the oracle.

Runnable as a set-up check (``python -m deepinfer_core.eplb.selfcheck --world 4``) and used by the tests;
it lives in the package because spawned ranks must be able to import the worker. Every expert's weights
are a pure function of (layer, expert), so each rank can check what it received without communication.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.eplb import transfer
from deepinfer_core.eplb.migration import MovePlan, replan_with_migration
from deepinfer_core.eplb.stats import ExpertPlacement

LAYERS, EXPERTS, SHAPE = 3, 16, (4, 6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expert_tensor(layer: int, expert: int, k: int, device: str = "cpu") -> torch.Tensor:
    """Weights of (layer, expert), tensor k (k=0 float32 matrix, k=1 float64 vector): the oracle."""
    g = torch.Generator().manual_seed(layer * 100_003 + expert * 7 + k)
    t = torch.randn(
        SHAPE if k == 0 else SHAPE[:1], generator=g, dtype=torch.float32 if k == 0 else torch.float64
    )
    return t.to(device)


def plans(world: int, seed: int) -> tuple[np.ndarray, np.ndarray, MovePlan]:
    """(old phy2log, new phy2log, moves) for a strongly drifted load: counts and GPUs both change."""
    rng = np.random.default_rng(seed)
    reps = EXPERTS + 2 * world
    w0 = rng.integers(1, 1000, (LAYERS, EXPERTS))
    old = ExpertPlacement.plan(w0, reps, 1, 1, world)
    w1 = w0 * rng.lognormal(0.0, 1.0, w0.shape)
    plan = replan_with_migration(old, w1, tolerance=0.0, expert_bytes=1)
    return old.phy2log, plan.placement.phy2log, plan.moves


def _local_weights(table: np.ndarray, rank: int, world: int, device: str) -> list[torch.Tensor]:
    per = table.shape[1] // world
    mine = table[:, rank * per : (rank + 1) * per]
    return [
        torch.stack(
            [torch.stack([expert_tensor(ly, int(e), k, device) for e in mine[ly]]) for ly in range(LAYERS)]
        )
        for k in range(2)
    ]


def migrate_and_check(
    world: int, seed: int, batch_size: int, group: dist.ProcessGroup | None, device: str = "cpu"
) -> None:
    rank = dist.get_rank(group)
    old, new, moves = plans(world, seed)
    weights = _local_weights(old, rank, world, device)
    report = transfer.execute_moves(moves, weights, group=group, batch_size=batch_size)
    expect = _local_weights(new, rank, world, device)
    for k in range(2):
        if not torch.equal(weights[k], expect[k]):
            raise AssertionError(f"rank {rank}: tensor {k} differs from the new placement's weights")
    counts = torch.tensor([report.sent, report.received], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    if not (int(counts[0]) == int(counts[1]) == moves.num_remote):
        raise AssertionError(f"sent/received {counts.tolist()} != {moves.num_remote} cross-GPU moves")


def corruption_is_caught(world: int, seed: int, device: str = "cpu") -> None:
    """Pretend every received slot arrived damaged (its fingerprint off by one): verification must fail."""
    rank = dist.get_rank()
    _, _, moves = plans(world, seed)
    per = moves.slots_per_gpu
    weights = [torch.zeros(LAYERS, per, *SHAPE, device=device)]
    honest = transfer.fingerprint
    received = {
        weights[0][int(a), int(b) % per].data_ptr()
        for a, b, g in zip(moves.layer, moves.dst_slot, moves.dst_gpu)
        if g == rank
    }

    def tampered(ts: Sequence[torch.Tensor]) -> int:
        return honest(ts) + (1 if ts[0].data_ptr() in received else 0)

    transfer.fingerprint = tampered  # type: ignore[assignment]  # patched for the check, restored below
    try:
        transfer.execute_moves(moves, weights, batch_size=7)
    except RuntimeError as e:
        if "corrupted" not in str(e):
            raise
    else:
        raise AssertionError("a corrupted transfer passed verification")
    finally:
        transfer.fingerprint = honest


def _worker(rank: int, world: int, port: int, seed: int, batch_size: int, backend: str) -> None:
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        migrate_and_check(world, seed, batch_size, None, device)
        if world == 4:
            # Two independent 2-GPU domains at once, in subgroups: group ranks differ from global ranks.
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            migrate_and_check(2, seed + 1 + rank // 2, batch_size, pairs[rank // 2], device)
        corruption_is_caught(world, seed, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, seed: int | None = None, batch_size: int = 5, backend: str = "gloo") -> None:
    """Spawn ``world`` ranks and run the checks; raises if any rank fails. Small batches on purpose:
    several rounds of isend/irecv, with sources overwritten in later batches."""
    if seed is None:
        seed = int(np.random.default_rng().integers(1 << 30))
    for w, sd in [(world, seed), (2, seed + 1), (2, seed + 2)]:
        if plans(w, sd)[2].num_remote == 0:
            raise AssertionError("the drift should force cross-GPU moves")
    mp.spawn(_worker, args=(world, free_port(), seed, batch_size, backend), nprocs=world, join=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    run(args.world, backend=args.backend)
    print(
        f"eplb selfcheck: {args.world} ranks over {args.backend}: moves reproduce the plan, corruption caught"
    )
