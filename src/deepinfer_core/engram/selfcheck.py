"""Self-check of ShardedEngramTable over a real process group: every rank compares its sharded fetches
with a local lookup of the same table (random ids with duplicates, ids owned by one rank only, empty
requests, int32 ids, uneven blocks, bf16 and fp8) and checks that an out-of-range id on one rank fails
there only. Used by the multi-process tests; also a quick check of a new cluster set-up:

    python -m deepinfer_core.engram.selfcheck --world 4            # gloo processes on this machine

Lives in the package (not under tests/) so spawned ranks can import it whatever pytest's import mode.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _values(num_rows: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + num_rows)  # same table on every rank
    return torch.randn(num_rows, dim, generator=g) * torch.exp2(
        torch.randint(-6, 6, (num_rows, 1), generator=g).float()
    )


def run(rank: int, world: int, init_file: str, backend: str = "gloo") -> None:
    """One rank's part (the target of ``torch.multiprocessing.start_processes``); raises on a mismatch."""
    from deepinfer_core.engram import LocalEngramTable, ShardedEngramTable, shard_range

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        for fmt in ("bf16", "fp8"):
            for num_rows in (world * 5 + 3, 97):  # uneven blocks: the last rank owns fewer rows
                values = _values(num_rows, 64)
                table = ShardedEngramTable.from_full(values, fmt)
                local = LocalEngramTable.from_values(values, fmt)
                assert table.num_rows == num_rows and table.row_dim == 64
                last_lo, last_hi = shard_range(num_rows, world, world - 1)
                first_lo, first_hi = shard_range(num_rows, world, 0)
                cases = [
                    torch.randint(0, num_rows, (13, 4), generator=g),  # random, with duplicates
                    torch.randint(last_lo, last_hi, (9,), generator=g),  # owned by the last rank only
                    torch.randint(first_lo, first_hi, (2, 3), generator=g),  # owned by rank 0 only
                    torch.full((6,), num_rows - 1),  # one id repeated
                    # some ranks ask for nothing at all
                    torch.empty(0, dtype=torch.int64)
                    if rank % 2
                    else torch.randint(0, num_rows, (5,), generator=g),
                    torch.empty(0, 3, dtype=torch.int64),  # nobody asks for anything
                    torch.randint(0, num_rows, (4, 2), generator=g).to(torch.int32),  # int32 ids
                ]
                for ids in cases:
                    got = table.fetch(ids)
                    assert got.shape == (*ids.shape, 64), (rank, fmt, got.shape)
                    assert torch.equal(got, local.fetch(ids)), (rank, fmt, num_rows, ids)
        # a bad fetch on rank 0 fails there only; the other ranks' fetch in the same collective succeeds
        values = _values(50, 64)
        table = ShardedEngramTable.from_full(values, "bf16")
        local = LocalEngramTable.from_values(values, "bf16")
        ids = torch.tensor([1, 50 if rank == 0 else 49, 3])
        if rank == 0:
            try:
                table.fetch(ids)
            except IndexError as e:
                assert "row_ids: id 50 is outside [0, num_rows=50)" in str(e), str(e)
            else:
                raise AssertionError("out-of-range id did not raise")
        else:
            assert torch.equal(table.fetch(ids), local.fetch(ids))
        ok = torch.tensor([rank, 0, 49])  # the group still works afterwards
        assert torch.equal(table.fetch(ok), local.fetch(ok))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(world: int, init_file: str, backend: str = "gloo") -> None:
    """Run the check on ``world`` local processes, forked from a forkserver that imported torch once
    (spawning would import torch in every rank; plain fork is unsafe after torch's thread pools start)."""
    mp.set_forkserver_preload(["torch", "torch.distributed", "deepinfer_core.engram"])
    mp.start_processes(
        run, args=(world, init_file, backend), nprocs=world, join=True, start_method="forkserver"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="number of local processes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        spawn(args.world, os.path.join(d, "init"))
    print(f"engram selfcheck: sharded fetch equals local lookup on {args.world} gloo processes")


if __name__ == "__main__":
    main()
