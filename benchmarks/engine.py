"""Reference engine end to end: output tokens/s on the tiny model on CPU, and where a step's time goes.

For batch B in (1, 8, 32): B prompts of ``--prompt-len`` tokens, ``--gen`` greedy output tokens each
(ignore_eos), through ``LLM.generate``; one step ahead (async) and synchronous, side by side in one run.
Per run: output tokens per second (wall and per CPU second of this process: the machine is shared) and
the engine's own stage times (``LLMEngine.stats``): execute (the model), sample (grammar mask + sampling +
grammar advance), schedule + update (the C++ scheduler), build (ForwardBatch from the plan arrays).
``overhead`` = (schedule + build + sample + update) / (all stages): the engine's cost around the model.
A structured run (regex per request) at B = 8 shows the grammar mask's share.

Speculative decoding (synchronous scheduling, greedy, B in (1, 8)), each side by side with the same run
without it: (a) the tiny model with random weights (its drafter's drafts are almost never accepted, so
this measures the overhead of drafting and verifying, not a gain); (b) float64, raw KV, a drafter built
to copy the target (every draft accepted: the best case, 5 drafts per step).

    python benchmarks/engine.py [--quick] [--plot] [--threads N]
"""

from __future__ import annotations

import time

import torch

from _common import emit, log, out_path, parser
from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.envs import Envs
from deepinfer_core.model import DeepSeekV41, tiny_config
from deepinfer_core.sampling_params import SamplingParams

BENCH = "engine"


def run(batch: int, prompt_len: int, gen: int, async_mode: bool, regex: str | None = None) -> dict[str, float]:
    llm = LLM(seed=0, num_blocks=4096 // 16 * 4, max_num_seqs=max(batch, 1), async_scheduling=async_mode)
    prompts = [[3 + (7 * i + 13 * j) % 256 for j in range(prompt_len)] for i in range(batch)]
    so = {"regex": regex} if regex else None
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=regex is None, so_args=so)
    # warm-up (and, for the structured run, the grammar compile: the manager caches it by spec)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, so_args=so), use_tqdm=False)
    llm.engine.stats = type(llm.engine.stats)()
    w0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    st = llm.engine.stats
    n_out = sum(len(o.token_ids) for o in outs)
    stages = st.execute_s + st.sample_s + st.schedule_s + st.update_s + st.build_s
    return {
        "out_tok_per_s_wall": n_out / wall, "out_tok_per_s_cpu": n_out / cpu, "steps": st.steps,
        "execute_frac": st.execute_s / stages, "sample_frac": st.sample_s / stages,
        "sched_update_frac": (st.schedule_s + st.update_s) / stages, "build_frac": st.build_s / stages,
        "overhead_frac": (stages - st.execute_s) / stages,
        "overhead_ms_per_step": 1e3 * (stages - st.execute_s) / max(st.steps, 1),
    }


def copying_model(seed: int) -> DeepSeekV41:
    """Target whose greedy next token is perm[token], and a drafter that predicts exactly that chain:
    embeddings scaled by 1e4 dominate the residual stream, head rows are the embeddings permuted, and a
    full-rank Markov head adds 1e4 to perm[previous token] (the construction the model tests use)."""
    m = DeepSeekV41.from_config(tiny_config(dspark_markov_rank=512), seed=seed, dtype=torch.float64)
    inv = torch.argsort(torch.randperm(512, generator=torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        m.head.copy_(m.embed.clone()[inv])
        m.embed.mul_(1e4)
        m.drafter.markov_in.copy_(torch.eye(512, dtype=torch.float64))
        m.drafter.markov_out.copy_(1e4 * torch.eye(512, dtype=torch.float64)[inv])
    return m


def run_spec(batch: int, prompt_len: int, gen: int, speculative: bool, copying: bool) -> dict[str, float]:
    kw = dict(dtype="float64", quantize=False) if copying else {}
    cfg = EngineConfig(seed=0, num_blocks=1024, max_num_seqs=max(batch, 1), async_scheduling=False,
                       speculative=speculative, **kw)
    eng = LLMEngine(cfg, envs=Envs(), model=copying_model(0) if copying else None)
    prompts = [[3 + (7 * i + 13 * j) % 256 for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    w0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    n_out = 0
    while eng.has_unfinished():
        n_out += sum(len(o.token_ids) for o in eng.step())
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    book = eng.drafts
    return {"out_tok_per_s_wall": n_out / wall, "out_tok_per_s_cpu": n_out / cpu, "steps": eng.stats.steps,
            "drafts_verified": 0 if book is None else book.verified,
            "acceptance": 0.0 if book is None or not book.verified else book.accepted / book.verified}


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the tiny model is dispatch-bound)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = 8 if args.quick else args.gen
    batches = (1, 8) if args.quick else (1, 8, 32)
    results: dict[tuple[int, bool], dict[str, float]] = {}
    for b in batches:
        for async_mode in (True, False):  # side by side: the ratio is what to quote on a shared CPU
            log(f"batch {b} async={async_mode}")
            r = results[(b, async_mode)] = run(b, args.prompt_len, gen, async_mode)
            params = {"batch": b, "prompt_len": args.prompt_len, "gen": gen, "async": async_mode,
                      "threads": args.threads}
            for k, v in r.items():
                emit(BENCH, params, k, v, "ratio" if k.endswith("frac") else "tok/s" if "tok" in k else
                     "ms" if k.endswith("ms_per_step") else "count")
        emit(BENCH, {"batch": b}, "async_over_sync_tok_per_s_cpu",
             results[(b, True)]["out_tok_per_s_cpu"] / results[(b, False)]["out_tok_per_s_cpu"], "ratio")
    rs = run(8, args.prompt_len, gen if args.quick else 24, True, regex=r"[a-z]{4,40}")
    for k, v in rs.items():
        emit(BENCH, {"batch": 8, "structured": "regex", "async": True}, k, v,
             "ratio" if k.endswith("frac") else "tok/s" if "tok" in k else "ms" if k.endswith("ms_per_step") else "count")
    for copying in (False, True):
        for b in (1, 8):
            pair = {}
            for spec in (False, True):
                log(f"speculative={spec} batch {b} copying_drafter={copying}")
                r = pair[spec] = run_spec(b, args.prompt_len, gen, spec, copying)
                params = {"batch": b, "prompt_len": args.prompt_len, "gen": gen, "speculative": spec,
                          "drafter": "copying" if copying else "random", "threads": args.threads}
                for k, v in r.items():
                    emit(BENCH, params, k, v, "tok/s" if "tok" in k else "ratio" if k == "acceptance" else "count")
            emit(BENCH, {"batch": b, "drafter": "copying" if copying else "random"}, "spec_over_plain_tok_per_s_cpu",
                 pair[True]["out_tok_per_s_cpu"] / pair[False]["out_tok_per_s_cpu"], "ratio")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        xs = list(batches)
        a1.plot(xs, [results[(b, True)]["out_tok_per_s_cpu"] for b in xs], "o-", label="async")
        a1.plot(xs, [results[(b, False)]["out_tok_per_s_cpu"] for b in xs], "s--", label="sync")
        a1.set(xscale="log", xlabel="batch", ylabel="output tokens / CPU s", title="tiny model, CPU")
        a1.legend()
        keys = ("execute_frac", "sample_frac", "sched_update_frac", "build_frac")
        bottom = [0.0] * len(xs)
        for k in keys:
            vals = [results[(b, True)][k] for b in xs]
            a2.bar([str(b) for b in xs], vals, bottom=bottom, label=k.removesuffix("_frac"))
            bottom = [x + y for x, y in zip(bottom, vals)]
        a2.set(xlabel="batch", ylabel="share of step time", title="where a step goes (async)")
        a2.legend()
        fig.tight_layout()
        fig.savefig(out_path("engine.png"), dpi=120)
        log(f"wrote {out_path('engine.png')}")


if __name__ == "__main__":
    main()
