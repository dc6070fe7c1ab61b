"""torchrun worker of the distributed tests: ``torchrun --nproc-per-node 2 worker.py SCENARIO CASE.json OUT_DIR``.

CASE.json holds the prompts and sampling parameters (drawn fresh by the test); each rank writes
OUT_DIR/rank<r>.json. Scenarios:

- ``equal``: DP2 / EP2 instance, batch-invariant; once with a fixed placement, once with online EPLB
  re-planning (weights migrated between two steps) every few steps from a deliberately bad first
  placement, once with the moves staged over the following steps; then P/D: rank 0 a PROMPT engine
  handing every request over torch.distributed to rank 1, a COMPLETION engine;
- ``kill``: rank 1 leaves abruptly mid-generation; rank 0 must fail its requests, then restarts alone
  (EP 1, placement re-planned on its window) and serves them again;
- ``hang``: rank 1 stops stepping (alive, silent); rank 0 must fail its requests after the timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.distributed import (
    DistConfig,
    DistributedEngine,
    init_groups,
    plan_placement,
    restart_ep_size,
    shutdown,
)
from deepinfer_core.distributed.pd import CompletionEngine, PromptEngine, recv_handoff, send_handoff
from deepinfer_core.engine import EngineConfig
from deepinfer_core.eplb import EPLBConfig
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import EngineType

TIMEOUT_S = 5.0
EQUAL_TIMEOUT_S = 60.0


def engine_config() -> EngineConfig:
    return EngineConfig(model="tiny-random", seed=7, num_blocks=128, max_num_seqs=8, batch_invariant=True)


def outputs_json(outs: list) -> list[dict]:
    return [
        {"id": o.request_id, "tokens": list(o.token_ids), "error": o.error, "reason": o.finish_reason}
        for o in outs
    ]


def load_case(path: str) -> tuple[list, list[SamplingParams]]:
    case = json.loads(Path(path).read_text())
    return case["prompts"], [SamplingParams(**p) for p in case["params"]]


def scenario_equal(groups, prompts, params) -> dict:
    res: dict = {}
    eng = DistributedEngine(groups, engine_config(), DistConfig(online_eplb=False))
    res["static"] = outputs_json(eng.generate(prompts, params))
    res["static_rows_remote"] = eng.ep.rows_remote
    res["static_dummies"] = eng.sync.dummies
    # a first placement planned for a random load, re-planned every 3 steps on a 2-step window, tolerance 0
    mc = eng.engine.model_config
    bad = np.random.default_rng(0).exponential(size=(mc.num_hidden_layers, mc.n_routed_experts)) ** 3
    cfg = EPLBConfig(window_steps=2, replan_interval=3, redundant_per_gpu=1)
    eng2 = DistributedEngine(
        groups,
        engine_config(),
        DistConfig(
            eplb=cfg,
            tolerance=0.0,
            initial_placement=plan_placement(
                mc.num_hidden_layers, mc.n_routed_experts, groups.group_size, cfg, bad
            ),
        ),
    )
    res["replan"] = outputs_json(eng2.generate(prompts, params))
    res["replans"] = _replans(eng2)
    res["steps"] = eng2.steps
    # the same, the moves spread over the following steps (8 a step) while the old placement serves
    cfg3 = EPLBConfig(window_steps=2, replan_interval=5, redundant_per_gpu=1)
    eng3 = DistributedEngine(
        groups,
        engine_config(),
        DistConfig(
            eplb=cfg3,
            tolerance=0.0,
            moves_per_step=8,
            initial_placement=plan_placement(
                mc.num_hidden_layers, mc.n_routed_experts, groups.group_size, cfg3, bad
            ),
        ),
    )
    res["staged"] = outputs_json(eng3.generate(prompts, params))
    res["staged_replans"] = _replans(eng3)
    res["pd"] = scenario_pd(groups, prompts, params)
    res["pd_dp"] = scenario_pd_dp(groups, prompts, params)
    return res


def scenario_pd_dp(groups, prompts, params) -> list[dict]:
    """A DP2 / EP2 PROMPT instance (replay mode), then a DP2 / EP2 COMPLETION instance on the same ranks;
    rank r's hand-offs go to rank 1 - r over the world group. Every rank returns all outputs in order."""
    pe = DistributedEngine(
        groups,
        engine_config(),
        DistConfig(engine_type=EngineType.PROMPT, pd_mode="replay", online_eplb=False),
    )
    early = _serve_local(pe, prompts, params, groups)
    ce = DistributedEngine(
        groups, engine_config(), DistConfig(engine_type=EngineType.COMPLETION, online_eplb=False)
    )
    other = 1 - groups.rank
    mine = pe.handoffs
    for r in (0, 1):  # rank 0 sends first, then rank 1 (point to point, no deadlock)
        if groups.rank == r:
            dist.send_object_list([len(mine)], dst=other)
            for h in mine:
                send_handoff(h, dst=other)
        else:
            box: list = [None]
            dist.recv_object_list(box, src=other)
            for _ in range(box[0]):
                ce.add_handoff(recv_handoff(src=other))
    done = list(early)
    while ce.has_unfinished():
        done += [o for o in ce.step() if o.finished]
    parts: list = [None, None]
    dist.all_gather_object(parts, outputs_json(done))
    return sorted((o for part in parts for o in part), key=lambda o: int(o["id"]))


def _serve_local(eng: DistributedEngine, prompts, params, groups) -> list:
    for i in range(len(prompts)):
        if i % groups.group_size == groups.group_rank:
            eng.add_request(str(i), prompts[i], params[i])
    out = []
    while eng.has_unfinished():
        out += [o for o in eng.step() if o.finished]
    return out


def scenario_pd(groups, prompts, params) -> dict:
    """Rank 0 a PROMPT engine, rank 1 a COMPLETION engine; hand-offs over torch.distributed (world group),
    the full state block, then the persisted half (replay mode, exact)."""
    return {mode: _pd(groups, prompts, params, mode) for mode in ("full", "replay")}


def _pd(groups, prompts, params, mode: str) -> list[dict] | None:
    if groups.rank == 0:
        pe = PromptEngine(engine_config(), mode=mode)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            pe.add_request(str(i), p, sp)
        early, sent = [], 0
        while pe.has_unfinished():
            outs, ready = pe.step()
            early += outs
            for h in ready:
                dist.send_object_list([h.request_id], dst=1)
                send_handoff(h, dst=1)
                sent += 1
        dist.send_object_list([None], dst=1)
        return outputs_json(early)
    ce = CompletionEngine(engine_config())
    box: list = [None]
    while True:
        dist.recv_object_list(box, src=0)
        if box[0] is None:
            break
        ce.add_handoff(recv_handoff(src=0))
    done = []
    while ce.has_unfinished():
        done += [o for o in ce.step() if o.finished]
    return sorted(outputs_json(done), key=lambda o: int(o["id"]))


def _replans(eng: DistributedEngine) -> list[dict]:
    return [
        {
            "step": r.step,
            "live": r.live_requests,
            "remote": r.remote_moves,
            "bytes": r.bytes_sent,
            "lb_before": r.moe_lb_before,
            "lb_after": r.moe_lb_after,
            "commit": r.commit_step,
            "batches": r.batches,
        }
        for r in eng.replans
    ]


def _served_alone(groups, prompts, params, load):
    # the restarted, smaller group (one rank here): EP size and placement re-planned on the old window
    eng = DistributedEngine(
        groups, engine_config(), DistConfig(online_eplb=False, initial_load=np.asarray(load))
    )
    outs = eng.generate(prompts, params, scatter=False)
    return {
        "outputs": outputs_json(outs),
        "num_gpus": eng.placement.num_gpus,
        "load": np.asarray(load).tolist(),
        "slots": eng.placement.num_replicas,
        "logcnt": eng.placement.logcnt.tolist(),
    }


def scenario_fail(groups, prompts, params, mode: str, out_dir: Path) -> dict:
    eng = DistributedEngine(groups, engine_config(), DistConfig(online_eplb=False))
    dist.barrier()  # world group (long timeout): both engines built before the short-timeout steps
    mine = [i for i in range(len(prompts)) if i % groups.group_size == groups.group_rank]
    for i in mine:
        eng.add_request(str(i), prompts[i], params[i])
    res: dict = {"outputs": []}
    step = 0
    while eng.has_unfinished():
        if groups.group_rank == 1 and step == 4:
            (out_dir / "left.txt").write_text(str(time.time()))
            if mode == "kill":
                os._exit(0)  # abrupt: no teardown, sockets close with the process
            while not (out_dir / "rank0.json").exists():  # hang: alive but silent
                time.sleep(0.1)
            return {"hung": True}
        t0 = time.time()
        got = [o for o in eng.step() if o.finished]
        res["outputs"] += outputs_json(got)
        if eng.failed is not None:
            res["failed_at"] = time.time()
            res["step_s"] = time.time() - t0
            res["error"] = eng.failed
            break
        step += 1
    res["steps"] = step
    if groups.group_rank == 0 and eng.failed is not None and mode == "kill":
        healthy = 1
        size = restart_ep_size(healthy, eng.engine.model_config.n_routed_experts)
        failed = [o for o in res["outputs"] if o["error"]]
        ids = [int(o["id"]) for o in failed]
        # in this process: the old group is torn down, a new one of the healthy size starts
        # (a file store: under torchrun a tcp:// rendezvous would go to the agent's store)
        alone = init_groups(
            init_method=f"file://{out_dir / 'restart.store'}", world_size=size, rank=0, timeout_s=TIMEOUT_S
        )
        res["restart"] = _served_alone(
            alone, [prompts[i] for i in ids], [params[i] for i in ids], eng.window_load()
        )
        shutdown()
        res["restart"]["ids"] = ids
    return res


def main() -> None:
    scenario, case_path, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    prompts, params = load_case(case_path)
    # the world group waits long (process start and engine builds differ between ranks on a loaded CI
    # machine); the instance's DP / EP / engram groups, which serve the steps, time out after TIMEOUT_S
    # (the equal scenario: EQUAL_TIMEOUT_S, it tests no failure)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    groups = init_groups(timeout_s=EQUAL_TIMEOUT_S if scenario == "equal" else TIMEOUT_S)
    if scenario == "equal":
        res = scenario_equal(groups, prompts, params)
    else:
        res = scenario_fail(groups, prompts, params, scenario, out_dir)
    (out_dir / f"rank{groups.rank}.json").write_text(json.dumps(res))
    if scenario == "equal":
        shutdown()


if __name__ == "__main__":
    main()
