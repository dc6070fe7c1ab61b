"""Model executor: prefill and decode tokens/s of the tiny config on CPU (reference backend).

(a) Prefill: one request of T tokens in one chunk through ``ModelExecutor.execute`` (caches written),
    next to the cache-free ``forward_full`` of the same tokens, and with KV quantisation on and off.
(b) Decode: B requests with a 128-token context each, one token per request per step, for B in a sweep;
    quantisation on (FP4 / FP8 / MXFP4 caches) and off, row-wise path and per-request path. Side by
    side in one run, float32, 1 thread. Throughput is quoted per CPU second of this process (the
    machine is shared); wall-clock figures are emitted too.

    python benchmarks/model.py [--quick] [--plot] [--threads N]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from _common import emit, log, out_path, parser
from deepinfer_core.kv import PagedKVPool
from deepinfer_core.model import DeepSeekV41, ForwardBatch, ModelExecutor, tiny_config

BENCH = "model"
BLOCK = 16


def _executor(model: DeepSeekV41, quantize: bool, slots: int, tokens: int) -> tuple[ModelExecutor, PagedKVPool]:
    blocks = slots * (-(-tokens // BLOCK) + 1) + 1
    return ModelExecutor(model, blocks, BLOCK, slots, quantize=quantize), PagedKVPool(blocks, BLOCK)


def cpu_time_it(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median CPU seconds, median wall seconds) per call. CPU time of this process is what we quote:
    the benchmark machine is shared, and wall time there mostly measures the neighbours."""
    fn()
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def bench_prefill(model: DeepSeekV41, t: int, repeat: int) -> None:
    toks = torch.randint(0, model.cfg.vocab_size, (t,))
    params = {"config": "tiny", "tokens": t, "dtype": "float32"}
    sec_full, wall = cpu_time_it(lambda: model.forward_full(toks), repeat)
    emit(BENCH, {**params, "path": "forward_full"}, "prefill_tokens_per_cpu_s", t / sec_full, "tok/s")
    emit(BENCH, {**params, "path": "forward_full"}, "prefill_tokens_per_wall_s", t / wall, "tok/s")
    for q in (False, True):
        ex, pool = _executor(model, q, 1, t)
        pool.allocate(0, t)
        b = ForwardBatch(token_ids=toks.numpy(), query_lens=[t], start_pos=[0], block_tables=pool.block_tables([0]),
                         state_slots=[0], num_logits=[1])
        sec, wall = cpu_time_it(lambda ex=ex, b=b: ex.execute(b), repeat)
        emit(BENCH, {**params, "path": "executor", "kv_quant": q}, "prefill_tokens_per_cpu_s", t / sec, "tok/s")
        emit(BENCH, {**params, "path": "executor", "kv_quant": q}, "prefill_tokens_per_wall_s", t / wall, "tok/s")
        emit(BENCH, {**params, "path": "executor", "kv_quant": q}, "prefill_time_ratio_vs_forward_full", sec / sec_full, "x")


def bench_decode(model: DeepSeekV41, batch: int, ctx: int, steps: int) -> dict[str, float]:
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
        ex.execute(ForwardBatch(token_ids=toks[:, :ctx].reshape(-1).numpy(), query_lens=[ctx] * batch,
                                start_pos=[0] * batch, block_tables=tables, state_slots=ids, num_logits=[1] * batch))

        def step(s: int, ex: ModelExecutor = ex, toks: torch.Tensor = toks, tables: np.ndarray = tables) -> None:
            ex.execute(ForwardBatch(token_ids=toks[:, s].numpy(), query_lens=[1] * batch, start_pos=[s] * batch,
                                    block_tables=tables, state_slots=list(range(batch)), num_logits=[1] * batch))

        step(ctx)  # warm-up at ctx; the timed loop starts at ctx again (a rollback of one token)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(ctx, ctx + steps):
            step(s)
        sec, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
        key = f"{'quant' if q else 'exact'}-{'rows' if row_path else 'per_request'}"
        res[key] = batch / cpu
        params = {"config": "tiny", "batch": batch, "context": ctx, "kv_quant": q,
                  "path": "rows" if row_path else "per_request", "dtype": "float32"}
        emit(BENCH, params, "decode_tokens_per_cpu_s", batch / cpu, "tok/s")
        emit(BENCH, params, "decode_tokens_per_wall_s", batch / sec, "tok/s")
        emit(BENCH, params, "decode_cpu_ms_per_step", cpu * 1e3, "ms")
    emit(BENCH, {"config": "tiny", "batch": batch, "context": ctx, "kv_quant": True},
         "decode_speedup_rows_vs_per_request", res["quant-rows"] / res["quant-per_request"], "x")
    return res


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: shared CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DeepSeekV41.from_config(tiny_config(), seed=0, dtype=torch.float32)
    prefill = [128] if args.quick else [128, 512, 1024]
    batches = [1, 4] if args.quick else [1, 4, 16, 32]
    steps = 3 if args.quick else 16
    repeat = 1 if args.quick else 3
    for t in tqdm(prefill, desc="prefill", disable=args.quick):
        bench_prefill(model, t, repeat)
    curve = {}
    for b in tqdm(batches, desc="decode", disable=args.quick):
        curve[b] = bench_decode(model, b, 128, steps)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for key in curve[batches[0]]:
            ax.plot(batches, [curve[b][key] for b in batches], marker="o", label=key)
        ax.set_xlabel("decode batch (requests)")
        ax.set_ylabel("tokens per CPU second")
        ax.set_title("tiny config decode, CPU, 1 thread")
        ax.legend()
        fig.tight_layout()
        p = out_path("model_decode.png")
        fig.savefig(p, dpi=120)
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
