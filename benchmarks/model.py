"""Model executor: prefill and decode tokens/s (reference backend), tiny config on CPU by default.

(a) Prefill: one request of T tokens in one chunk through ``ModelExecutor.execute`` (caches written),
    next to the cache-free ``forward_full`` of the same tokens, with KV quantisation on and off.
(b) Decode: B requests with a fixed context each, one token per request per step, for B in a sweep;
    quantisation on (FP4 / FP8 / MXFP4 caches) and off, row-wise path and per-request path.
(p) Prefill paths: the executor's dense prefill (every query against every chunk key, [n, n] masks, whole
    [n, heads, E] indexer scores and a full sort) against the tiled path (window attention in query
    tiles, indexer / attention rows in bounded pieces, keyed top-k), same model and tokens, interleaved,
    as a ratio of CPU seconds (dense / tiled) at a config with window 128 and 1,024-4,096 tokens
    (``prefill_config``: the tiny widths with the V4.1 window, 16 heads, top-k 64); ``--prefill-paths-only``
    runs only this section.
(c) Part 2, decode steps at a fixed context: the cost of each feature (mHC streams, Engram layers, the
    drafter's context writes, an EPLB placement with replicas) as variants of one config with that
    feature off, and DSpark steps (decode + draft; verify 5 drafts + draft) against a plain decode step.
Side by side in one run. On the CPU, throughput is quoted per CPU second of this process (the machine is
shared; wall-clock figures are emitted too). With ``--device cuda`` times are synchronised wall clock.
``--config wide`` is the released V4.1-Flash width (hidden 5120, 64 heads x 512, indexer 32 x 128,
top-k 512, window 128) cut to 6 layers and 8 experts so it fits one GPU: a GPU benchmark of the torch
reference, not of production kernels.

    python benchmarks/model.py [--quick] [--plot] [--threads N] [--device cuda] [--config wide]
                               [--backend none|reference|cuda]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import attrs
import numpy as np
import torch
from tqdm import tqdm

from _common import emit, log, out_path, parser
from deepinfer_core.kv import PagedKVPool
from deepinfer_core.model import (
    DeepSeekV41,
    ForwardBatch,
    ModelConfig,
    ModelExecutor,
    flash_config,
    tiny_config,
)
from deepinfer_core.protocols.model import Backend
from deepinfer_kernels import get_backend

BENCH = "model"
BLOCK = 64


def wide_config() -> ModelConfig:
    """V4.1-Flash widths, 6 layers (SWA, 2 x ratio 2, 3 x ratio 1 with a Reindex layer), 8 experts."""
    return flash_config(
        num_hidden_layers=6,
        compress_ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        num_encoder_layers=3,
        candidate_source_layer_id=3,
        n_routed_experts=8,
        engram_layer_ids=[1],
        engram_table_sizes=[8009],
        dspark_target_layer_ids=[3, 4, 5],
        num_nextn_predict_layers=1,
    )


def prefill_config() -> ModelConfig:
    """The tiny config's widths with the released window (128), 16 heads and top-k 64: a CPU-sized model
    whose prefill has the shapes that make the dense path quadratic (n x n window logits, n x E scores)."""
    return tiny_config(
        sliding_window=128,
        num_attention_heads=16,
        index_topk=64,
        candidate_block_size=16,
        candidate_topk_blocks=16,
    )


class Clock:
    """Seconds per call: CPU time of this process on the CPU, synchronised wall time on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.unit = "wall_s" if self.cuda else "cpu_s"

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> tuple[float, float]:
        self._sync()
        return (time.perf_counter() if self.cuda else time.process_time()), time.perf_counter()

    def measure(self, fn: Callable[[], object], repeat: int) -> tuple[float, float]:
        """(median quoted seconds, median wall seconds) per call, after one warm-up call."""
        fn()
        q, w = [], []
        for _ in range(repeat):
            q0, w0 = self.now()
            fn()
            q1, w1 = self.now()
            q.append(q1 - q0)
            w.append(w1 - w0)
        return statistics.median(q), statistics.median(w)


BACKEND: Backend | None = None  # set from --backend: routes the executor's cache writes through its ops


def _executor(
    model: DeepSeekV41, quantize: bool, slots: int, tokens: int
) -> tuple[ModelExecutor, PagedKVPool]:
    blocks = slots * (-(-tokens // BLOCK) + 1) + 1
    ex = ModelExecutor(model, blocks, BLOCK, slots, quantize=quantize, backend=BACKEND)
    return ex, PagedKVPool(blocks, BLOCK)


def bench_prefill(model: DeepSeekV41, clock: Clock, base: dict, t: int, repeat: int) -> None:
    dev = next(model.parameters()).device
    toks = torch.randint(0, model.cfg.vocab_size, (t,))
    params = {**base, "tokens": t}
    sec_full, wall = clock.measure(lambda: model.forward_full(toks.to(dev)), repeat)
    emit(BENCH, {**params, "path": "forward_full"}, f"prefill_tokens_per_{clock.unit}", t / sec_full, "tok/s")
    if not clock.cuda:
        emit(BENCH, {**params, "path": "forward_full"}, "prefill_tokens_per_wall_s", t / wall, "tok/s")
    for q in (False, True):
        ex, pool = _executor(model, q, 1, t)
        pool.allocate(0, t)
        b = ForwardBatch(
            token_ids=toks.numpy(),
            query_lens=[t],
            start_pos=[0],
            block_tables=pool.block_tables([0]),
            state_slots=[0],
            num_logits=[1],
        )
        sec, wall = clock.measure(lambda ex=ex, b=b: ex.execute(b), repeat)
        p = {**params, "path": "executor", "kv_quant": q}
        emit(BENCH, p, f"prefill_tokens_per_{clock.unit}", t / sec, "tok/s")
        if not clock.cuda:
            emit(BENCH, p, "prefill_tokens_per_wall_s", t / wall, "tok/s")
        emit(BENCH, p, "prefill_time_ratio_vs_forward_full", sec / sec_full, "x")


def bench_prefill_paths(dev: torch.device, clock: Clock, base: dict, lengths: list[int], repeat: int) -> None:
    """Dense vs tiled prefill of one request (``ModelExecutor.prefill_path``), KV quantised, one model;
    the two paths alternate per round so a shared machine's load falls on both alike."""
    cfg = prefill_config()
    model = DeepSeekV41.from_config(cfg, seed=0, dtype=torch.float32, device=dev)
    for t in lengths:
        toks = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(t)).numpy()
        runs = {}
        for path in ("dense", "tiled"):
            ex, pool = _executor(model, True, 1, t)
            ex.prefill_path = path
            pool.allocate(0, t)
            b = ForwardBatch(
                token_ids=toks,
                query_lens=[t],
                start_pos=[0],
                block_tables=pool.block_tables([0]),
                state_slots=[0],
                num_logits=[1],
            )
            runs[path] = lambda ex=ex, b=b: ex.execute(b).logits
        logits = {k: f().float() for k, f in runs.items()}  # also the warm-up
        q: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeat):
            for k, f in runs.items():
                q0, _ = clock.now()
                f()
                q1, _ = clock.now()
                q[k].append(q1 - q0)
        sec = {k: statistics.median(v) for k, v in q.items()}
        p = {
            **base,
            "config": "prefill",
            "window": cfg.sliding_window,
            "heads": cfg.num_attention_heads,
            "tokens": t,
            "kv_quant": True,
        }
        for k in runs:
            emit(BENCH, {**p, "path": k}, f"prefill_tokens_per_{clock.unit}", t / sec[k], "tok/s")
        emit(BENCH, p, "prefill_time_ratio_dense_vs_tiled", sec["dense"] / sec["tiled"], "x")
        d, g = logits["dense"], logits["tiled"]
        emit(BENCH, p, "prefill_tiled_vs_dense_logits_rel_err", ((g - d).norm() / d.norm()).item(), "ratio")


def bench_decode(
    model: DeepSeekV41, clock: Clock, base: dict, batch: int, ctx: int, steps: int
) -> dict[str, float]:
    """Decode steps of ``batch`` requests at context ``ctx``; returns tok/s per configuration."""
    res = {}
    for q, row_path in ((False, True), (True, True), (True, False)):
        ex, pool = _executor(model, q, batch, ctx + steps + 1)
        ex.row_path = row_path
        toks = torch.randint(0, model.cfg.vocab_size, (batch, ctx + steps))
        ids = list(range(batch))
        for i in ids:
            pool.allocate(i, ctx + steps)
        tables = pool.block_tables(ids)
        ex.execute(
            ForwardBatch(
                token_ids=toks[:, :ctx].reshape(-1).numpy(),
                query_lens=[ctx] * batch,
                start_pos=[0] * batch,
                block_tables=tables,
                state_slots=ids,
                num_logits=[1] * batch,
            )
        )

        def step(
            s: int, ex: ModelExecutor = ex, toks: torch.Tensor = toks, tables: np.ndarray = tables
        ) -> None:
            ex.execute(
                ForwardBatch(
                    token_ids=toks[:, s].numpy(),
                    query_lens=[1] * batch,
                    start_pos=[s] * batch,
                    block_tables=tables,
                    state_slots=list(range(batch)),
                    num_logits=[1] * batch,
                )
            )

        step(ctx)  # warm-up at ctx; the timed loop starts at ctx again (a rollback of one token)
        q0, w0 = clock.now()
        for s in range(ctx, ctx + steps):
            step(s)
        q1, w1 = clock.now()
        sec, wall = (q1 - q0) / steps, (w1 - w0) / steps
        key = f"{'quant' if q else 'exact'}-{'rows' if row_path else 'per_request'}"
        res[key] = batch / sec
        params = {
            **base,
            "batch": batch,
            "context": ctx,
            "kv_quant": q,
            "path": "rows" if row_path else "per_request",
        }
        emit(BENCH, params, f"decode_tokens_per_{clock.unit}", batch / sec, "tok/s")
        if not clock.cuda:
            emit(BENCH, params, "decode_tokens_per_wall_s", batch / wall, "tok/s")
        emit(BENCH, params, f"decode_ms_per_step_{clock.unit.removesuffix('_s')}", sec * 1e3, "ms")
    emit(
        BENCH,
        {**base, "batch": batch, "context": ctx, "kv_quant": True},
        "decode_speedup_rows_vs_per_request",
        res["quant-rows"] / res["quant-per_request"],
        "x",
    )
    return res


def _decode_setup(model: DeepSeekV41, batch: int, ctx: int, room: int):
    ex, pool = _executor(model, False, batch, ctx + room)
    toks = torch.randint(0, model.cfg.vocab_size, (batch, ctx + room))
    ids = list(range(batch))
    for i in ids:
        pool.allocate(i, ctx + room)
    tables = pool.block_tables(ids)
    drafting = model.drafter is not None
    out = ex.execute(
        ForwardBatch(
            token_ids=toks[:, :ctx].reshape(-1).numpy(),
            query_lens=[ctx] * batch,
            start_pos=[0] * batch,
            block_tables=tables,
            state_slots=ids,
            num_logits=[1] * batch,
            draft=[drafting] * batch,
        )
    )
    return ex, toks, tables, out


def _interleaved(
    clock: Clock, steps: dict[str, Callable[[], object]], rounds: int, per_round: int
) -> dict[str, float]:
    """Median ms per step of each closure, timed in alternation (A B C A B C ...) so that the load of the
    shared machine hits every variant alike; one warm-up step each first."""
    for f in steps.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            q0, _ = clock.now()
            for _ in range(per_round):
                f()
            q1, _ = clock.now()
            times[k].append((q1 - q0) / per_round * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_features(
    cfg: ModelConfig,
    dtype: torch.dtype,
    dev: torch.device,
    clock: Clock,
    base: dict,
    batch: int,
    ctx: int,
    rounds: int,
) -> None:
    """(c): per-feature decode step cost (variants of ``cfg``) and DSpark step cost, interleaved."""
    from deepinfer_core.eplb import rebalance_experts

    per_round = 2
    room = (rounds * per_round + 2) * (cfg.dspark_block_size + 1) + 8
    n = cfg.num_hidden_layers
    variants: dict[str, dict] = {
        "all": {},
        "no_mhc": {"hc_mult": 1},
        "no_engram": {"engram_layer_ids": []},
        "no_drafter": {"num_nextn_predict_layers": 0, "compress_ratios": cfg.compress_ratios[:n]},
    }
    variants["none"] = {k: v for d in variants.values() for k, v in d.items()}
    ids = list(range(batch))
    blk = cfg.dspark_block_size

    def make(over: dict, placement: bool = False):
        model = DeepSeekV41.from_config(
            attrs.evolve(cfg, **over), seed=0, dtype=dtype, device=dev, init_on_device=dev.type == "cuda"
        )
        if placement:
            e = cfg.n_routed_experts
            load = np.random.default_rng(0).pareto(1.0, (n, e)) + 0.1
            model.set_expert_placement(*rebalance_experts(load, e + e // 2, 1, 1, 4))
        return _decode_setup(model, batch, ctx, room)

    def plain_step(ex: ModelExecutor, toks: torch.Tensor, tables: np.ndarray) -> Callable[[], object]:
        pos = [ctx]

        def f() -> None:
            ex.execute(
                ForwardBatch(
                    token_ids=toks[:, pos[0]].numpy(),
                    query_lens=[1] * batch,
                    start_pos=[pos[0]] * batch,
                    block_tables=tables,
                    state_slots=ids,
                    num_logits=[1] * batch,
                )
            )
            pos[0] += 1

        return f

    def spec_step(ex: ModelExecutor, out: object, tables: np.ndarray, v: int) -> Callable[[], object]:
        # the protocol: feed the returned token (+ v drafts) after the accepted ones (random drafter
        # weights: drafts are mostly rejected, so positions advance ~1 per step)
        st = {"q": np.full(batch, ctx), "y": out.next_token.cpu().numpy(), "d": out.drafts.cpu().numpy()}  # type: ignore[attr-defined]

        def f() -> None:
            fed = np.concatenate([np.concatenate(([st["y"][i]], st["d"][i, :v])) for i in ids])
            o = ex.execute(
                ForwardBatch(
                    token_ids=fed,
                    query_lens=[v + 1] * batch,
                    start_pos=st["q"],
                    block_tables=tables,
                    state_slots=ids,
                    num_logits=[v + 1] * batch,
                    verify_lens=[v] * batch,
                    draft=[True] * batch,
                )
            )
            st["q"] = st["q"] + 1 + o.num_accepted.cpu().numpy()
            st["y"], st["d"] = o.next_token.cpu().numpy(), o.drafts.cpu().numpy()

        return f

    steps: dict[str, Callable[[], object]] = {}
    for name, over in variants.items():
        ex, toks, tables, _ = make(over)
        steps[name] = plain_step(ex, toks, tables)
    ex, toks, tables, _ = make({}, placement=True)
    steps["all+placement"] = plain_step(ex, toks, tables)
    for name, v in (("decode+draft", 0), (f"verify{blk}+draft", blk)):
        ex, _, tables, out = make({})
        steps[name] = spec_step(ex, out, tables, v)
    ms = _interleaved(clock, steps, rounds, per_round)
    unit = clock.unit.removesuffix("_s")
    p = {**base, "batch": batch, "context": ctx}
    for name, v in ms.items():
        emit(BENCH, {**p, "variant": name}, f"decode_ms_per_step_{unit}", v, "ms")
    for name in variants:
        if name != "all":
            emit(BENCH, {**p, "variant": name}, "step_cost_ratio_all_vs_variant", ms["all"] / ms[name], "x")
    emit(BENCH, p, "step_cost_ratio_placement_vs_all", ms["all+placement"] / ms["all"], "x")
    emit(BENCH, p, "step_cost_ratio_decode_draft_vs_decode", ms["decode+draft"] / ms["all"], "x")
    emit(BENCH, p, f"step_cost_ratio_verify{blk}_draft_vs_decode", ms[f"verify{blk}+draft"] / ms["all"], "x")


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads on the CPU (default 1: shared)"
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--config", choices=("tiny", "wide"), default="tiny")
    ap.add_argument(
        "--backend",
        choices=("none", "reference", "cuda"),
        default="none",
        help="write caches through this deepinfer_kernels backend's ops (default: plain torch)",
    )
    ap.add_argument(
        "--prefill-paths-only", action="store_true", help="only section (p): dense vs tiled prefill"
    )
    args = ap.parse_args()
    global BACKEND
    BACKEND = None if args.backend == "none" else get_backend(args.backend)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    wide = args.config == "wide"
    cfg = wide_config() if wide else tiny_config()
    dtype = torch.bfloat16 if (wide and dev.type == "cuda") else torch.float32
    model = DeepSeekV41.from_config(cfg, seed=0, dtype=dtype, device=dev, init_on_device=dev.type == "cuda")
    clock = Clock(dev)
    base = {
        "config": args.config,
        "device": dev.type,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": args.backend,
    }
    if wide:
        prefill = [1024] if args.quick else [1024, 4096]
        batches = [1, 8] if args.quick else [1, 8, 32, 64]
        ctx = 1024
    else:
        prefill = [128] if args.quick else [128, 512, 1024]
        batches = [1, 4] if args.quick else [1, 4, 16, 32]
        ctx = 128
    steps = 3 if args.quick else 16
    repeat = 1 if args.quick else 3
    lengths = [1024] if args.quick else [1024, 2048, 4096]
    bench_prefill_paths(dev, clock, base, lengths, repeat)
    if args.prefill_paths_only:
        return
    for t in tqdm(prefill, desc="prefill", disable=args.quick):
        bench_prefill(model, clock, base, t, repeat)
    curve = {}
    for b in tqdm(batches, desc="decode", disable=args.quick):
        curve[b] = bench_decode(model, clock, base, b, ctx, steps)
    for b in tqdm(batches[-2:], desc="part 2", disable=args.quick):
        bench_features(cfg, dtype, dev, clock, base, b, ctx, 1 if args.quick else 7)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for key in curve[batches[0]]:
            ax.plot(batches, [curve[b][key] for b in batches], marker="o", label=key)
        ax.set_xlabel("decode batch (requests)")
        ax.set_ylabel(f"tokens per {'second' if clock.cuda else 'CPU second'}")
        ax.set_title(f"{args.config} config decode, {dev.type}, context {ctx}")
        ax.legend()
        fig.tight_layout()
        tiny_cpu = args.config == "tiny" and dev.type == "cpu"
        p = out_path("model_decode.png" if tiny_cpu else f"model_decode_{args.config}_{dev.type}.png")
        fig.savefig(p, dpi=120)
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
