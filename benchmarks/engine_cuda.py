"""The engine on the GPU (cuda backend): throughput against interactivity, GPU idle, batch invariance.

For each batch size B, B requests (prompt P tokens, G output tokens each, greedy, ``ignore_eos``) are
added at once and stepped to the end through ``LLMEngine`` in these modes: ``sync`` and ``async``
scheduling without speculation (pure decode steps: CUDA graphs; ``async`` is the asynchronous overlap, step
N+1 launched before step N's tokens are read, engine/overlap.py), ``async-plain`` (async scheduling with
the overlap off: the host reads each step's tokens before planning the next), and ``spec`` (the model's
DSpark drafter, up to 5 drafts, synchronous). Reported per (B, mode):

- ``tokens_per_s_per_gpu``: output tokens of all requests over the wall time of the whole run (prefill
  included); ``tokens_per_s_per_user``: each request's output tokens over the same wall time (every
  request runs the whole time), averaged. Tokens are those the engine returned (accepted drafts only);
- ``tokens_per_step``: output tokens over engine steps (above 1 per request only by accepted drafts);
- ``gpu_idle_pct``: 1 - GPU busy time / wall time over the decode phase (torch.profiler over a second run
  of the same batch from its first decode step on; busy = the union of the kernel and copy intervals, so
  nothing is counted twice); with the overlap the host plans and builds step N + 1 while the GPU runs
  step N, so idle time is what the host does not hide. Beside it ``overlap_share`` (steps launched
  before the previous step's tokens were read) and ``land_wait_ms_per_step`` (host time blocked on them),
  and ``idle_between_steps_pct``: the share of the same window the stream sat empty *between* steps
  (timing events around each step's launches, :class:`StepMarks`), which leaves out the gaps between
  kernels inside a step that the kernel-union figure counts (a graph of ~800-2,300 small kernels has ~1 us
  between each); ``idle_starved_pct``: the device gaps of >= 10 us (the GPU had nothing queued: the
  host was late, between steps or inside one), the same window, from the same profile;

``--invariance``: batch-invariant mode (``EngineConfig(batch_invariant=True)``) with graphs on: a greedy
and a seeded sampled request's tokens alone and inside 20 random batch mixes of greedy and seeded
requests, twice, bit-identical (``seeded_target_differs_from_greedy`` checks that the seeded one samples);
first its cost at each ``--invariance-batches`` B: tokens/s of the default mode, the mode batched (one
executor call a step, row-chunked products: model/invariant.py) and the mode's old per-request loop, side
by side in ``--invariance-rounds`` alternating rounds (``..._ratio_to_default``). ``--plot`` writes tokens/s per GPU against tokens/s per user (engine_cuda.png).

    python benchmarks/engine_cuda.py [--model tiny|wide] [--batches 1,4,16,64,256] [--modes sync,async,async-plain,spec]
                                     [--gen 32] [--prompt 64] [--glue] [--invariance] [--plot] [--out DIR]
    python benchmarks/engine_cuda.py --backend reference --host 1,16,64 [--host-modes sync,async]  # host CPU per step, model stubbed

Needs a CUDA device. JSON lines on stdout.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm import tqdm

from _common import emit, graph_replay_ms, log, parser
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams

BENCH = "engine_cuda"
MODES = ("sync", "async", "async-plain", "spec")


def make_engine(
    model_name: str,
    batch: int,
    mode: str,
    glue: bool,
    invariant: bool = False,
    prompt: int = 64,
    gen: int = 32,
) -> LLMEngine:
    envs = Envs(
        use_nextn_decode=5 if mode == "spec" else 0,
        fuse_glue=glue,
        fused_attention=FUSED[0],
        fused_moe=FUSED[0],
        fused_head=FUSED[0],
    )
    spec = dict(speculative=mode == "spec")
    per_req = -(-(prompt + gen + 16) // 16) + 1
    cfg = dict(
        backend=BACKEND[0],
        max_num_seqs=batch,
        num_blocks=batch * per_req + 8,
        block_size=16,
        async_scheduling=mode.startswith("async"),
        async_overlap=mode == "async",
        batch_invariant=invariant,
        max_model_len=prompt + gen + 64,
        **spec,
    )
    if model_name == "wide":
        from deepinfer_core.model import DeepSeekV41
        from model import wide_config

        m = _WIDE.get("m")
        if m is None:
            dev = (
                "cuda" if BACKEND[0] == "cuda" else "cpu"
            )  # the CPU: a smoke run of this path (small config)
            m = _WIDE["m"] = DeepSeekV41.from_config(
                wide_config(), seed=0, dtype=torch.bfloat16, device=dev, init_on_device=dev == "cuda"
            )
        return LLMEngine(EngineConfig(model="tiny-random", dtype="bfloat16", **cfg), envs=envs, model=m)
    return LLMEngine(EngineConfig(model=model_name, **cfg), envs=envs)


_WIDE: dict[str, Any] = {}
BACKEND = ["cuda"]  # --backend reference runs the same code on the CPU (a smoke test of this script)
FUSED: list[bool | None] = [
    None
]  # --fused: DEEPINFER_FUSED_ATTENTION / _MOE / _HEAD for every engine of the run


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_CODE: list[int] = []  # the tiny model's kind of text (it was trained on Python sources): this package's code


def prompts_for(n: int, length: int, vocab: int, seed: int, tokenizer: Any = None) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: slices of this package's Python sources through ``tokenizer``
    (drafts of a model trained on code get accepted on code), else random token ids."""
    rng = random.Random(seed)
    if tokenizer is not None:
        if not _CODE:
            src = Path(__file__).resolve().parents[1] / "src" / "deepinfer_core"
            text = "\n".join(p.read_text() for p in sorted(src.rglob("*.py"))[:40])
            _CODE.extend(tokenizer.encode(text))
        return [_CODE[(k := rng.randrange(len(_CODE) - length)) : k + length] for _ in range(n)]
    return [[rng.randrange(3, min(vocab, 250)) for _ in range(length)] for _ in range(n)]


SAMPLING = ("greedy", "sampled", "structured")


def params_for(kind: str, n: int, gen: int) -> list[SamplingParams]:
    """Each request's sampling: ``greedy``; ``sampled`` (temperature 0.8, top-p 0.95, top-k 50, a seed per
    request: the sampler's top-k / top-p path); ``structured`` (greedy under a regex that never ends before
    ``gen`` tokens: a grammar mask every step)."""
    if kind not in SAMPLING:
        raise SystemExit(f"--sampling: {kind!r}: must be one of {', '.join(SAMPLING)}")
    if kind == "sampled":
        return [
            SamplingParams(
                temperature=0.8, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=gen, ignore_eos=True
            )
            for i in range(n)
        ]
    so = {"so_args": {"regex": "[a-z_ ()=.:,0-9\\n]{1,100000}"}} if kind == "structured" else {}
    return [SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, **so) for _ in range(n)]


def code_tokenizer(eng: LLMEngine, model_name: str) -> Any:
    return eng.tokenizer if model_name == "tiny" else None


def run(
    eng: LLMEngine, prompts: list[list[int]], gen: int, tag: str, params: list[SamplingParams] | None = None
) -> tuple[dict[str, list[int]], float, int]:
    """({request id: output tokens}, wall seconds, engine steps) of one batch stepped to the end; greedy
    unless ``params`` gives each prompt its own. Streamed as a server streams (``DELTA`` outputs every step,
    text detokenised incrementally), the tokens collected from the deltas."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(
            f"{tag}-{i}", p, sp if params is None else params[i], output_kind=RequestOutputKind.DELTA
        )
    out: dict[str, list[int]] = {}
    sync()
    s0, t0 = eng.stats.steps, time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished and not o.ok:
                raise RuntimeError(f"{o.request_id} failed: {o.error}")
            out.setdefault(o.request_id, []).extend(o.token_ids)
    sync()
    return out, time.perf_counter() - t0, eng.stats.steps - s0


def gpu_idle(
    eng: LLMEngine,
    prompts: list[list[int]],
    gen: int,
    tag: str,
    params: list[SamplingParams] | None = None,
) -> tuple[float, dict[str, float]]:
    """Idle share of the decode phase (prefill the batch, then profile the remaining steps) and the
    engine's overlap counters over the same steps; greedy unless ``params`` gives each prompt its own."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(
            f"{tag}-{i}", p, sp if params is None else params[i], output_kind=RequestOutputKind.DELTA
        )
    start = eng.stats.tokens_sampled
    while eng.has_unfinished() and eng.stats.tokens_sampled - start < len(prompts) * 2:
        eng.step()  # prefill and the first decode steps (graph capture) stay out of the window
    sync()
    st0 = attrs.asdict(eng.stats)
    if not torch.cuda.is_available():  # the CPU smoke run: nothing to profile
        while eng.has_unfinished():
            eng.step()
        return float("nan"), overlap_stats(st0, attrs.asdict(eng.stats))
    marks = StepMarks(eng)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        sync()
        wall = time.perf_counter() - t0
    marks.remove()
    # decode-phase tokens: every request runs to max_tokens (ignore_eos), less what the steps before the
    # window sampled (exact without drafts; with drafts accepted tokens are not all sampled: not reported)
    in_window = len(prompts) * gen - (st0["tokens_sampled"] - start)
    ov = {
        **overlap_stats(st0, attrs.asdict(eng.stats)),
        "idle_between_steps_pct": marks.idle_between_pct(),
        "idle_starved_pct": 100 * starved_seconds(prof, STARVED_GAP_US) / wall,
        "decode_tokens_per_s": in_window / wall if eng.drafts is None else float("nan"),
    }
    return max(0.0, 100 - 100 * busy_seconds(prof) / wall), ov


STARVED_GAP_US = 10.0  # a device gap this long is the host being late; shorter ones are launch latency


def device_spans(prof: Any) -> list[tuple[float, float]]:
    """Sorted (start, end) microseconds of a profile's device activities (kernels, copies, memsets)."""
    return sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, "time_range", None) is not None
    )


def starved_seconds(prof: Any, min_gap_us: float) -> float:
    """Total length of the gaps of at least ``min_gap_us`` between device activities: time the GPU had
    nothing queued (between steps or inside one), leaving out the ~1-3 us launch latency between queued
    kernels (a CUDA graph of ~800-2,300 kernels has one such gap per kernel) that the union figure counts."""
    spans, gap, end = device_spans(prof), 0.0, None
    for s, e in spans:
        if end is not None and s - end >= min_gap_us:
            gap += s - end
        end = e if end is None else max(end, e)
    return gap / 1e6


class StepMarks:
    """Timing events on the stream around each step's device work (from the executor's ``execute`` to the
    end of ``StepRunner.run``: the executor's launches and the sampler's). The GPU reaches a step's start event only once it is done with everything
    queued before it, so ``start[k + 1] - end[k]`` is the time the stream sat empty between step k's last
    queued work and step k + 1's first (zero when the host had queued step k + 1 in time). Gaps between
    kernels inside a step (a graph's own launch gaps, the eager Engram fetch) and host work inside
    ``execute`` before its first launch are not counted here: the kernel-union figure (``gpu_idle_pct``)
    counts everything, ``idle_starved_pct`` every device gap of >= 10 us, wherever it falls."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng, self.orig, self.orig_ex = eng, eng.runner.run, eng.executor.execute
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        start: list[torch.cuda.Event | None] = [None]

        def executed(*a: Any, **kw: Any) -> Any:  # the step's device work starts here, not at run's entry
            if start[0] is None:
                start[0] = torch.cuda.Event(enable_timing=True)
                start[0].record()
            return self.orig_ex(*a, **kw)

        def marked(*a: Any, **kw: Any) -> Any:
            start[0] = None
            try:
                return self.orig(*a, **kw)
            finally:
                if start[0] is not None:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    self.spans.append((start[0], e))

        eng.runner.run = marked  # type: ignore[method-assign]
        eng.executor.execute = executed  # type: ignore[method-assign]

    def remove(self) -> None:
        self.eng.runner.run = self.orig  # type: ignore[method-assign]
        self.eng.executor.execute = self.orig_ex  # type: ignore[method-assign]

    def idle_between_pct(self) -> float:
        """Share of the marked window (first start to last end) that the stream sat empty between steps."""
        if len(self.spans) < 2:
            return float("nan")
        torch.cuda.synchronize()
        gaps = sum(max(0.0, e0.elapsed_time(s1)) for (_, e0), (s1, _) in zip(self.spans, self.spans[1:]))
        total = self.spans[0][0].elapsed_time(self.spans[-1][1])
        return 100 * gaps / max(total, 1e-9)


def overlap_stats(st0: dict[str, Any], st1: dict[str, Any]) -> dict[str, float]:
    steps = max(st1["steps"] - st0["steps"], 1)
    return {
        "overlap_share": (st1["overlap_steps"] - st0["overlap_steps"]) / steps,
        "host_wait_share": (st1["host_wait_steps"] - st0["host_wait_steps"]) / steps,
        "land_wait_ms_per_step": 1e3 * (st1["land_wait_s"] - st0["land_wait_s"]) / steps,
    }


def busy_seconds(prof: Any) -> float:
    """GPU busy time of a profile: the union of its device intervals (kernels, copies, memsets), so two
    streams' overlapping work counts once; the sum of device self times if the events carry no ranges."""
    spans = device_spans(prof)
    if not spans:
        return (
            sum(
                e.self_device_time_total
                for e in prof.key_averages()
                if str(getattr(e, "device_type", "")).endswith("CUDA")
            )
            / 1e6
        )
    busy, (a, b) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > b:
            busy += b - a
            a, b = s, e
        else:
            b = max(b, e)
    return (busy + b - a) / 1e6


def trace_paths(eng: LLMEngine, n: int) -> None:
    """Log which executor path the first ``n`` steps take (sync-free / graphs / plain)."""
    from deepinfer_core.model.decode_step import is_pure_decode

    ex, orig, left = eng.executor, eng.executor.execute, [n]

    def traced(b: Any, **kw: Any) -> Any:  # kw: the overlap's device token feed
        out = orig(b, **kw)
        if left[0] > 0:
            left[0] -= 1
            g = ex.graphs() if ex.sync_free and ex.cuda_graphs else None
            log(
                f"  execute: device={ex.device} sync_free={ex.sync_free} graphs={ex.cuda_graphs} "
                f"rows={b.num_requests} tokens={b.num_tokens} pure_decode={is_pure_decode(b)} "
                f"row_path={ex.row_path and int(b.query_lens.max()) <= ex.backtrack + 1} "
                f"captures={None if g is None else g.captures} replays={None if g is None else g.replays} "
                f"disabled={None if g is None else g.disabled} fed={len(kw['feed'].index) if kw.get('feed') else 0}"
            )
        return out

    ex.execute = traced


def throughput(args: Any, rows: list[dict[str, Any]]) -> None:
    for b, mode, kind in [(b, m, k) for b in args.batches for m in args.modes for k in args.sampling]:
        throughput_point(args, rows, b, mode, kind)


def throughput_point(args: Any, rows: list[dict[str, Any]], b: int, mode: str, kind: str) -> None:
    """One (B, mode, sampling kind) point: the whole run's tokens/s, then the decode phase profiled."""
    params = params_for(kind, b, args.gen)
    eng = make_engine(args.model, b, mode, args.glue, prompt=args.prompt, gen=args.gen)
    if args.trace:
        trace_paths(eng, args.trace)
    prompts = prompts_for(b, args.prompt, eng.vocab_size, b, code_tokenizer(eng, args.model))
    run(eng, prompts[: min(b, 4)], 4, "warm", params)  # JIT / graph capture for the first buckets
    st0 = attrs.asdict(eng.stats)
    toks, wall, steps = run(eng, prompts, args.gen, "run", params)
    n = sum(map(len, toks.values()))
    st1 = attrs.asdict(eng.stats)
    stages = {k: round(1e3 * (st1[k] - st0[k]) / max(steps, 1), 3) for k in st1 if k.endswith("_s")}
    p = {
        "model": args.model,
        "batch": b,
        "mode": mode,
        "sampling": kind,
        "glue": args.glue,
        "fused": args.fused,
        "prompt": args.prompt,
        "gen": args.gen,
    }
    per_gpu, per_user = n / wall, sum(len(t) for t in toks.values()) / len(toks) / wall
    emit(BENCH, p, "tokens_per_s_per_gpu", per_gpu, "tok/s")
    emit(BENCH, p, "tokens_per_s_per_user", per_user, "tok/s")
    emit(BENCH, p, "tokens_per_step", n / max(steps, 1), "tokens")
    emit(BENCH, {**p, "stages_ms_per_step": stages}, "ms_per_step", 1e3 * wall / max(steps, 1), "ms")
    idle, ov = gpu_idle(eng, prompts, args.gen, "idle", params)
    emit(BENCH, {**p, **ov}, "gpu_idle_pct", idle, "%")
    emit(BENCH, p, "gpu_idle_between_steps_pct", ov.get("idle_between_steps_pct", float("nan")), "%")
    emit(BENCH, p, "gpu_idle_starved_pct", ov.get("idle_starved_pct", float("nan")), "%")
    ex = eng.executor
    if ex.cuda_graphs:
        emit(BENCH, p, "graphs_captured", ex.graphs().captures, "count")
        # engine efficiency (#32): decode-phase tokens/s over what back-to-back replays of the last
        # decode graph (this batch, the end context) allow: B tokens a replay
        rep = graph_replay_ms(ex)
        if rep == rep:
            emit(BENCH, p, "executor_replay_ms", rep, "ms")
            emit(BENCH, p, "engine_efficiency", ov["decode_tokens_per_s"] / (b / rep * 1e3), "ratio")
            # end to end (#32): the executor-only bound of the whole run (its prefill chunks run by the
            # executor alone, then gen - 1 decode steps at the replay rate) over the engine's wall time
            pre = executor_prefill_s(eng, prompts)
            emit(BENCH, p, "executor_prefill_s", pre, "s")
            bound = pre + (args.gen - 1) * rep / 1e3
            emit(
                BENCH, {**p, "bound_s": bound, "wall_s": wall}, "e2e_fraction_of_bound", bound / wall, "ratio"
            )
    rows.append({**p, "per_gpu": per_gpu, "per_user": per_user, "idle": idle})
    if args.plot:  # after every point: a run cut at its time limit still leaves the plot so far
        write_plot(args, rows)
    log(
        f"{args.model} B={b} {mode} {kind}: {per_gpu:.0f} tok/s per GPU, {per_user:.1f} per user, idle {idle:.1f}% "
        f"(between steps {ov.get('idle_between_steps_pct', float('nan')):.1f}%, gaps >= 10 us "
        f"{ov.get('idle_starved_pct', float('nan')):.1f}%; overlapped {100 * ov['overlap_share']:.0f}% of steps, waited {ov['land_wait_ms_per_step']:.2f} ms/step)"
    )
    del eng
    torch.cuda.empty_cache()


def executor_prefill_s(eng: LLMEngine, prompts: list[list[int]], reps: int = 2) -> float:
    """Seconds the executor alone takes to prefill ``prompts`` in the engine's chunks (whole steps of at
    most ``max_num_batched_tokens`` tokens, requests packed in order, the last one split), on fresh slots
    and blocks of the idle engine; the last of ``reps`` runs (the first compiles any new shape)."""
    import numpy as np

    from deepinfer_core.model import ForwardBatch

    budget, bs = eng.config.max_num_batched_tokens, eng.config.block_size
    width = -(-max(map(len, prompts)) // bs)
    tables = 1 + np.arange(len(prompts) * width).reshape(len(prompts), width)  # block 0: the null block
    steps: list[list[tuple[int, int, int]]] = []  # (request, start, count)
    done, cur, room = [0] * len(prompts), [], budget
    for i, pr in enumerate(prompts):
        while done[i] < len(pr):
            k = min(room, len(pr) - done[i])
            cur.append((i, done[i], k))
            done[i], room = done[i] + k, room - k
            if room == 0:
                steps, cur, room = [*steps, cur], [], budget
    steps += [cur] if cur else []
    took = 0.0
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for step in steps:
            rq = [i for i, _, _ in step]
            eng.executor.execute(
                ForwardBatch(
                    token_ids=np.concatenate([prompts[i][s : s + k] for i, s, k in step]),
                    query_lens=[k for _, _, k in step],
                    start_pos=[s for _, s, _ in step],
                    block_tables=tables[rq],
                    state_slots=rq,
                    num_logits=[int(s + k == len(prompts[i])) for i, s, k in step],
                )
            )
        sync()
        took = time.perf_counter() - t0
    return took


def invariance(args: Any) -> None:
    """Two target requests, one greedy and one sampled with a seed (temperature 0.8, top-p 0.95, top-k 50),
    alone, then inside 20 random mixes of other greedy and seeded requests (random places, random seeds),
    twice (fresh engines): each target's tokens must be bit-identical every time (batch-invariant mode and
    the seeded sampler, graphs on)."""
    targets = prompts_for(2, args.prompt, 250, 7)
    gen = min(args.gen, 12)  # 42 batches: keep them short
    greedy = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t_params = [
        greedy,
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=4242, max_tokens=gen, ignore_eos=True),
    ]
    rng = random.Random(11)
    results: list[list[list[int]]] = [[], []]
    p = {"model": args.model, "mixes": 20, "runs": 2, "glue": args.glue, "targets": "greedy,seeded"}
    invariance_cost(
        args, args.gen, {"model": args.model, "glue": args.glue, "gen": args.gen, "prompt": args.prompt}
    )
    if args.invariance_only_cost:
        return
    for rep in range(2):
        eng = make_engine(args.model, 64, "sync", args.glue, invariant=True, prompt=args.prompt, gen=args.gen)
        alone, _, _ = run(eng, [*targets, targets[1]], gen, f"alone{rep}", [*t_params, greedy])
        for j in range(2):
            results[j].append(alone[f"alone{rep}-{j}"])
        if rep == 0:  # the seeded target really samples: its tokens are not its greedy ones
            emit(
                BENCH,
                p,
                "seeded_target_differs_from_greedy",
                float(alone["alone0-1"] != alone["alone0-2"]),
                "bool",
            )
        for k in tqdm(range(20), desc=f"invariance run {rep + 1} of 2", mininterval=5):
            n = rng.randrange(1, 23)
            mix = [
                (
                    q,
                    greedy
                    if rng.random() < 0.5
                    else SamplingParams(
                        temperature=rng.choice([0.6, 1.0]),
                        top_p=rng.choice([1.0, 0.9]),
                        seed=rng.randrange(1 << 30),
                        max_tokens=gen,
                        ignore_eos=True,
                    ),
                )
                for q in prompts_for(n, args.prompt, eng.vocab_size, 100 * rep + k)
            ]
            for j in (0, 1):
                mix.insert(rng.randrange(len(mix) + 1), (targets[j], t_params[j]))
            where = [
                next(i for i, (q, sp) in enumerate(mix) if q is targets[j] and sp is t_params[j])
                for j in (0, 1)
            ]
            got, _, _ = run(eng, [q for q, _ in mix], gen, f"mix{rep}-{k}", [sp for _, sp in mix])
            for j in (0, 1):
                results[j].append(got[f"mix{rep}-{k}-{where[j]}"])
        del eng
        same = all(r == rs[0] for rs in results for r in rs)
        emit(
            BENCH,
            {**p, "runs_done": rep + 1, "compared": sum(map(len, results))},
            "batch_invariant_identical",
            float(same),
            "bool",
        )


# the three ways of a step: the default mode, batch-invariant mode batched (one executor call, row-chunked
# products: model/invariant.py) and batch-invariant mode's old per-request loop (StepRunner._execute_each,
# what it falls back to over an executor without the invariant products: invariant_rows = 0 here)
INVARIANT_WAYS = ("default", "invariant", "per_request")


def invariance_cost(args: Any, gen: int, p: dict) -> None:
    """Output tokens/s of the three ways side by side at each ``--invariance-batches`` B (same prompts,
    greedy, sync scheduling), and each way's ratio to the default mode's. The three engines are built
    first and then run in turn, ``--invariance-rounds`` rounds, so load that comes and goes on a shared
    machine hits all three alike; per way the median round. Besides wall time, the process's CPU time
    (``tokens_per_cpu_s``: the reference backend's figure on a contended CPU, one torch thread). The cost
    first in a run: a run cut at its time limit still has it."""
    for b in args.invariance_batches:
        engs = {}
        for way in INVARIANT_WAYS:
            eng = engs[way] = make_engine(
                args.model, b, "sync", args.glue, invariant=way != "default", prompt=args.prompt, gen=gen
            )
            if way == "per_request":
                eng.executor.invariant_rows = 0  # type: ignore[attr-defined]
        prompts = prompts_for(b, args.prompt, engs["default"].vocab_size, 3)
        for eng in engs.values():
            run(eng, prompts[:4], 4, "warm")
            run(eng, prompts, 3, "warm-batch")  # graphs of this batch's bucket captured outside the timing
        wall: dict[str, list[float]] = {w: [] for w in engs}
        cpu: dict[str, list[float]] = {w: [] for w in engs}
        for r in range(args.invariance_rounds):
            for way, eng in engs.items():
                c0 = time.process_time()
                toks, secs, _ = run(eng, prompts, gen, f"run{r}")
                n = sum(map(len, toks.values()))
                wall[way].append(n / secs)
                cpu[way].append(n / (time.process_time() - c0))
        for way in engs:
            q = {**p, "batch": b, "way": way, "batch_invariant": way != "default", "rounds": len(wall[way])}
            for metric, rates, unit in (
                ("tokens_per_s_per_gpu", wall, "tok/s"),
                ("tokens_per_cpu_s", cpu, "tok/cpu-s"),
            ):
                emit(BENCH, q, metric, statistics.median(rates[way]), unit)
                if way != "default":
                    ratio = statistics.median(rates[way]) / statistics.median(rates["default"])
                    emit(BENCH, q, f"{metric}_ratio_to_default", ratio, "ratio")
            log(
                f"invariance cost {args.model} B={b} {way}: {statistics.median(wall[way]):.0f} tok/s wall, "
                f"{statistics.median(cpu[way]):.0f} tok per CPU s"
            )
        del engs


def host_cost(args: Any) -> None:
    """CPU time of an engine decode step with the model's device part stubbed out (the sync-free path's
    host side forced on, ``decode_body`` returning random logits at once): what the host does per step
    that a GPU step would have to hide. Runs on any backend; use ``--backend reference`` on the CPU."""
    import statistics

    from deepinfer_core.model import decode_step

    real = decode_step.decode_body
    for b, mode in [(b, m) for b in args.host for m in args.host_modes]:
        eng = make_engine(args.model, b, mode, False, prompt=args.prompt, gen=10_000)
        eng.executor.sync_free = True

        def stub(ex: Any, inp: Any, capture_ids: tuple = (), logit_rows: Any = None) -> Any:
            n, c = inp.tokens.shape[0], ex.cfg
            return (
                torch.randn(n, c.vocab_size, dtype=ex.dtype, device=ex.device),
                torch.zeros(c.num_hidden_layers, c.n_routed_experts, dtype=torch.long, device=ex.device),
                {},
            )

        sp = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for i, pr in enumerate(
            prompts_for(b, args.prompt, eng.vocab_size, b, code_tokenizer(eng, args.model))
        ):
            eng.add_request(f"h{i}", pr, sp, output_kind=RequestOutputKind.DELTA)
        decode_step.decode_body = stub
        try:
            for _ in range(5):
                eng.step()
            per = []
            for _ in range(7):
                t0 = time.process_time()
                for _ in range(40):
                    eng.step()
                per.append((time.process_time() - t0) / 40)
        finally:
            decode_step.decode_body = real
        emit(
            BENCH,
            {"model": args.model, "batch": b, "backend": BACKEND[0], "mode": mode},
            "host_cpu_us_per_decode_step",
            statistics.median(per) * 1e6,
            "us",
        )
        del eng


def plot(rows: list[dict[str, Any]], path: Path, device: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    models = sorted({r["model"] for r in rows})
    lines = sorted({(r["model"], r["mode"], r.get("sampling", "greedy")) for r in rows})
    for model_name, mode, kind in lines:
        pts = sorted(
            (r["per_user"], r["per_gpu"], r["batch"])
            for r in rows
            if (r["model"], r["mode"], r.get("sampling", "greedy")) == (model_name, mode, kind)
        )
        label = mode if kind == "greedy" else f"{mode} {kind}"
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "o-",
            label=label if len(models) == 1 else f"{model_name} {label}",
        )
        for u, g, b in pts:
            ax.annotate(f"B={b}", (u, g), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    dev = device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")
    ax.set_title(f"engine on {dev} ({', '.join(models)}, glue={rows[0]['glue']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (the shipped checkpoint), tiny-random, or wide; "
        "a comma list runs each in turn (e.g. tiny,wide)",
    )
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--modes", default="sync,async,spec")
    ap.add_argument(
        "--sampling",
        default="greedy",
        help=f"request kinds, comma-separated: {', '.join(SAMPLING)} (each point runs every kind)",
    )
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--glue", action="store_true", help="fused glue on (DEEPINFER_FUSE_GLUE)")
    ap.add_argument(
        "--fused",
        choices=("auto", "on", "off"),
        default="auto",
        help="the one-kernel decode attention, expert GEMM and LM head (DEEPINFER_FUSED_ATTENTION / "
        "_MOE / _HEAD): auto = the executor's default (on where the model's shapes run them)",
    )
    ap.add_argument("--invariance", action="store_true")
    ap.add_argument(
        "--invariance-batches",
        default="64",
        help="with --invariance: the batches of its tokens/s side by side (default, invariant, per_request)",
    )
    ap.add_argument(
        "--invariance-only-cost", action="store_true", help="with --invariance: skip the 20 mixes"
    )
    ap.add_argument("--invariance-rounds", type=int, default=3, help="with --invariance: rounds of the cost")
    ap.add_argument(
        "--host", default="", help="batches for the host-cost section (model stubbed), e.g. 1,16,64"
    )
    ap.add_argument("--host-modes", default="sync,async", help="engine modes of the host-cost section")
    ap.add_argument(
        "--trace", type=int, default=0, help="log the executor path of the first N steps of each run"
    )
    ap.add_argument("--out", default="", help="folder for engine_cuda.png (default benchmarks/out)")
    ap.add_argument("--backend", default="cuda", help="cuda, or reference (CPU: a smoke test of this script)")
    ap.add_argument(
        "--replot", default="", help="re-draw the plot from a recorded run's JSON lines (no engine runs)"
    )
    ap.add_argument("--device-name", default="", help="with --replot: the device named in the title")
    args = ap.parse_args()
    if args.replot:
        rows = rows_from_jsonl(Path(args.replot))
        d = Path(args.out or Path(__file__).parent / "out")
        d.mkdir(parents=True, exist_ok=True)
        plot(rows, d / "engine_cuda.png", args.device_name or None)
        log(f"engine_cuda: {len(rows)} points from {args.replot} -> {d / 'engine_cuda.png'}")
        return
    BACKEND[0] = args.backend
    FUSED[0] = {"auto": None, "on": True, "off": False}[args.fused]
    h = logging.StreamHandler()  # the engine's warnings (e.g. a failed graph capture) on stderr
    h.setLevel(logging.WARNING)
    logging.getLogger("deepinfer_core").addHandler(h)
    if args.backend == "cuda" and not torch.cuda.is_available():
        log("engine_cuda: needs a CUDA device; nothing to measure here")
        return
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.invariance_batches = [int(x) for x in args.invariance_batches.split(",") if x]
    args.host = [int(x) for x in args.host.split(",") if x]
    args.sampling = [k for k in args.sampling.split(",") if k]
    args.modes = [m for m in args.modes.split(",") if m]
    args.host_modes = [m for m in args.host_modes.split(",") if m]
    bad = (set(args.modes) | set(args.host_modes)) - set(MODES)
    if bad:
        raise SystemExit(f"--modes / --host-modes: unknown {sorted(bad)} ({', '.join(MODES)})")
    if args.quick:
        args.batches, args.gen = args.batches[:2], 8
    rows: list[dict[str, Any]] = []
    for model_name in [m for m in args.model.split(",") if m]:  # e.g. tiny,wide in one device call
        args.model = model_name
        if args.host:
            host_cost(args)
            if args.backend != "cuda":
                continue
        if args.batches:
            throughput(args, rows)
        if args.invariance:
            invariance(args)
    if args.plot and rows:
        write_plot(args, rows)


def rows_from_jsonl(path: Path) -> list[dict[str, Any]]:
    """The plot's points of a recorded run: per (model, batch, mode, sampling), its tokens/s per GPU and
    per user (``models``: only those models)."""
    pts: dict[tuple[str, int, str, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        p = r.get("params", {})
        key_of = {
            "tokens_per_s_per_gpu": "per_gpu",
            "tokens_per_s_per_user": "per_user",
            "gpu_idle_pct": "idle",
        }
        if (
            r.get("bench") != "engine_cuda"
            or r.get("metric") not in key_of
            or "batch" not in p
            or "mode" not in p
        ):
            continue
        kind = p.get("sampling", "greedy")
        row = pts.setdefault(
            (p["model"], int(p["batch"]), p["mode"], kind),
            {
                "model": p["model"],
                "batch": int(p["batch"]),
                "mode": p["mode"],
                "sampling": kind,
                "glue": p.get("glue", False),
            },
        )
        row[key_of[r["metric"]]] = r["value"]
    return [r for r in pts.values() if "per_gpu" in r and "per_user" in r]


def write_plot(args: Any, rows: list[dict[str, Any]]) -> None:
    d = Path(args.out or Path(__file__).parent / "out")
    d.mkdir(parents=True, exist_ok=True)
    plot(rows, d / "engine_cuda.png")


if __name__ == "__main__":
    main()
