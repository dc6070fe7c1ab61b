"""Engram tables sharded over 2 gloo processes: the executor's logits equal the cache-free oracle's
(which reads the whole local table), with different sequences on the two ranks (so each fetch asks the
other rank for rows it does not hold)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

TOL = 1e-9


def _rank(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    from deepinfer_core.model.config import tiny_config
    from deepinfer_core.model.executor import ModelExecutor
    from deepinfer_core.model.model import DeepSeekV41

    from .session import Session

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        m = DeepSeekV41.from_config(tiny_config(), seed=1234, dtype=torch.float64)
        s = Session(m)
        s.ex = ModelExecutor(
            m, s.ex.num_blocks, s.ex.block_size, s.ex.num_slots, quantize=False, engram_placement="sharded"
        )
        t = s.ex.engram_tables[1]
        assert type(t).__name__ == "ShardedEngramTable" and t.data.shape[0] < t.num_rows
        seq = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(100 + rank))
        got = s.run(0, seq, [37, 1, 1, 21])  # same step count on both ranks: every fetch is collective
        want = m.forward_full(seq)[0]
        err = (got - want).abs().max().item()
        assert err < TOL, f"rank {rank}: max |dlogit| {err}"
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_sharded_engram_tables_over_two_ranks() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(2, os.path.join(d, "init")), nprocs=2, join=True)
