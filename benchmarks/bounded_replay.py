"""SWA bounded replay: reconstruction cost vs context, prefill saved on a hit, and the approximation's effect.

Three measurements (one JSON line each, see benchmarks/_common.py):

- ``recon``: the cost of rebuilding a sequence's state after a hit that leaves no new tokens but the
  tail, vs context 1K-64K: bounded (keep = window + 12: 140 at the released window, the README default), exact (the whole dependency span,
  ``D (w - 1) + 1`` tokens), and a full prefill without any cache. Measured time (median of repeats) and
  modelled FLOPs. Cache contents are zeros: the cost does not depend on the values.
- ``hit``: a prompt of ``context`` tokens whose first ``context - new`` are cached: plan time / full
  prefill time, and the modelled FLOP ratio; plus the encoder-only share of per-token prefill FLOPs
  ("nearly halves prefill").
- ``quality``: next-token distributions of bounded vs exact state over many prompts after a real hit
  (the exact run's own blocks): KL(exact || bounded) and top-1 agreement at the prompt's last position
  and over teacher-forced decode steps, for several ``keep`` values, with and without the host copy.

Models: ``--model tiny`` (the built-in tiny config, random weights drawn from a seed: no trained
checkpoint is used unless ``--checkpoint`` names one) and ``--model wide`` (the released layer structure:
40 layers, 20 + 20 CED split, window 128, ratios [0,0]+[2]*18+[1]*20, at the tiny width).

    python benchmarks/bounded_replay.py --quick            # CI smoke
    python benchmarks/bounded_replay.py --plot              # tiny, everything
    python benchmarks/bounded_replay.py --model wide --only recon,hit --device cuda --plot
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from _common import emit, log, out_path, parser
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.config import LAYER_SWA, ModelConfig, tiny_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.swa import EXACT, ReplayConfig, ReplayPlan, plan_replay
from deepinfer_core.swa.run import run_plan

BENCH = "bounded_replay"
BLOCK = 64
KEEP_OVER_WINDOW = 12  # DEEPINFER_YOCO_PREFILL_KEEP_TOKENS = 140 = window 128 + 12 in the release


def wide_config() -> ModelConfig:
    """The released layer structure (window, split, ratios, sharing groups) at the tiny width."""
    return tiny_config(
        num_hidden_layers=40,
        sliding_window=128,
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
        kv_source_layer_ids=[2, 8, 14, 20],
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        num_encoder_layers=20,
        candidate_source_layer_id=20,
        candidate_block_size=8,
        candidate_topk_blocks=64,
        index_topk=64,
        engram_layer_ids=[1, 14],
        num_nextn_predict_layers=0,
    )


# ---------------------------------------------------------------------------------------------- FLOPs
def layer_dense_flops(model: DeepSeekV41) -> list[float]:
    """Per-token FLOPs of each layer's projections and active experts (2 x active parameters)."""
    cfg, out = model.cfg, []
    for blk in model.layers:
        attn = sum(p.numel() for n, p in blk.attn.named_parameters() if n != "attn_sink")
        moe = blk.ffn
        per_expert = sum(
            p[0].numel() for n, p in moe.named_parameters() if n.startswith("w") and p.dim() == 3
        )
        routed = per_expert * cfg.num_experts_per_tok
        shared = sum(p.numel() for n, p in moe.named_parameters() if "shared" in n)
        gate = cfg.hidden_size * cfg.n_routed_experts
        out.append(2.0 * (attn + routed + shared + gate))
    return out


def plan_flops(model: DeepSeekV41, plan: ReplayPlan) -> float:
    """Modelled FLOPs of the plan's compute: dense per token and layer, plus attention over the window,
    the top-k compressed entries and the indexer's scan of every visible entry."""
    cfg, dense = model.cfg, layer_dense_flops(model)
    h, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    total = 0.0
    for st in plan.steps:
        if st.num_tokens == 0:
            continue
        p = np.arange(st.start, st.end, dtype=np.float64)
        lays = list(range(*st.layers)) + ([st.source_layer] if st.source_layer is not None else [])
        for lid in lays:
            if lid == st.source_layer:  # the source write: compressor projections only
                a = model.layers[lid].attn
                total += (
                    2.0 * st.num_tokens * (a.compressor.wkv.numel() * 2 + a.index_compressor.wkv.numel() * 2)
                )
                continue
            total += dense[lid] * st.num_tokens
            lo = st.floor if st.floor_layers[0] <= lid < st.floor_layers[1] else 0
            keys = np.minimum(w, p - np.maximum(lo, p - w + 1) + 1)
            r = cfg.ratio(lid)
            if cfg.layer_kind(lid) != LAYER_SWA:
                keys = keys + np.minimum(cfg.index_topk, (p + 1) // r)
                if cfg.layer_kind(lid) in ("full", "reindex"):
                    total += float(((p + 1) // r).sum()) * cfg.index_n_heads * cfg.index_head_dim * 2
            total += float(keys.sum()) * h * d * 4
    return total


# ---------------------------------------------------------------------------------------------- helpers
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, dev: torch.device, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def keep_of(cfg: ModelConfig) -> int:
    return cfg.sliding_window + KEEP_OVER_WINDOW


def full_plan(n: int, cfg: ModelConfig) -> ReplayPlan:
    rc = ReplayConfig.from_model(cfg, keep=keep_of(cfg), block_size=BLOCK)
    return plan_replay(rc, n, 0)


# ---------------------------------------------------------------------------------------------- recon / hit
def bench_cost(
    model: DeepSeekV41,
    name: str,
    contexts: list[int],
    new: int,
    repeat: int,
    max_full: int,
    chunk: int,
    rows: list[dict],
) -> None:
    cfg, dev = model.cfg, next(model.parameters()).device
    biggest = max(contexts)
    nb = -(-biggest // BLOCK) + 2
    ex = ModelExecutor(model, nb, BLOCK, 2, quantize=True)
    table = np.arange(1, nb, dtype=np.int32)
    rings = ex.encoder_rings(0)
    enc_share = None
    for ctx in contexts:
        toks = np.random.default_rng(ctx).integers(0, cfg.vocab_size, ctx)
        for scen, h0 in (("recon", ctx - 1), ("hit", ctx - new)):
            for mode in ("bounded", EXACT, "full"):
                if mode == "full":  # no cache at all: the whole prompt through every layer
                    plan = full_plan(ctx, cfg)
                    sec = float("nan")
                    if ctx <= max_full:
                        sec = timed(
                            lambda plan=plan, toks=toks: run_plan(ex, plan, toks, 0, table, chunk=chunk),
                            dev,
                            repeat,
                        )
                else:
                    rc = ReplayConfig.from_model(cfg, keep=keep_of(cfg), block_size=BLOCK, mode=mode)
                    plan = plan_replay(rc, ctx, h0, host_state=True)
                    sec = timed(
                        lambda plan=plan, toks=toks: run_plan(
                            ex, plan, toks, 1, table, host_rings=rings, chunk=chunk
                        ),
                        dev,
                        repeat,
                    )
                fl = plan_flops(model, plan)
                row = {
                    "model": name,
                    "scenario": scen,
                    "context": ctx,
                    "mode": mode,
                    "hit": plan.hit,
                    "computed_tokens": ctx - plan.hit,
                    "decoder_replay_tokens": plan.decoder_replay_tokens,
                    "device": dev.type,
                }
                emit(BENCH, row, "seconds", sec, "s")
                emit(BENCH, row, "modelled_flops", fl, "flop")
                rows.append({**row, "seconds": sec, "flops": fl})
                log(f"{name} {scen} ctx={ctx} {mode}: {sec:.4f} s, {fl:.3g} flop")
        if enc_share is None:
            rc = ReplayConfig.from_model(cfg, keep=keep_of(cfg), block_size=BLOCK)
            p = plan_replay(rc, ctx, ctx - new, host_state=True)
            per = [
                (
                    s,
                    plan_flops(
                        model,
                        ReplayPlan(
                            num_tokens=ctx,
                            requested_hit=0,
                            hit=0,
                            mode="bounded",
                            encoder_restored=False,
                            steps=(s,),
                            encoder_replay_tokens=0,
                            decoder_replay_tokens=0,
                            exact=False,
                        ),
                    )
                    / max(1, s.num_tokens),
                )
                for s in p.steps
                if s.kind in ("encoder_prefill", "tail")
            ]
            if len(per) == 2:
                enc_share = per[0][1] / per[1][1]
                emit(
                    BENCH,
                    {"model": name, "context": ctx},
                    "encoder_only_flops_per_token_vs_full",
                    enc_share,
                    "x",
                )
    for ctx in contexts:
        by = {(r["scenario"], r["mode"]): r for r in rows if r["context"] == ctx and r["model"] == name}
        for scen in ("recon", "hit"):
            f = by[(scen, "full")]
            for mode in ("bounded", EXACT):
                r = by[(scen, mode)]
                p = {"model": name, "scenario": scen, "context": ctx, "mode": mode}
                emit(BENCH, p, "flops_ratio_vs_full_prefill", r["flops"] / f["flops"], "x")
                if not math.isnan(f["seconds"]):
                    emit(BENCH, p, "time_ratio_vs_full_prefill", r["seconds"] / f["seconds"], "x")


# ---------------------------------------------------------------------------------------------- quality
def text_prompts(tok: Any) -> np.ndarray:
    """Token ids of this repository's docs (real text for a trained model; random windows are cut)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = "\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    return np.asarray(tok.encode(text), dtype=np.int64)


def bench_quality(
    model: DeepSeekV41,
    name: str,
    prompts: int,
    length: int,
    hit: int,
    decode: int,
    keeps: list[int],
    rows: list[dict],
    texts: np.ndarray | None = None,
) -> None:
    cfg = model.cfg
    w, bs = cfg.sliding_window, 8
    nb = -(-(length + decode) // bs) + 2
    table = np.arange(1, nb, dtype=np.int32)
    rng = np.random.default_rng(0)
    stats: dict[tuple[int, bool], list[tuple[float, bool]]] = {}
    last: dict[tuple[int, bool], list[tuple[float, bool]]] = {}
    for _ in range(prompts):
        if texts is None:  # random weights: random token ids
            toks = rng.integers(0, cfg.vocab_size, length)
        else:  # a trained model: windows of real text
            a = int(rng.integers(0, texts.shape[0] - length))
            toks = texts[a : a + length]
        ex = ModelExecutor(model, nb, bs, 2, quantize=True)
        # the exact run (no cache): prefill with a snapshot at the hit, then greedy decode
        out = ex.execute(
            ForwardBatch(
                token_ids=toks[:hit],
                query_lens=[hit],
                start_pos=[0],
                block_tables=table[None],
                state_slots=[0],
                num_logits=[0],
                snapshot_pos=[hit],
            )
        )
        snap = out.snapshots[0]
        out = ex.execute(
            ForwardBatch(
                token_ids=toks[hit:],
                query_lens=[length - hit],
                start_pos=[hit],
                block_tables=table[None],
                state_slots=[0],
                num_logits=[1],
            )
        )
        ref = [out.logits[-1].double().log_softmax(-1)]
        seq = list(toks)
        for _ in range(decode):
            seq.append(int(ref[-1].argmax()))
            o = ex.execute(
                ForwardBatch(
                    token_ids=seq[-1:],
                    query_lens=[1],
                    start_pos=[len(seq) - 1],
                    block_tables=table[None],
                    state_slots=[0],
                    num_logits=[1],
                )
            )
            ref.append(o.logits[-1].double().log_softmax(-1))
        for keep in keeps:
            for host in (True, False):
                rc = ReplayConfig.from_model(cfg, keep=keep, block_size=bs)
                plan = plan_replay(rc, length, hit, host_state=host)
                assert plan.hit == hit, (plan.hit, hit)
                lg = [run_plan(ex, plan, toks, 1, table, host_rings=snap).double().log_softmax(-1)]
                for i in range(decode):
                    pos = length + i
                    o = ex.execute(
                        ForwardBatch(
                            token_ids=[seq[pos]],
                            query_lens=[1],
                            start_pos=[pos],
                            block_tables=table[None],
                            state_slots=[1],
                            num_logits=[1],
                        )
                    )
                    lg.append(o.logits[-1].double().log_softmax(-1))
                kl = [float((r.exp() * (r - b)).sum()) for r, b in zip(ref, lg)]
                top = [bool(r.argmax() == b.argmax()) for r, b in zip(ref, lg)]
                stats.setdefault((keep, host), []).extend(zip(kl, top))
                last.setdefault((keep, host), []).append((kl[0], top[0]))
    exact_tail = ReplayConfig.from_model(cfg, keep=1).exact_tail()
    for (keep, host), v in stats.items():
        kl = np.array([a for a, _ in v])
        top = np.array([b for _, b in v])
        kl0 = np.array([a for a, _ in last[(keep, host)]])
        top0 = np.array([b for _, b in last[(keep, host)]])
        p = {
            "model": name,
            "keep": keep,
            "window": w,
            "exact_tail": exact_tail,
            "host_copy": host,
            "prompts": prompts,
            "prompt_source": "random ids" if texts is None else "docs/*.md text",
            "length": length,
            "hit": hit,
            "decode_steps": decode,
            "quantized_kv": True,
        }
        emit(BENCH, p, "kl_mean_all_positions", float(kl.mean()), "nats")
        emit(BENCH, p, "kl_p99_all_positions", float(np.quantile(kl, 0.99)), "nats")
        emit(BENCH, p, "top1_agreement_all_positions", float(top.mean()), "frac")
        emit(BENCH, p, "kl_mean_prompt_last", float(kl0.mean()), "nats")
        emit(BENCH, p, "top1_agreement_prompt_last", float(top0.mean()), "frac")
        rows.append({**p, "kl": float(kl.mean()), "top1": float(top.mean())})
        log(f"quality keep={keep} host={host}: KL {kl.mean():.3g}, top-1 {top.mean():.3f}")


# ---------------------------------------------------------------------------------------------- engine
def bench_engine(repeat: int) -> None:
    """The engine with prefix caching on vs off (tiny-random, CPU seconds, side by side): the overhead
    without hits, and a repeat of long prompts (exact and bounded)."""
    from deepinfer_core.engine import LLM
    from deepinfer_core.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llms = {pc: LLM(model="tiny-random", prefix_caching=pc, num_blocks=256) for pc in (False, True)}
    t: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeat):
        for pc in (False, True):
            ps = [rng.integers(3, 259, 64).tolist() for _ in range(8)]
            t0 = time.process_time()
            llms[pc].generate(ps, [sp] * 8, use_tqdm=False)
            t[pc].append(time.process_time() - t0)
    on, off = float(np.median(t[True])), float(np.median(t[False]))
    emit(
        BENCH,
        {"scenario": "no_hits", "prompts": 8, "prompt_len": 64, "outputs": 24},
        "cpu_s_on_vs_off",
        on / off,
        "x",
    )
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    res = {}
    for mode in ("off", EXACT, "bounded"):
        llm = LLM(
            model="tiny-random",
            prefix_caching=mode != "off",
            swa_replay=EXACT if mode == "off" else mode,
            num_blocks=512,
        )
        ts, out = [], []
        for _ in range(repeat):
            ps = [rng.integers(3, 259, 400).tolist() for _ in range(4)]
            llm.generate(ps, [sp] * 4, use_tqdm=False)  # the first wave computes and caches
            t0 = time.process_time()
            out = llm.generate(ps, [sp] * 4, use_tqdm=False)
            ts.append(time.process_time() - t0)
        res[mode] = float(np.median(ts))
        p = {
            "scenario": "repeat",
            "mode": mode,
            "prompts": 4,
            "prompt_len": 400,
            "cached_tokens": sum(o.cached_tokens for o in out),
            "replayed_tokens": sum(o.replayed_tokens for o in out),
        }
        emit(BENCH, p, "cpu_s", res[mode], "s")
        emit(BENCH, p, "cpu_s_vs_off", res[mode] / res["off"], "x")
        log(
            f"engine repeat {mode}: {res[mode]:.3f} s ({p['cached_tokens']} cached, {p['replayed_tokens']} replayed)"
        )


# ---------------------------------------------------------------------------------------------- plots
def plot(cost: list[dict], quality: list[dict], tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if cost:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        rec = [r for r in cost if r["scenario"] == "recon"]
        for ax, key, lab in ((axes[0], "seconds", "measured seconds"), (axes[1], "flops", "modelled FLOPs")):
            for mode, style in (("bounded", "o-"), (EXACT, "s-"), ("full", "^--")):
                pts = sorted(
                    (r["context"], r[key]) for r in rec if r["mode"] == mode and not math.isnan(r[key])
                )
                if pts:
                    ax.plot(
                        *zip(*pts),
                        style,
                        label={"full": "full prefill (no cache)"}.get(mode, f"{mode} replay"),
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context tokens (cached)")
            ax.set_ylabel(lab)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(
            f"state reconstruction after a hit ({tag}, {cost[0]['model']}, keep = window + {KEEP_OVER_WINDOW})"
        )
        fig.tight_layout()
        fig.savefig(out_path(f"bounded_replay_cost_{tag}.png"), dpi=110)
        log(f"wrote {out_path(f'bounded_replay_cost_{tag}.png')}")
    if quality:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for host, style in ((True, "o-"), (False, "s--")):
            pts = sorted((r["keep"], r["kl"], r["top1"]) for r in quality if r["host_copy"] == host)
            if pts:
                k, kl, t1 = zip(*pts)
                lab = "encoder from host copy" if host else "encoder replayed (w tokens)"
                axes[0].plot(k, kl, style, label=lab)
                axes[1].plot(k, t1, style, label=lab)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("KL(exact || bounded), nats")
        axes[1].set_ylabel("top-1 agreement")
        for ax in axes:
            ax.set_xlabel("keep (decoder replay tokens)")
            ax.axvline(quality[0]["exact_tail"], color="gray", ls=":", label="exact span")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"bounded vs exact next-token distributions ({quality[0]['model']})")
        fig.tight_layout()
        fig.savefig(out_path(f"bounded_replay_quality_{tag}.png"), dpi=110)
        log(f"wrote {out_path(f'bounded_replay_quality_{tag}.png')}")


def rows_from(path: str) -> tuple[list[dict], list[dict], str]:
    """(cost rows, quality rows, tag) rebuilt from a run's JSON lines (e.g. a GPU run's output)."""
    import json
    from pathlib import Path

    cost: dict[tuple, dict] = {}
    quality: dict[tuple, dict] = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        p, m = d["params"], d["metric"]
        if m in ("seconds", "modelled_flops"):
            key = tuple(sorted(p.items()))
            cost.setdefault(key, dict(p))["seconds" if m == "seconds" else "flops"] = d["value"]
        elif m in ("kl_mean_all_positions", "top1_agreement_all_positions"):
            key = tuple(sorted(p.items()))
            quality.setdefault(key, dict(p))["kl" if m.startswith("kl") else "top1"] = d["value"]
    c, q = list(cost.values()), list(quality.values())
    first = (c or q)[0]
    return c, q, f"{first['model']}_{first.get('device', 'cpu')}"


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--checkpoint", default=None, help="a trained checkpoint directory (DeepSeekV41 weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--only", default="recon,quality", help="comma list of: recon (includes hit), quality, engine"
    )
    ap.add_argument("--max-full", type=int, default=8192, help="longest context whose full prefill is timed")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--plot-from", default=None, help="only plot the JSON lines of an earlier run (no model)")
    args = ap.parse_args()
    if args.plot_from:
        plot(*rows_from(args.plot_from))
        return
    torch.manual_seed(0)
    cfg = tiny_config() if args.model == "tiny" else wide_config()
    dev = torch.device(args.device)
    texts = None
    if args.checkpoint:  # e.g. "tiny": the trained checkpoint shipped in the package (issue #16)
        from deepinfer_core.model.checkpoint import load_model

        model, tok = load_model(args.checkpoint, device=dev)
        name = f"{args.checkpoint}-trained"
        texts = text_prompts(tok)
    else:
        model = DeepSeekV41.from_config(cfg, seed=0, dtype=torch.float32, device=dev)
        name = f"{args.model}-random"
    only = set(args.only.split(","))
    cost: list[dict] = []
    quality: list[dict] = []
    if "recon" in only:
        ctxs = [1024, 2048] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536]
        bench_cost(
            model,
            name,
            ctxs,
            new=512 if not args.quick else 256,
            repeat=1 if args.quick else 2,
            max_full=min(args.max_full, 2048) if args.quick else args.max_full,
            chunk=512,
            rows=cost,
        )
    if "quality" in only:
        w = model.cfg.sliding_window
        keeps = [w, w + 6, 2 * w, ReplayConfig.from_model(model.cfg, keep=1).exact_tail()]
        length, hit = (8 * w, 4 * w) if args.model == "tiny" else (4 * w, 2 * w)
        bench_quality(
            model,
            name,
            4 if args.quick else args.prompts,
            length + 8,
            hit,
            2 if args.quick else 8,
            sorted(set(keeps)),
            quality,
            texts,
        )
    if "engine" in only:
        bench_engine(1 if args.quick else 3)
    if args.plot:
        plot(cost, quality, f"{name}_{dev.type}")


if __name__ == "__main__":
    main()
