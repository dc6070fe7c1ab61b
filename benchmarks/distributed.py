"""Distributed benchmark: a 4-rank gloo EP group on CPU, MoE layers only, over a drifting routing load.

Every rank routes its own tokens through the real EP path (:class:`deepinfer_core.distributed.ExpertParallel`:
replica choice, all-to-all dispatch, per-(source, slot) expert matmuls, all-to-all combine). The load
drifts: each layer's selection bias rotates between two random popularity profiles over the run, so the
hot experts change. Three EP groups run side by side in the same processes, step for step on the same
tokens: ``static`` keeps its first (uniform-load) placement, ``online`` (and ``online_token``, replicas
round robin per token instead of by source rank) records per-expert counts into a
window and re-plans with the migration-aware planner every ``replan`` steps, moving weights over the
group. Emitted, one JSON line each:

- ``moe_lb``: sum over layers of the slowest rank's computed rows / the mean rank's (what each layer
  waits for), from the rows each rank actually computed, both placements; and their ratio;
- ``a2a_share``: all-to-all seconds / MoE seconds per rank (gloo over loopback, 4 processes on this
  machine's cores, so it includes waiting for the slowest rank);
- ``replan_s`` / ``moved_bytes``: per re-plan, the online group's plan + weight move time and bytes;
- ``pd_*`` (one process, tiny model): P/D hand-off package bytes per mode (full state block; replay:
  blocks before the hit + encoder rings), the COMPLETION side's first step (load / rebuild + one decode)
  over the PROMPT side's prefill of the same prompt, replayed tokens, and whether the tokens equal a
  NORMAL engine's.

Usage: flock /tmp/heavy.lock python benchmarks/distributed.py [--quick] [--plot]
The intervals are scaled down (window 20 / re-plan every 50 steps instead of the seeds' 1,000 / 10,000):
what is measured is the mechanism on a load that drifts within the run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from _common import emit, log, out_path, parser
from deepinfer_core.distributed import ExpertParallel, ParallelGroups, plan_placement, spawn
from deepinfer_core.distributed.placement import replan_ep
from deepinfer_core.eplb import EPLBConfig
from deepinfer_core.eplb.stats import ExpertLoadWindow
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.layers.moe import MoE

BENCH = "distributed"
# static: the first (uniform-load) placement throughout; online: re-planned, replica by source rank (the
# batch-invariant choice); online_token: re-planned, replicas round robin per token
NAMES = ("static", "online", "online_token")


class _Block(nn.Module):
    def __init__(self, cfg: Any, i: int) -> None:
        super().__init__()
        self.layer_id = i
        self.ffn = MoE(cfg)


class _Stack(nn.Module):
    """MoE layers only (the part EP changes), the tiny config's 8 layers: a residual stream through them."""

    def __init__(self, cfg: Any, seed: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(cfg, i) for i in range(cfg.num_hidden_layers))
        g = torch.Generator().manual_seed(seed)
        for b in self.layers:
            b.ffn.reset_parameters(g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            y, _ = b.ffn(x)
            x = x + y
        return x


def _bias(rng: np.random.Generator, layers: int, experts: int, skew: float) -> np.ndarray:
    """A Zipf-like popularity profile per layer as a selection bias."""
    base = -skew * np.log(np.arange(1, experts + 1))
    return base[np.argsort(rng.random((layers, experts)), axis=1)]


def _run(groups: ParallelGroups, p: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = tiny_config(
        n_routed_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        hidden_size=p["hidden"],
        moe_intermediate_size=p["inter"],
    )
    ecfg = EPLBConfig(window_steps=p["window"], replan_interval=p["replan"], redundant_per_gpu=p["redundant"])
    size, me = groups.group_size, groups.group_rank
    eps = {}
    for name in NAMES:
        model = _Stack(cfg, seed=1)  # same weights on every rank and in every group
        eps[name] = (
            model,
            ExpertParallel(
                model,
                groups.ep,
                plan_placement(cfg.num_hidden_layers, cfg.n_routed_experts, size, ecfg),
                groups.device,
                replica_choice="token" if name.endswith("token") else "rank",
            ),
        )
    rng = np.random.default_rng(123)  # the same drift on every rank
    b0, b1 = (
        _bias(rng, p["layers"], p["experts"], p["skew"]),
        _bias(rng, p["layers"], p["experts"], p["skew"]),
    )
    tok_rng = torch.Generator().manual_seed(1000 + me)
    windows = {n: ExpertLoadWindow(p["layers"], p["experts"], p["window"]) for n in NAMES if n != "static"}
    rows = {n: [] for n in eps}
    moe_s = {n: 0.0 for n in eps}
    replans: dict[str, list[dict[str, float]]] = {n: [] for n in windows}
    from tqdm.auto import tqdm

    for step in tqdm(range(p["steps"]), desc="EP steps (rank 0)", disable=me != 0, mininterval=5):
        phase = 0.5 * np.pi * step / max(p["steps"] - 1, 1)  # from profile 0 to profile 1 over the run
        bias = torch.as_tensor(np.cos(phase) * b0 + np.sin(phase) * b1, dtype=torch.float32)
        x = torch.randn(p["tokens"], p["hidden"], generator=tok_rng)
        for name, (model, ep) in eps.items():
            for i, b in enumerate(model.layers):
                b.ffn.moe.gate_bias.data.copy_(bias[i])
            ep.received_per_layer[:] = 0
            t0 = time.perf_counter()
            with torch.no_grad():
                model(x)
            ep.drain()
            moe_s[name] += time.perf_counter() - t0
            rows[name].append(ep.received_per_layer.copy())
        eps["static"][1].take_step_counts()
        for name, window in windows.items():
            ep = eps[name][1]
            window.record(ep.take_step_counts())
            s = window.steps_recorded
            if s >= p["window"] and (s - p["window"]) % p["replan"] == 0:
                t0 = time.perf_counter()
                plan, rep, _ = replan_ep(ep, window.load(), groups.ep, groups.device, tolerance=0.01)
                replans[name].append(
                    {
                        "step": step,
                        "seconds": time.perf_counter() - t0,
                        "bytes_sent": rep.bytes_sent,
                        "remote_moves": plan.moves.num_remote,
                    }
                )
    return {
        "rows": {n: np.stack(v) for n, v in rows.items()},
        "moe_s": moe_s,
        "a2a_s": {n: ep.a2a_s for n, (_, ep) in eps.items()},
        "replans": replans,
    }


def _moe_lb(per_rank_rows: np.ndarray) -> np.ndarray:
    """[ranks, steps, layers] rows computed -> moe_lb per step (sum of per-layer max / sum of means)."""
    mx, mean = per_rank_rows.max(axis=0).sum(axis=1), per_rank_rows.mean(axis=0).sum(axis=1)
    return mx / np.where(mean > 0, mean, 1)


def bench_pd(lengths: list[int], new_tokens: int) -> None:
    """P/D hand-off in one process, tiny model, one request at a time: package bytes and the COMPLETION
    side's rebuild time per mode, against the PROMPT side's prefill of the same prompt (side by side)."""
    import random

    from deepinfer_core.distributed.pd import CompletionEngine, PromptEngine
    from deepinfer_core.engine import LLM, EngineConfig
    from deepinfer_core.sampling_params import SamplingParams

    torch.set_num_threads(1)
    cfg = EngineConfig(num_blocks=512, max_num_seqs=4, max_model_len=4096, batch_invariant=True)
    rng = random.Random(0)
    ref_llm = LLM(
        **{k: getattr(cfg, k) for k in ("num_blocks", "max_num_seqs", "max_model_len", "batch_invariant")}
    )
    for n in lengths:
        prompt = [rng.randrange(3, 500) for _ in range(n)]
        sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        want = ref_llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
        for mode, replay in (("full", "exact"), ("replay", "exact"), ("replay", "bounded")):
            pe = PromptEngine(cfg, mode=mode, replay=replay)
            ce = CompletionEngine(cfg, replay=replay)
            pe.add_request("r", prompt, sp)
            t0 = time.perf_counter()
            hs = []
            while pe.has_unfinished():
                hs += pe.step()[1]
            prefill_s = time.perf_counter() - t0
            (h,) = hs
            ce.add_handoff(h)
            t0 = time.perf_counter()
            got = [
                o for o in ce.step() if o.finished
            ]  # the first step loads (and in replay mode rebuilds) the state, then decodes one
            first_s = time.perf_counter() - t0
            while ce.has_unfinished():
                got += [o for o in ce.step() if o.finished]
            params = {
                "prompt_tokens": n,
                "mode": mode,
                "replay": replay if mode == "replay" else None,
                "hit": h.hit,
                "model": "tiny",
                "device": "cpu",
            }
            emit(BENCH, params, "pd_handoff_bytes", float(h.nbytes), "B")
            emit(BENCH, params, "pd_first_decode_step_over_prefill", first_s / prefill_s, "ratio")
            emit(BENCH, params, "pd_replayed_tokens", float(ce.replayed_tokens), "tokens")
            emit(BENCH, params, "pd_tokens_equal_normal", float(got[0].token_ids == want), "bool")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pd-only", action="store_true", help="only the P/D hand-off measurements")
    args = ap.parse_args()
    bench_pd([256, 1024] if not args.quick else [160], 4)
    if args.pd_only:
        return
    p = dict(
        layers=8,
        experts=32,
        top_k=4,
        hidden=256,
        inter=128,
        tokens=256,
        redundant=2,
        skew=1.2,
        window=20,
        replan=50,
        steps=300,
    )
    if args.quick:
        p.update(steps=60, window=10, replan=20, tokens=64)
    log(f"{BENCH}: {args.ranks} ranks (gloo), {p}")
    t0 = time.perf_counter()
    res = spawn(_run, args.ranks, args=(p,), backend="gloo", timeout_s=120)
    log(f"{BENCH}: done in {time.perf_counter() - t0:.1f}s")
    params = {**p, "ranks": args.ranks, "backend": "gloo", "device": "cpu"}
    lb = {n: _moe_lb(np.stack([r["rows"][n] for r in res])) for n in NAMES}
    for n in lb:
        emit(BENCH, {**params, "placement": n}, "moe_lb_mean", float(lb[n].mean()), "ratio")
        # the second half of the run: the load has drifted away from the uniform first placement
        emit(
            BENCH,
            {**params, "placement": n},
            "moe_lb_second_half",
            float(lb[n][len(lb[n]) // 2 :].mean()),
            "ratio",
        )
        share = [r["a2a_s"][n] / r["moe_s"][n] for r in res]
        emit(BENCH, {**params, "placement": n}, "a2a_share_of_moe_time", float(np.mean(share)), "ratio")
        emit(
            BENCH,
            {**params, "placement": n},
            "moe_ms_per_step",
            float(np.mean([r["moe_s"][n] for r in res]) / p["steps"] * 1e3),
            "ms",
        )
    for n in ("online", "online_token"):
        emit(BENCH, params, f"moe_lb_{n}_over_static", float(lb[n].mean() / lb["static"].mean()), "ratio")
    emit(
        BENCH,
        params,
        "moe_ms_online_token_over_online",
        float(np.mean([r["moe_s"]["online_token"] / r["moe_s"]["online"] for r in res])),
        "ratio",
    )
    reps = res[0]["replans"]["online"]
    if reps:
        emit(BENCH, params, "replan_s_median", float(np.median([r["seconds"] for r in reps])), "s")
        emit(
            BENCH,
            params,
            "moved_bytes_per_replan_rank0",
            float(np.mean([r["bytes_sent"] for r in reps])),
            "B",
        )
        emit(
            BENCH,
            params,
            "remote_moves_per_replan",
            float(np.mean([r["remote_moves"] for r in reps])),
            "moves",
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for n in lb:
            ax.plot(lb[n], label=f"{n} placement (mean {lb[n].mean():.3f})", lw=1)
        for r in reps:
            ax.axvline(r["step"], color="grey", lw=0.5, ls=":")
        ax.set_xlabel("step (load drifts over the run; dotted: online re-plans)")
        ax.set_ylabel("moe_lb (slowest rank / mean)")
        ax.set_title(
            f"EP{args.ranks} gloo, {p['experts']} experts + {p['redundant']}/rank redundant, top-{p['top_k']}"
        )
        ax.legend()
        fig.tight_layout()
        path = out_path("distributed_moe_lb.png")
        fig.savefig(path, dpi=110)
        log(f"{BENCH}: wrote {path}")


if __name__ == "__main__":
    main()
