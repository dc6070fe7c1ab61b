"""``deepinfer serve`` under load: N concurrent streaming chat requests on the CPU (tiny model), against the
same requests offline through ``LLM.generate``, side by side in one run.

    python benchmarks/serve.py [--requests 200] [--max-tokens 16] [--max-num-seqs 64] [--cancel 0.33]
                               [--batch-invariant] [--quick]

JSON lines (bench "serve"): client-side TTFT and inter-token latency p50 / p99 (ms), the engine's own mean
step time inside the server (from /metrics), the fraction of the run's wall time the server spent inside
``engine.step``, output tokens/s, and ``server_over_offline``: the server run's wall time over the same
completed requests' wall time through ``LLM.generate`` (the whole serving overhead as a ratio: HTTP, SSE,
JSON, asyncio, the engine thread hand-off, plus the queueing both share).
"""

from __future__ import annotations

import time

import torch

from _common import emit, log, parser
from deepinfer_core.engine import LLM
from deepinfer_core.entrypoints.openai.launch import ServerProcess
from deepinfer_core.entrypoints.openai.loadgen import percentile, run_chats
from deepinfer_core.sampling_params import SamplingParams

BENCH = "serve"
WORDS = ["list", "dict", "loop", "class", "sort", "path", "json", "regex", "async", "yield"]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--cancel", type=float, default=0.0, help="fraction cancelled after 2 token chunks")
    ap.add_argument("--batch-invariant", action="store_true")
    args = ap.parse_args()
    n = 24 if args.quick else args.requests
    bodies = [
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"{WORDS[i % 10]} #{i}: explain"}],
            "max_tokens": args.max_tokens,
            "temperature": 0.8,
            "seed": i,
        }
        for i in range(n)
    ]
    every = round(1 / args.cancel) if args.cancel > 0 else 0
    cancel = {i: 2 for i in range(n) if every and i % every == 1}
    cfg = dict(seed=0, max_num_seqs=args.max_num_seqs, num_blocks=4096)
    srv_args = [
        "--model",
        "tiny",
        "--seed",
        "0",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--num-blocks",
        "4096",
    ]
    if args.batch_invariant:
        srv_args.append("--batch-invariant")
    params = {
        "requests": n,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "cancelled": len(cancel),
        "batch_invariant": args.batch_invariant,
        "model": "tiny",
        "device": "cpu",
    }
    with ServerProcess(*srv_args, env={"OMP_NUM_THREADS": "1"}) as srv:
        run_chats(srv.base_url, bodies[:4])  # warm-up (first-call costs)
        m0 = srv.metrics()
        t0 = time.monotonic()
        res = run_chats(srv.base_url, bodies, cancel)
        wall = time.monotonic() - t0
        m1 = srv.metrics()
    bad = [r.error for r in res if r.error]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {bad[:3]}")
    steps = m1["deepinfer_engine_steps_total"] - m0["deepinfer_engine_steps_total"]
    step_s = m1["deepinfer_engine_step_seconds_total"] - m0["deepinfer_engine_step_seconds_total"]
    toks = sum(len(r.token_ids) for r in res)
    ttft = [r.ttft for r in res if r.ttft is not None]
    itl = [g for r in res for g in r.gaps]
    for name, xs in (("ttft", ttft), ("itl", itl)):
        for q in (50, 99):
            emit(BENCH, params, f"{name}_p{q}", round(1e3 * percentile(xs, q), 2), "ms")
    emit(BENCH, params, "engine_step_mean", round(1e3 * step_s / max(steps, 1), 2), "ms")
    emit(BENCH, params, "engine_busy_fraction", round(step_s / wall, 3), "ratio")
    emit(BENCH, params, "server_tokens_per_s", round(toks / wall, 1), "tok/s")
    # the same completed requests offline (the server is stopped: it does not compete for the cores)
    done = [b for b, r in zip(bodies, res) if not r.cancelled]
    llm = LLM("tiny", batch_invariant=True if args.batch_invariant else None, **cfg)
    prompts = [llm.tokenizer.encode_chat(b["messages"]) for b in done]
    sps = [
        SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"], seed=b["seed"]) for b in done
    ]
    llm.generate(prompts[:4], sps[:4], use_tqdm=False)
    t0 = time.monotonic()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    off = time.monotonic() - t0
    emit(BENCH, params, "offline_tokens_per_s", round(sum(len(o.token_ids) for o in outs) / off, 1), "tok/s")
    if not cancel:
        emit(BENCH, params, "server_over_offline", round(wall / off, 3), "ratio")
    log(
        f"serve: {n} streams in {wall:.1f} s ({steps:.0f} steps, {step_s:.1f} s in engine.step); offline {off:.1f} s; "
        f"torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
