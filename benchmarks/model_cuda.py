"""Decode steps of the wide config on the cuda backend: eager vs CUDA graphs, share of the roofline,
kernel launches and host synchronisations per step, a profile of the hot kernels.

For each batch size B (context C tokens per request, KV quantised as in serving: FP4 main, FP8 SWA ring,
MXFP4 indexer keys) one executor is prefilled, then S decode steps run eagerly and S more with CUDA graphs
(modes: ``legacy`` the plain row path with its host syncs, ``off`` the sync-free eager path, ``on`` CUDA graphs). Reported per mode:

- ``ms_per_step``: synchronised wall clock over S steps through ``ModelExecutor.execute`` (host work included:
  that is what the engine waits for); ``replay_ms_per_step`` (graph modes): the last step's graph replayed
  back to back, the device's own time for a step with the gaps between its kernels and no host work;
- ``roofline_pct``: the bytes a step must read (weights it uses + KV it attends to + indexer keys it scores,
  :func:`step_bytes`) over the device-to-device copy bandwidth measured in the same run, as a share of
  ``ms_per_step``;
- ``launches_per_step`` / ``syncs_per_step`` / ``gpu_busy_pct``: from torch.profiler over 3 steps (kernel
  launch calls incl. graph launches; stream / device / event synchronisations; device time over wall time);
- with ``--sync-sites``: the source lines that synchronise (torch.cuda.set_sync_debug_mode), eager mode.

    python benchmarks/model_cuda.py [--batches 1,8,64] [--context 1024] [--steps 16] [--graphs off,on]
                                    [--sync-sites] [--out DIR] [--quick]

Needs a CUDA device (and TileLang for the cuda backend's KV kernels). JSON lines on stdout; with ``--out``
also the profiler tables (``profile_B<b>_<mode>.txt``).
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from _common import emit, graph_replay_ms, log, parser
from deepinfer_core.kv import PagedKVPool
from deepinfer_core.model import DeepSeekV41, ForwardBatch, ModelExecutor
from deepinfer_core.model.fusion import compiled_count
from deepinfer_kernels import get_backend
from model import wide_config

BENCH = "model_cuda"
BLOCK = 64
LAUNCH = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
    "cudaLaunchCooperativeKernel",
)
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def step_bytes(model: DeepSeekV41, ex: ModelExecutor, batch: int, ctx: int) -> dict[str, int]:
    """Bytes one decode step of ``batch`` requests at context ``ctx`` must read at least.

    Weights: every parameter the step uses once (attention, norms, mHC, Engram projections, the LM head),
    the routed experts that at most min(E, batch * top_k) tokens can reach, the shared expert; the
    embedding and Engram tables only their ``batch`` rows; the drafter is not used by a plain decode step.
    KV per request and layer: the SWA window (FP8 ring bytes), the top-k compressed entries (FP4) of
    compressed layers, and every visible indexer key (MXFP4) of the layers that score."""
    cfg = model.cfg
    es = next(model.parameters()).element_size()
    w = 0
    for name, p in model.named_parameters():
        if name.startswith("drafter.") or name == "embed":
            continue
        if ".ffn.w" in name and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
            used = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok)
            w += p[0].numel() * es * used
            continue
        w += p.numel() * es
    if model.head is None:  # tied: the LM head reads the whole embedding
        w += model.embed.numel() * es
    w += batch * cfg.hidden_size * es
    kv = 0
    fmt = ex.fmt
    for lid in range(cfg.num_hidden_layers):
        kv += batch * min(ctx, cfg.sliding_window) * fmt.swa.bytes_per_token
        r = cfg.ratio(lid)
        if r > 0:
            kv += batch * min(cfg.index_topk, ctx // r) * fmt.main.bytes_per_token
            if lid in cfg.index_source_layer_ids:
                kv += batch * (ctx // r) * fmt.index.bytes_per_token
    return {"weights": w, "kv": kv, "total": w + kv}


def matmul_rate(n: int = 8192, reps: int = 10) -> float:
    """bf16 matrix-product rate on random data, FLOP/s (median of ``reps``)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n**3 / statistics.median(times)


GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "gemv")


def prefill_flops(model: DeepSeekV41, tokens: int) -> float:
    """FLOPs of the weight products of one prefill of ``tokens`` tokens (the GEMM-bound part): every
    dense weight once per token, top-k routed experts per token, the LM head for one logits row."""
    cfg = model.cfg
    f = 0.0
    for name, p in model.named_parameters():
        if (
            name.startswith("drafter.")
            or name in ("embed", "head")
            or p.dim() < 2
            or ("engram." in name and "table" in name)
        ):
            continue
        if ".ffn.w" in name and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
            f += 2 * tokens * cfg.num_experts_per_tok * p[0].numel()
        else:
            f += 2 * tokens * p.numel()
    return f + 2 * cfg.vocab_size * cfg.hidden_size


PREFILL_PATHS = ("dense", "tiled", "glue", "varlen")


def gpu_time_split(events: list) -> dict[str, float]:
    """Device microseconds of a profile's kernels by where they were launched: inside the executor's
    ``prefill.attention`` / ``prefill.indexer`` ranges (their GEMMs included), else GEMM kernels by name
    (``weight_gemm``: the weight products, the GEMM-bound part) or ``other`` (norms, RoPE, MoE routing,
    casts, cache writes...). Walks the CPU events' trees: each kernel belongs to the op that launched it."""
    from deepinfer_core.model.prefill import ATTENTION_RANGE, INDEXER_RANGE

    names = {ATTENTION_RANGE: "attention", INDEXER_RANGE: "indexer"}
    out = dict.fromkeys(("weight_gemm", "attention", "indexer", "other"), 0.0)
    stack = [(e, None) for e in events if str(e.device_type).endswith("CPU") and e.cpu_parent is None]
    while stack:
        e, label = stack.pop()
        label = names.get(e.name, label)
        for k in e.kernels:
            is_gemm = any(g in k.name.lower() for g in GEMM_KERNELS)
            out[label or ("weight_gemm" if is_gemm else "other")] += k.duration
        stack.extend((c, label) for c in e.cpu_children)
    return out


def bench_prefill(
    model: DeepSeekV41,
    lengths: list[int],
    rate: float,
    out: Path | None,
    paths: tuple[str, ...] = ("dense", "tiled"),
    tile: int | None = None,
    budget: int | None = None,
) -> None:
    """One request's prefill (eager; prefill steps are not graphed) per path: ``dense`` (the plain path:
    [n, n] window masks, whole indexer matrices), ``tiled`` (model.prefill: query tiles, bounded row pieces,
    keyed top-k), ``glue`` (tiled with its small functions compiled, ``fuse_glue``), ``varlen``
    (model.prefill_varlen; benchmarks/prefill_batching.py compares it on many requests). Reported:

    - ``prefill_pct_of_matmul_rate``: weight-product FLOPs (:func:`prefill_flops`) over the wall time, as a
      share of the bf16 matmul rate measured in the same run;
    - ``prefill_gemm_part_pct_of_matmul_rate``: the same FLOPs over the weight-GEMM kernels' own device time
      (GEMM kernels launched outside the attention / indexer ranges: :func:`gpu_time_split`);
      ``prefill_all_gemm_pct_of_matmul_rate`` over every GEMM-named kernel (attention GEMMs too);
    - ``prefill_gpu_split_<part>_pct``: the GPU time split weight GEMM / attention / indexer / other;
    - ``prefill_speedup_vs_dense`` and ``prefill_vs_dense_logits_rel_err`` for the other paths.
    """
    from torch.profiler import ProfilerActivity, profile

    base = {"config": "wide", "device": torch.cuda.get_device_name()}
    for t in lengths:
        blocks = -(-t // BLOCK) + 2
        ex = ModelExecutor(model, blocks, BLOCK, 1, quantize=True, backend=get_backend("cuda"))
        ex.prefill_tile = tile or ex.prefill_tile
        ex.prefill_budget = budget or ex.prefill_budget
        base = {**base, "tile": ex.prefill_tile, "budget_mib": ex.prefill_budget >> 20}
        toks = torch.randint(
            0, model.cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(t)
        ).numpy()
        table = np.arange(1, blocks, dtype=np.int64)[None, : -(-t // BLOCK)]
        batch = ForwardBatch(
            token_ids=toks, query_lens=[t], start_pos=[0], block_tables=table, state_slots=[0], num_logits=[1]
        )
        flops = prefill_flops(model, t)
        walls: dict[str, float] = {}
        logits: dict[str, torch.Tensor] = {}
        for path in paths:
            if path not in PREFILL_PATHS:
                raise SystemExit(f"--prefill-paths: unknown path {path!r} ({', '.join(PREFILL_PATHS)})")
            ex.prefill_path = path if path in ("dense", "varlen") else "tiled"
            ex.fuse_glue = path == "glue"
            t0 = time.perf_counter()
            logits[path] = ex.execute(batch).logits.float()  # warm-up (the glue compiles here)
            torch.cuda.synchronize()
            p = {**base, "tokens": t, "mode": path}
            emit(BENCH, p, "prefill_warmup_s", time.perf_counter() - t0, "s")
            reps = []
            for _ in range(3):
                t0 = time.perf_counter()
                ex.execute(batch)
                torch.cuda.synchronize()
                reps.append(time.perf_counter() - t0)
            wall = walls[path] = statistics.median(reps)
            emit(BENCH, p, "prefill_ms", wall * 1e3, "ms")
            emit(BENCH, p, "prefill_tokens_per_s", t / wall, "tok/s")
            emit(BENCH, p, "prefill_weight_tflops", flops / wall / 1e12, "TFLOP/s")
            emit(BENCH, p, "prefill_pct_of_matmul_rate", 100 * flops / wall / rate, "%")
            if "dense" in walls and path != "dense":
                emit(BENCH, p, "prefill_speedup_vs_dense", walls["dense"] / wall, "x")
                d = logits["dense"]
                emit(
                    BENCH,
                    p,
                    "prefill_vs_dense_logits_rel_err",
                    ((logits[path] - d).norm() / d.norm()).item(),
                    "ratio",
                )
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ex.execute(batch)
                torch.cuda.synchronize()
            split = gpu_time_split(prof.events())
            dev_us = sum(split.values())
            ka = prof.key_averages()
            kernels = [
                e
                for e in ka
                if str(getattr(e, "device_type", "")).endswith("CUDA") and not e.is_user_annotation
            ]
            all_gemm_us = sum(
                e.self_device_time_total for e in kernels if any(k in e.key.lower() for k in GEMM_KERNELS)
            )
            emit(BENCH, p, "prefill_gpu_ms", dev_us / 1e3, "ms")
            emit(
                BENCH,
                p,
                "prefill_gpu_ms_unattributed",
                (sum(e.self_device_time_total for e in kernels) - dev_us) / 1e3,
                "ms",
            )
            for part, us in split.items():
                emit(BENCH, p, f"prefill_gpu_split_{part}_pct", 100 * us / max(dev_us, 1e-9), "%")
            emit(
                BENCH,
                p,
                "prefill_gemm_share_of_gpu_time",
                100 * split["weight_gemm"] / max(dev_us, 1e-9),
                "%",
            )
            emit(
                BENCH,
                p,
                "prefill_gemm_part_pct_of_matmul_rate",
                100 * flops / (max(split["weight_gemm"], 1e-9) / 1e6) / rate,
                "%",
            )
            emit(
                BENCH,
                p,
                "prefill_all_gemm_pct_of_matmul_rate",
                100 * flops / (max(all_gemm_us, 1e-9) / 1e6) / rate,
                "%",
            )
            if out is not None:
                with open(out / "profiles.txt", "a") as fh:
                    fh.write(f"\n\n==== prefill {t} tokens, {path}\n")
                    fh.write(
                        ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90)
                    )
        del ex
        torch.cuda.empty_cache()


class Decoder:
    """One executor prefilled with ``batch`` random requests of ``ctx`` tokens; ``step()`` decodes one token each."""

    def __init__(self, model: DeepSeekV41, batch: int, ctx: int, room: int) -> None:
        cfg = model.cfg
        slots = batch
        blocks = slots * (-(-(ctx + room) // BLOCK) + 1) + 1
        # a plain decode benchmark: no drafter context (the roofline counts no drafter either; an engine
        # that does not speculate builds its executor the same way)
        self.ex = ModelExecutor(
            model, blocks, BLOCK, slots, quantize=True, backend=get_backend("cuda"), draft_context=False
        )
        pool = PagedKVPool(blocks, BLOCK)
        g = torch.Generator().manual_seed(batch)
        self.toks = torch.randint(0, cfg.vocab_size, (batch, ctx + room), generator=g).numpy()
        ids = list(range(batch))
        for i in ids:
            pool.allocate(i, ctx + room)
        self.tables = pool.block_tables(ids)
        self.batch, self.pos = batch, ctx
        for i in ids:  # prefill request by request (bounded activation memory)
            self.ex.execute(
                ForwardBatch(
                    token_ids=self.toks[i, :ctx],
                    query_lens=[ctx],
                    start_pos=[0],
                    block_tables=self.tables[i : i + 1],
                    state_slots=[i],
                    num_logits=[1],
                )
            )
        torch.cuda.synchronize()

    def step(self) -> torch.Tensor:
        b, s = self.batch, self.pos
        out = self.ex.execute(
            ForwardBatch(
                token_ids=self.toks[:, s],
                query_lens=[1] * b,
                start_pos=[s] * b,
                block_tables=self.tables,
                state_slots=list(range(b)),
                num_logits=[1] * b,
            )
        )
        self.pos += 1
        return out.logits


MODES = (
    "legacy",
    "off",
    "on",
    "fused",
    "glue",
    "glue-eager",
    "glue-attn",
    "glue-moe",
    "glue-head",
    "glue-all",
)
EAGER_MODES = ("legacy", "off", "glue-eager")  # every other mode replays CUDA graphs


def set_mode(ex: ModelExecutor, mode: str) -> None:
    """legacy: the plain row path (host syncs); off: sync-free eager; on: sync-free + CUDA graphs;
    fused: graphs with the opt-in fused kernels (mhc_sinkhorn); glue: graphs with the fused glue
    (model.fusion: torch.compile of the small per-token functions); glue-eager: the same without graphs;
    glue-attn: glue with the one-kernel decode attention (``executor.fused_attention``); glue-moe: glue with
    the TileLang grouped expert GEMM (``executor.fused_moe``); glue-head: glue with the LM head through that
    kernel (``executor.fused_head``); glue-all: glue with all three."""
    if mode not in MODES:
        raise SystemExit(f"--graphs: unknown mode {mode!r} ({', '.join(MODES)})")
    if hasattr(ex, "sync_free"):
        ex.sync_free = mode != "legacy"
        ex.cuda_graphs = mode not in EAGER_MODES
        ex.fused_sinkhorn = mode == "fused"
        ex.fuse_glue = mode.startswith("glue")
        ex.fused_attention = mode in ("glue-attn", "glue-all")
        ex.fused_moe = mode in ("glue-moe", "glue-all")
        ex.fused_head = mode in ("glue-head", "glue-all")
    elif mode != "legacy":
        raise SystemExit("this executor has no sync-free path")


def host_issue_ms(dec: Decoder, n: int = 7) -> float:
    """Median wall ms the host takes to issue one step (``execute`` returning, the GPU idle when it starts:
    a synchronisation before each step, none inside the timed part). A step whose ``ms_per_step`` is above
    its ``replay_ms_per_step`` is host-bound when this is close to ``ms_per_step``; when it is well below,
    the host waits for the device somewhere inside the step."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def profile_steps(dec: Decoder, n: int, table_path: Path | None) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            dec.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in LAUNCH)
    syncs = sum(e.count for e in ka if e.key in SYNC)
    memcpy = sum(e.count for e in ka if e.key == "cudaMemcpyAsync")
    on_dev = [e for e in ka if str(getattr(e, "device_type", "")).endswith("CUDA")]
    dev_us = sum(getattr(e, "self_device_time_total", 0.0) for e in on_dev)
    kernels = sum(e.count for e in on_dev)  # kernels and copies the GPU ran (inside graphs too)
    if table_path is not None:  # one file for every profile: a device call returns at most 8 files
        with open(table_path.parent / "profiles.txt", "a") as fh:
            fh.write(f"\n\n==== {table_path.stem}\n")
            fh.write(
                ka.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90)
                + "\n\n"
                + ka.table(sort_by="count", row_limit=45, max_name_column_width=90)
                # the host's side (graph launches, pinned copies, the Engram fetch): what a step waits for
                + "\n\n"
                + ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)
            )
    return {
        "launches_per_step": launches / n,
        "syncs_per_step": syncs / n,
        "memcpy_async_per_step": memcpy / n,
        "gpu_busy_pct": 100 * dev_us / 1e6 / wall,
        "profiled_ms_per_step": wall / n * 1e3,
        "gpu_kernels_per_step": kernels / n,
        "gpu_ms_per_step": dev_us / 1e3 / n,
    }


def host_profile(dec: Decoder, n: int, path: Path, title: str) -> None:
    """cProfile of ``n`` steps (the host's share of a step: what the GPU waits for when it idles)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        dec.step()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    with open(path, "a") as fh:
        fh.write(f"\n\n==== {title} ({n} steps)\n{buf.getvalue()}")


def sync_sites(dec: Decoder) -> list[tuple[str, int]]:
    """Source lines (file:line) that synchronise in one step, most frequent first."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            dec.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    c = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in got if "synchroniz" in str(w.message)
    )
    return c.most_common()


def bench_engine(batches: list[int], prompt_len: int, gen: int) -> None:
    """The engine on the tiny model (cuda backend): output tokens/s and GPU idle share, sync vs async
    scheduling, graphs off / on. GPU idle = 1 - device time / wall time over one profiled generate call
    (idle between steps and inside them: an upper bound on the between-steps idle)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer_core.engine import LLM
    from deepinfer_core.envs import Envs
    from deepinfer_core.sampling_params import SamplingParams

    for b in batches:
        prompts = [[3 + (7 * i + 13 * j) % 256 for j in range(prompt_len)] for i in range(b)]
        sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        toks = {}
        for async_mode in (False, True):
            # speculation off: verify steps are not pure decode (they run eagerly), and the drafter forces
            # synchronous scheduling
            llm = LLM(
                model="tiny-random",
                backend="cuda",
                seed=0,
                num_blocks=4096 // 16 * 4,
                max_num_seqs=b,
                async_scheduling=async_mode,
                envs=Envs(use_nextn_decode=0),
            )
            for graphs in (False, True):
                ex = llm.engine.executor
                ex.cuda_graphs = graphs and ex.sync_free
                llm.generate(
                    prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
                )
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                n = sum(len(o.token_ids) for o in outs)
                toks[(async_mode, graphs)] = [list(o.token_ids) for o in outs]
                p = {
                    "model": "tiny-random",
                    "batch": b,
                    "prompt_len": prompt_len,
                    "gen": gen,
                    "async": async_mode,
                    "graphs": graphs,
                }
                emit(BENCH, p, "engine_out_tokens_per_s", n / wall, "tok/s")
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp, use_tqdm=False)
                    torch.cuda.synchronize()
                    pw = time.perf_counter() - t0
                ka = prof.key_averages()
                dev_us = sum(
                    getattr(e, "self_device_time_total", 0.0)
                    for e in ka
                    if str(getattr(e, "device_type", "")).endswith("CUDA")
                )
                emit(BENCH, p, "engine_gpu_idle_pct", 100 - 100 * dev_us / 1e6 / pw, "%")
                emit(
                    BENCH,
                    p,
                    "engine_syncs_per_token",
                    sum(e.count for e in ka if e.key in SYNC) / max(n, 1),
                    "count",
                )
                if graphs and ex.sync_free:
                    emit(BENCH, p, "engine_graphs_captured", ex.graphs().captures, "count")
            del llm
        same = all(v == toks[(False, False)] for v in toks.values())
        emit(
            BENCH,
            {"model": "tiny-random", "batch": b},
            "engine_greedy_tokens_equal_all_modes",
            float(same),
            "bool",
        )


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--graphs",
        default="legacy,off,on",
        help="modes to time: legacy (plain row path), off (sync-free eager), on (CUDA graphs), "
        "fused (graphs + the opt-in fused mhc_sinkhorn kernel)",
    )
    ap.add_argument("--sync-sites", action="store_true")
    ap.add_argument("--out", default=None, help="folder for the profiler tables")
    ap.add_argument(
        "--profile-batches", default="", help="batches whose profiler tables go to --out (default all)"
    )
    ap.add_argument("--engine", default="", help="batches for the engine section (tiny model), e.g. 1,8,64")
    ap.add_argument("--no-wide", action="store_true", help="skip the wide-config decode section")
    ap.add_argument(
        "--prefill", default="", help="prompt lengths for the wide-config prefill section, e.g. 2048,8192"
    )
    ap.add_argument(
        "--prefill-paths",
        default="dense,tiled",
        help="prefill paths to time: dense (plain), tiled (model.prefill), glue (tiled + fused glue), "
        "varlen (model.prefill_varlen: every request at once)",
    )
    ap.add_argument(
        "--prefill-tile", type=int, default=0, help="query rows per window tile (default: the executor's)"
    )
    ap.add_argument(
        "--prefill-budget-mib",
        type=int,
        default=0,
        help="MiB of intermediates per piece of prefill rows (default: the executor's)",
    )
    ap.add_argument(
        "--host-profile", default="", help="modes whose host side is profiled (cProfile, 5 steps)"
    )
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.engine:
        bench_engine([int(x) for x in args.engine.split(",")], 64, 8 if args.quick else 32)
    if args.no_wide:
        return
    cfg = wide_config()
    model = DeepSeekV41.from_config(cfg, seed=0, dtype=torch.bfloat16, device="cuda", init_on_device=True)
    bw = copy_bandwidth()
    base = {"config": "wide", "device": torch.cuda.get_device_name(), "context": args.context}
    emit(BENCH, base, "copy_bandwidth_read_plus_write", bw / 1e9, "GB/s")
    if args.prefill:
        rate = matmul_rate()
        emit(BENCH, base, "bf16_matmul_rate", rate / 1e12, "TFLOP/s")
        bench_prefill(
            model,
            [int(x) for x in args.prefill.split(",")],
            rate,
            out,
            tuple(x for x in args.prefill_paths.split(",") if x),
            args.prefill_tile or None,
            (args.prefill_budget_mib << 20) or None,
        )
    modes = [m for m in args.graphs.split(",") if m]
    steps = 3 if args.quick else args.steps
    for b in [int(x) for x in args.batches.split(",")]:
        dec = Decoder(model, b, args.context, room=(steps + 20) * len(modes) + 16)
        need = step_bytes(model, dec.ex, b, args.context)
        p = {**base, "batch": b}
        emit(BENCH, p, "step_bytes_weights", need["weights"] / 1e9, "GB")
        emit(BENCH, p, "step_bytes_kv", need["kv"] / 1e9, "GB")
        floor_ms = need["total"] / bw * 1e3
        emit(BENCH, p, "roofline_ms", floor_ms, "ms")
        for mode in modes:
            set_mode(dec.ex, mode)
            if args.sync_sites and mode != "on":
                dec.step()
                sites = sync_sites(dec)
                emit(
                    BENCH,
                    {**p, "mode": mode, "sites": sites[:40]},
                    "sync_sites_one_step",
                    sum(n for _, n in sites),
                    "syncs",
                )
            t0 = time.perf_counter()
            for _ in range(3):  # warm-up (captures the bucket's graph on its first use; fused glue compiles)
                dec.step()
            torch.cuda.synchronize()
            emit(BENCH, {**p, "mode": mode}, "warmup_s", time.perf_counter() - t0, "s")
            t0 = time.perf_counter()
            for _ in range(steps):
                dec.step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / steps * 1e3
            pm = {**p, "mode": mode}
            emit(BENCH, pm, "ms_per_step", ms, "ms")
            emit(BENCH, pm, "roofline_pct", 100 * floor_ms / ms, "%")
            emit(BENCH, pm, "tokens_per_s", b / ms * 1e3, "tok/s")
            if mode not in EAGER_MODES:
                emit(BENCH, pm, "replay_ms_per_step", graph_replay_ms(dec.ex), "ms")
            emit(BENCH, pm, "host_issue_ms_per_step", host_issue_ms(dec), "ms")
            keep = out and (not args.profile_batches or str(b) in args.profile_batches.split(","))
            prof = profile_steps(dec, 3, out / f"profile_B{b}_{mode}.txt" if keep else None)
            for k, v in prof.items():
                emit(
                    BENCH,
                    pm,
                    k,
                    v,
                    "%" if k.endswith("pct") else ("ms" if k.endswith("ms_per_step") else "count"),
                )
            if mode.startswith("glue"):
                emit(BENCH, pm, "fused_functions_compiled", compiled_count(), "count")
            if out and mode in args.host_profile.split(","):
                host_profile(dec, 5, out / "host_profile.txt", f"B={b} {mode}")
        for m in (x for x in modes if x not in EAGER_MODES and "off" in modes):
            # the same step eagerly (sync-free, no fusion) and in mode m (rolled back one token)
            set_mode(dec.ex, "off")
            ref = dec.step().float()
            dec.pos -= 1
            set_mode(dec.ex, m)
            got = dec.step().float()
            q = {**p, "mode": m}
            emit(BENCH, q, "vs_eager_logits_rel_err", ((got - ref).norm() / ref.norm()).item(), "ratio")
            emit(
                BENCH,
                q,
                "vs_eager_argmax_agree",
                (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                "share",
            )
        if dec.ex.cuda_graphs or "on" in modes:
            emit(BENCH, p, "graphs_captured", dec.ex.graphs().captures, "count")
        del dec
        torch.cuda.empty_cache()
        log(f"batch {b} done")


if __name__ == "__main__":
    main()
