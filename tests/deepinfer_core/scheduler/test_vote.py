"""Step-type votes: the local vote, and the all-reduce vote across 2 gloo processes."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import DistributedVote, LocalVote, Request, Scheduler, SchedulerConfig, StepType


def test_local_vote_is_the_rank_itself() -> None:
    for p, d in itertools.product([False, True], repeat=2):
        assert LocalVote().decide(p, d) == (p, p, d)


def test_distributed_vote_needs_init() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="initialised"):
        DistributedVote()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        vote = DistributedVote()
        # Every combination of wishes across the two ranks, checked against the truth table.
        answers = []
        for p0, d0, p1, d1 in itertools.product([False, True], repeat=4):
            mine = (p0, d0) if rank == 0 else (p1, d1)
            answers.append(vote.decide(*mine))
        # A real group: both ranks decode; only rank 0 gets a prompt; both must switch together.
        cfg = SchedulerConfig(max_model_len=1024, prefill_attempt_interval=1, prefill_any_attempt_interval=4)
        s = Scheduler(PagedKVPool(200, 4), cfg, vote=vote)
        s.add_request(Request(f"long{rank}", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
        types = []
        for t in range(12):
            if rank == 0 and t == 3:
                s.add_request(Request("lone", [4, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True)))
            plan = s.schedule()
            types.append(int(plan.step_type))
            s.update(plan, np.full(plan.num_rows, 7))
        flat = [int(x) for a in answers for x in a]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"answers": flat, "types": types}))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_distributed_vote_two_gloo_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks unpickle _worker by module name ("scheduler.test_vote"): make its package importable
    # in the children whatever sys.path pytest set up in this process.
    pkg_parent = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([pkg_parent, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(pkg_parent)
    mp.start_processes(
        _worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="forkserver",
    )
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    want = []
    for p0, d0, p1, d1 in itertools.product([False, True], repeat=4):
        want += [int(p0 and p1), int(p0 or p1), int(d0 or d1)]
    assert r0["answers"] == want and r1["answers"] == want
    types0, types1 = r0["types"], r1["types"]
    assert types0 == types1  # one step type per step across the group
    # Both ranks prefill their first request, decode, then rank 0's lone prompt arrives at step 3
    # and the group switches to prefill once 4 decode steps have passed since the last prefill.
    p, d = int(StepType.PREFILL), int(StepType.DECODE)
    assert types0[:6] == [p, d, d, d, d, p]
