"""The engine's step time with its Redis KV store down, against a store-less engine (issue #34).

Two engines of one config side by side in one run: A without a store, B with a ``RedisKVStore`` on a
redis-server this script starts on 127.0.0.1. Each round runs the same batch of fresh prompts (so every
admission misses the GPU prefix index and B looks the prefix up in its store) on A, then on B; the
metric is B's wall time per engine step over A's, median over rounds (the machine is shared: quote the
ratio). Phases: Redis up (a healthy store's cost), SIGSTOPped (every call would wait for the socket
timeout), resumed (SIGCONT: the breaker's probe finds it and the store is used again), killed (refused
connections). In the two fault phases the first round of B opens the breaker
(its extra time, the price of ``failure_threshold`` timeouts, is reported on its own); the rounds after
it are the measurement. A CPU-time ratio (this process) is reported too: the wall ratio includes other
users of the machine.

    python benchmarks/kvstore_faults.py [--quick]
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import time

import numpy as np

from _common import emit, log, parser
from deepinfer_core.engine import LLM
from deepinfer_core.kvstore import RedisKVStore
from deepinfer_core.sampling_params import SamplingParams
from kvstore import start_redis

BENCH = "kvstore_faults"


def round_time(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, float, int]:
    """(wall s, process CPU s, engine steps) of one generate call."""
    s0 = llm.engine.stats.steps
    w0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    return wall, cpu, llm.engine.stats.steps - s0


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=192)
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    proc, rdir, url = start_redis()
    if proc is None:
        log("redis-server not found: nothing to measure")
        return
    try:
        cfg = {
            "model": "tiny-random",
            "seed": 0,
            "num_blocks": 1024,
            "block_size": 16,
            "max_num_seqs": args.batch,
        }
        store = RedisKVStore(url=url)
        a = LLM(**cfg)
        # back-off capped at 2 s so the store is back in use soon after SIGCONT (the defaults: 1 s .. 30 s)
        b = LLM(kv_store=store, kv_store_guard={"backoff_s": 0.5, "max_backoff_s": 2.0}, **cfg)
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        rng = np.random.default_rng(0)

        def batch() -> list[list[int]]:
            return [rng.integers(3, 259, args.prompt_len).tolist() for _ in range(args.batch)]

        guard = b.engine.prefix.link.guard
        written = 0
        warm = batch()
        round_time(a, warm, sp)
        round_time(b, warm, sp)
        for phase in ("up", "stopped", "resumed", "killed"):
            if phase == "stopped":
                os.kill(proc.pid, signal.SIGSTOP)
            elif phase == "resumed":  # SIGCONT; the breaker's next probe finds the store again
                os.kill(proc.pid, signal.SIGCONT)
                end = time.monotonic() + 30
                while not (guard.allows("read") and guard.allows("write")) and time.monotonic() < end:
                    time.sleep(0.05)
                log(f"resumed: breaker read={guard.state('read')} write={guard.state('write')}")
            elif phase == "killed":
                proc.kill()
                proc.wait()
            p = {
                "phase": phase,
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "max_tokens": 16,
                "model": "tiny-random float32",
                "store": "RedisKVStore(timeout_s=0.1)",
            }
            if phase in ("stopped", "killed"):  # the round in which the breaker opens, on its own
                prompts = batch()
                wa, _, sa = round_time(a, prompts, sp)
                wb, _, sb = round_time(b, prompts, sp)
                emit(BENCH, p, "opening_round_extra_s", wb - wa * sb / max(sa, 1), "s")
                log(
                    f"{phase}: breaker read={guard.state('read')} write={guard.state('write')}, "
                    f"errors {guard.stats.errors}"
                )
            wr, cr, per_a, per_b = [], [], [], []
            for _ in range(rounds):
                prompts = batch()
                wa, ca, sa = round_time(a, prompts, sp)
                wb, cb, sb = round_time(b, prompts, sp)
                per_a.append(wa / sa)
                per_b.append(wb / sb)
                wr.append((wb / sb) / (wa / sa))
                cr.append((cb / sb) / (ca / sa))
            emit(BENCH, p, "step_ms_storeless", 1e3 * statistics.median(per_a), "ms")
            emit(BENCH, p, "step_ms_with_store", 1e3 * statistics.median(per_b), "ms")
            emit(BENCH, p, "step_time_ratio", statistics.median(wr), "ratio")
            emit(BENCH, p, "step_cpu_ratio", statistics.median(cr), "ratio")
            if phase in ("up", "resumed"):  # the store is really in use: blocks written back in this phase
                emit(BENCH, p, "written_blocks", b.engine.prefix.link.written_blocks - written, "blocks")
            written = b.engine.prefix.link.written_blocks
            if phase != "up":
                emit(
                    BENCH,
                    p,
                    "store_calls_skipped",
                    guard.stats.skipped_reads + guard.stats.skipped_writes,
                    "calls",
                )
        emit(BENCH, {"phase": "end"}, "kv_store_errors", sum(guard.stats.errors.values()), "errors")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(rdir, ignore_errors=True)


if __name__ == "__main__":
    main()
