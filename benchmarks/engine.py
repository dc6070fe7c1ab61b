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

Speculative decoding on the shipped trained checkpoint (``model="tiny"``, its trained DSpark drafter),
prompts cut from the held-out corpus files of ``scripts/train_tiny.py`` (never trained on), greedy:
off vs fixed 5 drafts vs MTPVarlen (at most 5), side by side. Counted in the engine, not assumed: output
tokens per engine step, tokens per verify step (1 + accepted drafts per verify row), acceptance, output
tokens/s, and the confidence head's reliability per draft position (mean predicted confidence vs the
observed acceptance rate of the drafts actually verified there, given the earlier ones were accepted).

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


def run(
    batch: int, prompt_len: int, gen: int, async_mode: bool, regex: str | None = None
) -> dict[str, float]:
    llm = LLM(
        model="tiny-random",
        seed=0,
        num_blocks=4096 // 16 * 4,
        max_num_seqs=max(batch, 1),
        async_scheduling=async_mode,
    )
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
        "out_tok_per_s_wall": n_out / wall,
        "out_tok_per_s_cpu": n_out / cpu,
        "steps": st.steps,
        "execute_frac": st.execute_s / stages,
        "sample_frac": st.sample_s / stages,
        "sched_update_frac": (st.schedule_s + st.update_s) / stages,
        "build_frac": st.build_s / stages,
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


def drain(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> tuple[int, float, float]:
    """Add every prompt, step the engine to the end: (output tokens, wall seconds, CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    n_out = 0
    while eng.has_unfinished():
        n_out += sum(len(o.token_ids) for o in eng.step() if o.finished)
    return n_out, time.perf_counter() - w0, time.process_time() - c0


def run_spec(batch: int, prompt_len: int, gen: int, speculative: bool, copying: bool) -> dict[str, float]:
    kw = dict(dtype="float64", quantize=False) if copying else {}
    cfg = EngineConfig(
        model="tiny-random",
        seed=0,
        num_blocks=1024,
        max_num_seqs=max(batch, 1),
        async_scheduling=False,
        speculative=speculative,
        **kw,
    )
    eng = LLMEngine(cfg, envs=Envs(), model=copying_model(0) if copying else None)
    prompts = [[3 + (7 * i + 13 * j) % 256 for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    n_out, wall, cpu = drain(eng, prompts, sp)
    book = eng.drafts
    return {
        "out_tok_per_s_wall": n_out / wall,
        "out_tok_per_s_cpu": n_out / cpu,
        "steps": eng.stats.steps,
        "drafts_verified": 0 if book is None else book.verified,
        "acceptance": 0.0 if book is None or not book.verified else book.accepted / book.verified,
    }


def heldout_prompts(tok: object, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` tokens from the held-out corpus files (deterministic cuts)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "train_tiny", Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
    )
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    files = [t for name, t in mod.corpus_files() if mod.held_out(name)]
    out = []
    for i in range(n):
        ids = tok.encode(files[i % len(files)])  # type: ignore[attr-defined]
        start = (7919 * (i // len(files) + 1)) % max(1, len(ids) - prompt_len)
        out.append(ids[start : start + prompt_len])
    return out


class _Reliability:
    """Wraps a DraftBook's ``store``: the engine calls it right after counting a verify row's drafts
    (``verified`` += k, ``accepted`` += a), while the row's previous confidences are still stored."""

    def __init__(self, book: object, block: int) -> None:
        self.book, self.seen = book, [0, 0]
        self.pred = [[] for _ in range(block)]  # type: list[list[float]]
        self.acc = [[] for _ in range(block)]  # type: list[list[int]]
        inner = book.store  # type: ignore[attr-defined]

        def store(seq, drafts, conf):  # type: ignore[no-untyped-def]
            k = book.verified - self.seen[0]  # type: ignore[attr-defined]
            a = book.accepted - self.seen[1]  # type: ignore[attr-defined]
            self.seen = [book.verified, book.accepted]  # type: ignore[attr-defined]
            prev = book._conf.get(seq)  # type: ignore[attr-defined]
            if prev is not None and k > 0:
                for j in range(min(k, a + 1)):  # draft j is judged only if drafts < j were accepted
                    self.pred[j].append(float(prev[j]))
                    self.acc[j].append(int(j < a))
            inner(seq, drafts, conf)

        book.store = store  # type: ignore[attr-defined]


def run_shipped(
    mode: str, batch: int, prompt_len: int, gen: int
) -> tuple[dict[str, float], _Reliability | None]:
    spec = mode != "off"
    cfg = EngineConfig(
        model="tiny",
        num_blocks=1024,
        max_num_seqs=batch,
        async_scheduling=False,
        speculative=spec,
        num_speculative_tokens=5 if spec else None,
    )
    eng = LLMEngine(cfg, envs=Envs(enable_mtp_varlen=mode == "varlen"))
    rel = _Reliability(eng.drafts, eng.model.drafter.block) if spec else None
    prompts = heldout_prompts(eng.tokenizer, batch, prompt_len)
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    n_out, wall, cpu = drain(eng, prompts, sp)
    book, st = eng.drafts, eng.stats
    res = {
        "out_tok_per_s_wall": n_out / wall,
        "out_tok_per_s_cpu": n_out / cpu,
        "steps": st.steps,
        "out_tok_per_step": n_out / max(st.steps, 1),
    }
    if book is not None and st.verify_rows:
        res.update(
            {
                "verify_rows": st.verify_rows,
                "drafts_verified": book.verified,
                "drafts_accepted": book.accepted,
                "acceptance": book.accepted / max(book.verified, 1),
                "drafts_per_verify": book.verified / st.verify_rows,
                "tokens_per_verify": 1 + book.accepted / st.verify_rows,
            }
        )
    return res, rel


def shipped_section(batches: tuple[int, ...], prompt_len: int, gen: int) -> None:
    for b in batches:
        runs = {}
        for mode in ("off", "fixed5", "varlen"):
            log(f"shipped model, speculative={mode} batch {b}")
            r, rel = runs[mode] = run_shipped(mode, b, prompt_len, gen)
            params = {"model": "tiny", "batch": b, "prompt_len": prompt_len, "gen": gen, "speculative": mode}
            for k, v in r.items():
                emit(
                    BENCH,
                    params,
                    k,
                    v,
                    "tok/s" if "per_s" in k else "ratio" if k == "acceptance" else "count",
                )
            if rel is not None:
                for j, (pr, ac) in enumerate(zip(rel.pred, rel.acc)):
                    if pr:
                        emit(
                            BENCH,
                            {**params, "draft": j + 1, "rows": len(pr)},
                            "confidence_predicted",
                            sum(pr) / len(pr),
                            "prob",
                        )
                        emit(
                            BENCH,
                            {**params, "draft": j + 1, "rows": len(ac)},
                            "acceptance_observed",
                            sum(ac) / len(ac),
                            "prob",
                        )
        for mode in ("fixed5", "varlen"):
            emit(
                BENCH,
                {"model": "tiny", "batch": b, "speculative": mode},
                "spec_over_off_tok_per_s_cpu",
                runs[mode][0]["out_tok_per_s_cpu"] / runs["off"][0]["out_tok_per_s_cpu"],
                "ratio",
            )


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the tiny model is dispatch-bound)"
    )
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--only-shipped", action="store_true", help="only the shipped-model speculative section")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = 8 if args.quick else args.gen
    batches = (1, 8) if args.quick else (1, 8, 32)
    if args.only_shipped:
        shipped_section((1, 8), args.prompt_len, gen if args.quick else 48)
        return
    results: dict[tuple[int, bool], dict[str, float]] = {}
    for b in batches:
        for async_mode in (True, False):  # side by side: the ratio is what to quote on a shared CPU
            log(f"batch {b} async={async_mode}")
            r = results[(b, async_mode)] = run(b, args.prompt_len, gen, async_mode)
            params = {
                "batch": b,
                "prompt_len": args.prompt_len,
                "gen": gen,
                "async": async_mode,
                "threads": args.threads,
            }
            for k, v in r.items():
                emit(
                    BENCH,
                    params,
                    k,
                    v,
                    "ratio"
                    if k.endswith("frac")
                    else "tok/s"
                    if "tok" in k
                    else "ms"
                    if k.endswith("ms_per_step")
                    else "count",
                )
        emit(
            BENCH,
            {"batch": b},
            "async_over_sync_tok_per_s_cpu",
            results[(b, True)]["out_tok_per_s_cpu"] / results[(b, False)]["out_tok_per_s_cpu"],
            "ratio",
        )
    rs = run(8, args.prompt_len, gen if args.quick else 24, True, regex=r"[a-z]{4,40}")
    for k, v in rs.items():
        emit(
            BENCH,
            {"batch": 8, "structured": "regex", "async": True},
            k,
            v,
            "ratio"
            if k.endswith("frac")
            else "tok/s"
            if "tok" in k
            else "ms"
            if k.endswith("ms_per_step")
            else "count",
        )
    for copying in (False, True):
        for b in (1, 8):
            pair = {}
            for spec in (False, True):
                log(f"speculative={spec} batch {b} copying_drafter={copying}")
                r = pair[spec] = run_spec(b, args.prompt_len, gen, spec, copying)
                params = {
                    "batch": b,
                    "prompt_len": args.prompt_len,
                    "gen": gen,
                    "speculative": spec,
                    "drafter": "copying" if copying else "random",
                    "threads": args.threads,
                }
                for k, v in r.items():
                    emit(
                        BENCH,
                        params,
                        k,
                        v,
                        "tok/s" if "tok" in k else "ratio" if k == "acceptance" else "count",
                    )
            emit(
                BENCH,
                {"batch": b, "drafter": "copying" if copying else "random"},
                "spec_over_plain_tok_per_s_cpu",
                pair[True]["out_tok_per_s_cpu"] / pair[False]["out_tok_per_s_cpu"],
                "ratio",
            )
    shipped_section((1, 8), args.prompt_len, gen if args.quick else 48)
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
