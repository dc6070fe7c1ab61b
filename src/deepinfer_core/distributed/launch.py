"""Starting an N-rank instance: from Python (:func:`spawn`) or under ``torchrun`` (:func:`init_groups`).

From Python::

    from deepinfer_core.distributed import spawn

    def work(groups, prompts):          # runs on every rank, groups = ParallelGroups
        eng = DistributedEngine(groups, EngineConfig(batch_invariant=True))
        return eng.generate(prompts)     # every rank gets all outputs, in order

    outputs = spawn(work, 2, args=(prompts,))   # list: rank 0's return value first

Under torchrun each process calls ``init_groups()`` itself (examples/distributed_generate.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from deepinfer_core.distributed.groups import init_groups, shutdown

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on localhost right now (the rendezvous of :func:`spawn`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out_dir: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    group_size: int | None,
    backend: str | None,
    timeout_s: float,
    threads: int,
) -> None:
    import torch

    torch.set_num_threads(threads)
    res: tuple[str, Any]
    try:
        groups = init_groups(
            group_size,
            backend=backend,
            timeout_s=timeout_s,
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=world,
            rank=rank,
        )
        res = ("ok", fn(groups, *args, **kwargs))
    except BaseException as e:  # reported to the parent, which raises it
        res = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        shutdown()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(res, f)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    group_size: int | None = None,
    backend: str | None = "gloo",
    timeout_s: float = 60.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(groups, *args, **kwargs)`` on ``nprocs`` fresh processes forming one world; return their
    results in rank order. ``fn`` and its arguments must be picklable (a module-level function). A rank
    that raises makes this raise ``RuntimeError`` with that rank's traceback."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: must be an int >= 1")
    with tempfile.TemporaryDirectory(prefix="deepinfer-spawn-") as tmp:
        mp.start_processes(
            _worker,
            args=(
                fn,
                nprocs,
                free_port(),
                tmp,
                tuple(args),
                dict(kwargs or {}),
                group_size,
                backend,
                timeout_s,
                threads,
            ),
            nprocs=nprocs,
            join=True,
            start_method="spawn",
        )
        results = []
        for r in range(nprocs):
            path = Path(tmp) / f"rank{r}.pkl"
            if not path.exists():
                raise RuntimeError(f"spawn: rank {r} exited without a result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"spawn: {value}")
            results.append(value)
    return results


def torchrun_env() -> dict[str, int]:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them (raises when not under torchrun)."""
    try:
        return {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    except KeyError as e:
        raise RuntimeError(f"not under torchrun: {e.args[0]} is unset") from None
