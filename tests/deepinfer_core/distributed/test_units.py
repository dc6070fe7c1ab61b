"""Single-process parts of ``deepinfer_core.distributed`` (restart sizing, placement planning, config
errors), and the EP MoE layer against the full MoE on two spawned ranks (marked ``distributed``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.distributed import DistConfig, init_groups, plan_placement, restart_ep_size, spawn
from deepinfer_core.eplb import DECODE, PREFILL, EPLBConfig
from deepinfer_core.scheduler import EngineType


@given(st.integers(1, 200), st.integers(1, 512))
def test_restart_ep_size_is_the_largest_divisor_that_fits(healthy: int, experts: int) -> None:
    got = restart_ep_size(healthy, experts)
    assert 1 <= got <= healthy and experts % got == 0
    assert not any(experts % g == 0 for g in range(got + 1, healthy + 1))  # brute force: none larger fits


def test_restart_ep_size_examples_and_errors() -> None:
    assert restart_ep_size(64, 384) == 64
    assert restart_ep_size(63, 384) == 48  # one GPU lost at EP64: 384 experts need a divisor
    assert restart_ep_size(3, 8) == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="healthy_ranks"):
            restart_ep_size(bad, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_experts"):
        restart_ep_size(4, 0)


def test_plan_placement_follows_the_load() -> None:
    rng = np.random.default_rng()
    layers, experts, gpus = 3, 16, 4
    load = rng.exponential(size=(layers, experts)) ** 2
    cfg = EPLBConfig(window_steps=10, replan_interval=10, redundant_per_gpu=2)
    p = plan_placement(layers, experts, gpus, cfg, load)
    assert (p.num_layers, p.num_experts, p.num_gpus, p.num_replicas) == (
        layers,
        experts,
        gpus,
        experts + 2 * gpus,
    )
    assert (p.logcnt.sum(1) == experts + 2 * gpus).all() and (p.logcnt >= 1).all()
    # a hotter expert never has fewer replicas than a colder one of the same layer (greedy replication)
    for lay in range(layers):
        order = np.argsort(-load[lay])
        assert (np.diff(p.logcnt[lay][order]) <= 0).all()
    u = plan_placement(layers, experts, gpus, cfg)
    assert (np.ptp(u.gpu_loads(np.ones((layers, experts))), axis=1) < 1e-9).all()  # uniform: every GPU equal
    with pytest.raises(ValueError, match="load"):
        plan_placement(layers, experts, gpus, cfg, load[:, :-1])
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        plan_placement(layers, experts, 3, cfg)


def test_dist_config_errors_name_the_field() -> None:
    assert DistConfig().eplb_config() is DECODE  # NORMAL engine: the decode window and interval
    assert DistConfig(eplb=PREFILL).eplb_config() is PREFILL
    assert DistConfig(engine_type=EngineType.PROMPT).eplb_config() is PREFILL  # a prefill instance
    for kw, field in (
        (dict(tolerance=1.0), "tolerance"),
        (dict(move_batch_size=0), "move_batch_size"),
        (dict(eplb=3), "eplb"),
        (dict(engine_type=1), "engine_type"),
        (dict(pd_mode="x"), "pd_mode"),
    ):
        with pytest.raises(ValueError, match=f"DistConfig.{field}"):
            DistConfig(**kw)  # type: ignore[arg-type]


def test_init_groups_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="timeout_s"):
        init_groups(timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        init_groups(backend="mpi")
    with pytest.raises(ValueError, match="init_method"):
        init_groups(init_method="tcp://127.0.0.1:1", backend="gloo")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_groups(backend="gloo")
    assert not dist.is_initialized()


def _ep_layer_vs_moe(groups, seed: int, trials: int) -> tuple[list[str], int, int, float]:
    """EP MoE layer on random placements, replica choices, token counts (0 included: the idle rank) and
    after a re-plan with weight moves, against the model's own MoE with every expert (float64)."""
    import copy

    import torch
    from torch import nn

    from deepinfer_core.distributed import ExpertParallel
    from deepinfer_core.distributed.placement import replan_ep
    from deepinfer_core.model.config import tiny_config
    from deepinfer_core.model.layers.moe import MoE

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)  # the same draws on every rank (placements, loads)
    cfg = tiny_config()
    bad: list[str] = []
    moved = 0
    for t in range(trials):

        class Blk(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer_id = 0
                self.ffn = MoE(cfg)

        class Stack(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.ModuleList([Blk()])

        model = Stack()
        model.layers[0].ffn.reset_parameters(torch.Generator().manual_seed(seed + t))
        model = model.double()
        ref = copy.deepcopy(model.layers[0].ffn)
        ecfg = EPLBConfig(window_steps=1, replan_interval=1, redundant_per_gpu=int(rng.integers(0, 3)))
        load = rng.exponential(size=(1, cfg.n_routed_experts)) ** 2
        choice = "rank" if t % 2 == 0 else "token"
        ep = ExpertParallel(
            model,
            groups.ep,
            plan_placement(1, cfg.n_routed_experts, groups.group_size, ecfg, load),
            replica_choice=choice,
        )
        for phase in ("first", "after re-plan"):
            n = int(rng.integers(0, 40, size=groups.group_size)[groups.group_rank])
            x = torch.randn(
                n,
                cfg.hidden_size,
                generator=torch.Generator().manual_seed(seed * 7 + t * 13 + groups.rank),
                dtype=torch.float64,
            )
            if n:
                out, counts = model.layers[0].ffn(x)
                want, wc = ref(x)
                if not torch.equal(counts, wc):
                    bad.append(f"trial {t} {phase}: counts differ")
                # "rank": the same rows in the same matmuls as the reference, bit for bit; "token" splits them
                ok = (
                    torch.equal(out, want)
                    if choice == "rank"
                    else torch.allclose(out, want, rtol=1e-12, atol=1e-12)
                )
                if not ok:
                    bad.append(f"trial {t} {phase} ({choice}): max diff {float((out - want).abs().max())}")
            ep.drain()
            if phase == "first":
                new_load = rng.integers(0, 50, size=(1, cfg.n_routed_experts))
                plan, _, _ = replan_ep(
                    ep,
                    new_load if groups.rank == 0 else np.zeros_like(new_load),
                    groups.ep,
                    groups.device,
                    tolerance=0.0,
                )
                moved += plan.moves.num_remote
    return bad, moved, groups.group_rank, groups.timeout_s


@pytest.mark.distributed
def test_ep_layer_equals_the_full_moe_over_placements_and_replans() -> None:
    seed = int(np.random.default_rng().integers(2**31))
    # (also spawn(): results in rank order, the timeout reaches the groups; a rank that raises makes
    # spawn raise with its traceback, checked by hand)
    res = spawn(_ep_layer_vs_moe, 2, args=(seed, 6), timeout_s=30)
    assert [r[2:] for r in res] == [(0, 30.0), (1, 30.0)]
    assert [r[0] for r in res] == [[], []], f"seed {seed}: {res}"
    assert res[0][1] == res[1][1] > 0, f"seed {seed}: the re-plans moved no expert between ranks"
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_ep_layer_vs_moe, 0)


@pytest.mark.distributed
def test_example_distributed_generate_spawned() -> None:
    # examples/distributed_generate.py as a user runs it: spawn() starts 2 ranks, tokens checked against
    # the single-process engine by the script itself
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    r = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "distributed_generate.py"),
            "--nproc",
            "2",
            "--quick",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "tokens equal to the single-process engine: True" in r.stdout
    assert "token-expert rows sent to the other rank" in r.stdout


_PREFIX_CFG = dict(seed=7, num_blocks=128, max_num_seqs=8, batch_invariant=True)


def _prefix_rounds(
    groups, rounds: list[list[str]], params: list[list[object]]
) -> tuple[list[list[tuple[int, ...]]], tuple, int]:
    from deepinfer_core.distributed import DistributedEngine
    from deepinfer_core.engine import EngineConfig

    eng = DistributedEngine(groups, EngineConfig(**_PREFIX_CFG), DistConfig())
    got = [[o.token_ids for o in eng.generate(r, p)] for r, p in zip(rounds, params)]
    prefix = getattr(eng.engine, "prefix", None)
    st = prefix.stats if prefix is not None else None
    return (
        got,
        ((st.hits, st.encoder_replays, st.host_restores) if st is not None else None),
        eng.sync.dummies,
    )


@pytest.mark.distributed
def test_dp_engine_with_prefix_hits_equals_single_process() -> None:
    # the engine's prefix cache runs extra (encoder-only) forwards on a hit: they must join the lock-step
    # rounds like any other forward (DistributedEngine points the cache at its executor proxy)
    import random

    from deepinfer_core.engine import LLM
    from deepinfer_core.sampling_params import SamplingParams

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    a = "".join(rng.choice("abcdefghij klmnop") for _ in range(120))
    rounds = [[a, a[:60] + "zz"], [a + " more", a[:100] + " and so", "other " * 8]]
    sp = SamplingParams(temperature=0.7, seed=seed % 1000, max_tokens=5, ignore_eos=True)
    # rank 0 serves items 0 and 2 of the second round: its item 2 outlives rank 1's only request, so rank 1
    # joins rank 0's last forwards with empty batches (batch-invariant mode batches a step: one forward each)
    longer = SamplingParams(temperature=0.7, seed=seed % 1000, max_tokens=9, ignore_eos=True)
    params = [[sp, sp], [sp, sp, longer]]
    res = spawn(_prefix_rounds, 2, args=(rounds, params), timeout_s=60)
    llm = LLM(**_PREFIX_CFG)
    want = [[o.token_ids for o in llm.generate(r, p, use_tqdm=False)] for r, p in zip(rounds, params)]
    for rank, (got, stats, _) in enumerate(res):
        assert got == want, f"seed {seed}: rank {rank}"
        assert stats is None or stats[0] > 0, (
            f"seed {seed}: rank {rank} had no prefix hit (the test needs one)"
        )
    # an encoder replay (the executor's replay_encoder, not execute) happened on some rank: a[:100] hits
    # a's blocks at 96, where no rings were kept
    assert res[0][1] is None or res[0][1][1] + res[1][1][1] > 0, f"seed {seed}: {[r[1] for r in res]}"
    assert res[1][2] > 0  # rank 1 (fewer requests) joined rank 0's forwards with empty batches
