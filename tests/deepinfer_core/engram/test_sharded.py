"""ShardedEngramTable over 2 and 4 gloo processes equals a local lookup (see _dist_worker.run)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from . import _dist_worker


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_fetch_equals_local(world: int, tmp_path) -> None:
    # forkserver: the server imports torch once and forks each rank from it (spawn would import torch in
    # every rank, several seconds each on a busy 2-core CI box); fork is unsafe after torch's thread pools.
    mp.set_forkserver_preload(["torch", "torch.distributed", "deepinfer_core.engram"])
    ctx = mp.start_processes(
        _dist_worker.run, args=(world, str(tmp_path / "init")), nprocs=world, join=True, start_method="forkserver"
    )
    assert ctx is None
