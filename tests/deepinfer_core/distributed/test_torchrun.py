"""2-rank gloo runs under ``torchrun --nproc-per-node 2`` (marked ``distributed``), against the
single-process engine in batch-invariant mode as the oracle.

Fresh prompts and sampling seeds each run. The prompts go round-robin to the two DP ranks (3 and 2
requests, rank 1's shorter) so rank 1 runs fewer forwards per step, then none at all: it must keep
joining the MoE all-to-alls with empty batches (its dummy forwards are counted) for rank 0 to finish.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.distributed.worker import TIMEOUT_S, engine_config

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(rng.randint(20, 110)))
        for _ in range(5)
    ]
    max_tokens = [
        rng.randint(6, 10),
        rng.randint(2, 4),
        rng.randint(6, 10),
        rng.randint(3, 5),
        rng.randint(6, 10),
    ]
    params = [
        {"temperature": 0.0 if i == 0 else 0.9, "seed": seed + i, "max_tokens": m, "ignore_eos": True}
        for i, m in enumerate(max_tokens)
    ]
    path = tmp_path_factory.mktemp("dist") / "case.json"
    path.write_text(json.dumps({"prompts": prompts, "params": params}))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(
            **{
                k: getattr(engine_config(), k)
                for k in ("model", "seed", "num_blocks", "max_num_seqs", "batch_invariant")
            }
        )
        ref = [
            list(o.token_ids)
            for o in llm.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
        ]
    finally:
        torch.set_num_threads(before)
    return {"seed": seed, "path": path, "ref": ref}


def _run(scenario: str, case: dict, tmp_path: Path, limit_s: float = 300) -> tuple[list[dict | None], float]:
    out = tmp_path / scenario
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [
                *_torchrun(),
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "0",
                str(WORKER),
                scenario,
                str(case["path"]),
                str(out),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=limit_s,
        )
    except subprocess.TimeoutExpired as e:  # a hang (or a badly overloaded machine): show what the ranks said
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(
            f"seed {case['seed']}: torchrun {scenario} still running after {limit_s}s:\n{err[-4000:]}"
        )
    wall = time.monotonic() - t0
    ranks = [
        json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
        for r in (0, 1)
    ]
    if scenario == "equal" and proc.returncode != 0:
        pytest.fail(f"seed {case['seed']}: torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    if ranks[0] is None:
        pytest.fail(f"seed {case['seed']}: rank 0 wrote no result:\n{proc.stderr[-4000:]}")
    shutil.copy(case["path"], out)
    (out / "stderr.txt").write_text(proc.stderr)
    return ranks, wall


def test_dp2_ep2_equals_single_process_with_and_without_replans(case: dict, tmp_path: Path) -> None:
    ranks, _ = _run("equal", case, tmp_path)
    ref, seed = case["ref"], case["seed"]
    for r, res in enumerate(ranks):
        assert res is not None
        assert [o["tokens"] for o in res["static"]] == ref, f"seed {seed}: rank {r}, fixed placement"
        assert [o["tokens"] for o in res["replan"]] == ref, f"seed {seed}: rank {r}, online EPLB re-plans"
        assert all(o["error"] is None for o in res["static"] + res["replan"])
        assert res["static_rows_remote"] > 0  # tokens really crossed to the other rank's experts
        # both ranks re-planned at the same steps, to the same moves (live / bytes sent are per rank)
        same = ("step", "remote", "lb_before", "lb_after")
        assert [[p[k] for k in same] for p in res["replans"]] == [
            [p[k] for k in same] for p in ranks[0]["replans"]
        ]
    assert ranks[1]["static_dummies"] > 0, "rank 1 never joined a collective with an empty batch"
    mid = [p for p in ranks[0]["replans"] if p["live"] > 0 and p["remote"] > 0]
    assert mid, (
        f"seed {seed}: no re-plan moved weights between ranks while requests were in flight: {ranks[0]['replans']}"
    )
    assert all(p["bytes"] > 0 for p in mid)
    assert all(p["lb_after"] <= p["lb_before"] + 1e-9 for p in ranks[0]["replans"])
    # staged moves: tokens still equal; some migration spread over several steps with requests in flight
    for r, res in enumerate(ranks):
        assert [o["tokens"] for o in res["staged"]] == ref, f"seed {seed}: rank {r}, staged weight moves"
    # P/D over torch.distributed: rank 0 prefilled and handed over, rank 1 decoded; first + rest == NORMAL
    for mode in ("full", "replay"):
        assert ranks[0]["pd"][mode] == [], f"seed {seed}: the PROMPT engine ended requests itself ({mode})"
        assert [o["tokens"] for o in ranks[1]["pd"][mode]] == ref, (
            f"seed {seed}: P/D ({mode}) != NORMAL engine"
        )
        assert all(o["error"] is None for o in ranks[1]["pd"][mode])
    # DP2 / EP2 PROMPT instance -> DP2 / EP2 COMPLETION instance (replay mode, hand-offs crossing ranks)
    for r, res in enumerate(ranks):
        assert [o["tokens"] for o in res["pd_dp"]] == ref, (
            f"seed {seed}: rank {r}, DP/EP P/D != NORMAL engine"
        )
        assert all(o["error"] is None for o in res["pd_dp"])
    staged = [
        p for p in ranks[0]["staged_replans"] if p["commit"] > p["step"] and p["batches"] > 1 and p["live"]
    ]
    assert staged, (
        f"seed {seed}: no staged migration spanned steps mid-generation: {ranks[0]['staged_replans']}"
    )


def test_killed_rank_fails_requests_then_smaller_group_replans(case: dict, tmp_path: Path) -> None:
    ranks, _ = _run("kill", case, tmp_path)
    res, seed = ranks[0], case["seed"]
    left = float((tmp_path / "kill" / "left.txt").read_text())
    assert res is not None and "failed_at" in res, f"seed {seed}: rank 0 did not notice: {res}"
    # a closed connection fails the next collective at once (0.02 s measured); the bound is the timeout
    assert res["failed_at"] - left < TIMEOUT_S, "failure noticed later than the collective timeout"
    failed = [o for o in res["outputs"] if o["error"]]
    assert {o["id"] for o in failed} == {"0", "2", "4"}
    assert all("distributed group failed" in o["error"] and "rank 0" in o["error"] for o in failed)
    # the restarted group (1 healthy rank): EP 1, placement re-planned on the old window, same tokens
    rs = res["restart"]
    assert rs["num_gpus"] == 1 and rs["slots"] == 8 + 1
    load, cnt = np.asarray(rs["load"]), np.asarray(rs["logcnt"])
    assert (cnt.sum(1) == 9).all()
    assert (cnt[np.arange(len(cnt)), load.argmax(1)] == 2).all(), (
        "the redundant slot must go to the hottest expert"
    )
    assert [o["tokens"] for o in rs["outputs"]] == [case["ref"][i] for i in rs["ids"]], f"seed {seed}"


def test_hung_rank_fails_requests_within_the_timeout(case: dict, tmp_path: Path) -> None:
    ranks, _ = _run("hang", case, tmp_path)
    res, seed = ranks[0], case["seed"]
    left = float((tmp_path / "hang" / "left.txt").read_text())
    assert res is not None and "failed_at" in res, f"seed {seed}: rank 0 did not notice: {res}"
    took = res["failed_at"] - left
    # not before the timeout (the peer is alive), and not much after it (slack for a loaded CI machine)
    assert TIMEOUT_S - 1 < took < TIMEOUT_S + 10, (
        f"failure after {took:.1f}s, collective timeout {TIMEOUT_S}s"
    )
    failed = [o for o in res["outputs"] if o["error"]]
    assert {o["id"] for o in failed} == {"0", "2", "4"}
    assert all("Timed out" in o["error"] or "timed out" in o["error"] for o in failed)
