"""Structured outputs: per-token mask cost and the manager's overhead over bare backend calls.

(a) Mask cost: a batch of 1-256 constrained requests decoding with random logits (tokens drawn uniformly
    from each mask, so states vary over strings, numbers, keys); per step we time the masks of every row.
    Grammars: a JSON schema (nested object, strings, integers, enum, array) and a regex; vocabularies: the
    byte tokenizer (512 ids) and a synthetic byte-level BPE of ~128k tokens (trained once with
    ``tokenizers`` and cached under benchmarks/out/); backends: xgrammar and llguidance.
(b) Manager overhead: on the same states, ``StructuredOutputManager.fill_bitmask`` (bookkeeping, draft
    cuts, dead-row pass, padding, copies of unused draft rows) against "bare": the same library calls
    made directly, as cheaply as the libraries allow and as the manager's fast path makes them
    (xgrammar: its C++ handles and one ``BatchGrammarMatcher`` call per draft depth on one thread;
    llguidance: one ``unsafe_compute_mask_ptr`` per row), accept and rollback by hand, the library
    objects gathered from a dict by request id (an engine holding them itself does the same);
    "bare_list" skips even that gather (a lower bound). Also timed: the manager's general path (round
    1's code path, ``general_*``), the naive loop of one public-API call per row, and for llguidance
    its ``LLExecutor`` on one thread. With 0 and 3 drafts per request.
Timing: process CPU time (``time.process_time``), minimum of 7 interleaved repeats per step (each repeat
times enough back-to-back calls to span ~1 ms; variants in a random order each repeat, all filling the
manager's own buffer), summed over 12 steps: the machine is shared, and CPU time of the one thread that
fills masks is what contention distorts least. Absolute CPU numbers are indicative; ratios measured
side by side are the result.
(c) Compile time of each grammar (cold, no cache) per backend and vocabulary.
(d) ``--schemas DIR``: issue #20's table instead: every real-world JSON schema of the sample under DIR
    (JSONSchemaBench files; ../shared/data/jsonschema-dev has 200) through the manager per backend
    (xgrammar, llguidance, auto), byte vocabulary, random sampling under the mask
    (``deepinfer_core.structured.evaluate``): compiled / valid / invalid-but-stop / violations caught,
    and the mask cost per token; each backend also once with the byte filter and the check off
    ("engine only"), so what the guarantees cost per token is measured in the same run.

    python benchmarks/structured.py [--quick] [--plot] [--only xgrammar/byte] [--batches 1,16]
    python benchmarks/structured.py --schemas ../shared/data/jsonschema-dev [--max-tokens 4096]
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch
from tqdm import tqdm

from _common import emit, log, out_path, parser
from deepinfer_core.structured import GrammarSpec, StructuredOutputManager, make_backend
from deepinfer_core.structured.synthetic_vocab import EOS, cached_bpe
from deepinfer_core.tokenizer import ByteTokenizer, HFTokenizer

BENCH = "structured"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z]{2,10}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})? ([A-Z][a-z]{2,12} ){1,4}\((kg|lb|oz)\) [a-z]{3,10}@[a-z]{2,8}\.(com|org)"
GRAMMARS = {"json_schema": GrammarSpec("json_schema", SCHEMA), "regex": GrammarSpec("regex", REGEX)}


def _tokenizers(quick: bool) -> dict[str, object]:
    # --quick (CI smoke) trains a 16k vocabulary in seconds instead of the 128k one.
    size = 16_000 if quick else 128_000
    name = f"bpe{size // 1000}k"
    toks: dict[str, object] = {"byte": ByteTokenizer()}
    path = out_path(f"synthetic_{name}.json")
    log(f"BPE vocab: {path} ({'cached' if path.exists() else 'training it once'})")
    toks[name] = HFTokenizer(cached_bpe(path, size), eos_token=EOS)
    return toks


class _Walk:
    """``batch`` requests of one spec, advanced with tokens drawn uniformly from their masks."""

    def __init__(self, mgr: StructuredOutputManager, spec: GrammarSpec, batch: int, seed: int) -> None:
        self.mgr, self.spec, self.rng = mgr, spec, np.random.default_rng(seed)
        self.next_id = 0
        self.ids = [self._new() for _ in range(batch)]
        mgr.wait(self.ids)
        self.V = mgr.vocab_size

    def _new(self) -> int:
        rid = self.next_id
        self.next_id += 1
        self.mgr.add_request(rid, self.spec)
        return rid

    def _sample(self, row: torch.Tensor) -> int:
        bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: self.V]
        ok = np.flatnonzero(bits)
        return int(self.rng.choice(ok))

    def step(self, bitmask: torch.Tensor, offsets: np.ndarray) -> None:
        """Commit one token per request from its row 0; finished requests are replaced by fresh ones."""
        for j, rid in enumerate(list(self.ids)):
            self.mgr.advance(rid, [self._sample(bitmask[int(offsets[j])])])
            if self.mgr.finish_reason(rid) is not None:
                self.mgr.remove_request(rid)
                self.ids[j] = self._new()
        self.mgr.wait(self.ids)

    def drafts(self, k: int) -> list[list[int]]:
        """k grammatical drafts per request (stepped on the request's own matcher and rolled back)."""
        out, words = [], (self.V + 31) // 32
        buf = torch.zeros((1, words), dtype=torch.int32)
        for rid in self.ids:
            m, d = self.mgr.matcher(rid), []
            for _ in range(k):
                m.fill_next_token_bitmask(buf, 0)
                if not buf.any() or m.is_terminated():
                    break
                t = self._sample(buf[0])
                if not m.accept_token(t):
                    break
                d.append(t)
                if m.is_terminated():
                    break
            m.rollback(len(d))
            out.append(d)
        return out


def _bare_fill(raws: list, drafts: list[list[int]], buf: torch.Tensor, eos: int, llg: bool) -> None:
    """One public-API library call per row (what a batch API saves), drafts stepped by hand."""
    row, nbytes, ptr = 0, buf.shape[1] * 4, buf.data_ptr()
    for raw, d in zip(raws, drafts):
        if llg:
            raw.unsafe_compute_mask_ptr(ptr + row * nbytes, nbytes)
        else:
            raw.fill_next_token_bitmask(buf, row)
        n = 0
        for t in d:
            # EOS ends a draft (its row is a copy); a rejected token cuts it.
            if t == eos or (raw.try_consume_tokens([t]) != 1 if llg else not raw.accept_token(t)):
                break
            n += 1
            if llg:
                raw.unsafe_compute_mask_ptr(ptr + (row + n) * nbytes, nbytes)
            else:
                raw.fill_next_token_bitmask(buf, row + n)
        if n:
            raw.rollback(n)
        row += 1 + len(d)


def _bare_wavefront(
    raws: list, drafts: list[list[int]] | None, eos: int, fill_many: object, accept: object
) -> None:
    """The manager's work done directly on the library objects: one batch fill per draft depth.

    ``drafts=None``: a draft-free step (the caller knows; no check), one call for rows 0..n-1. No
    padding/dead-row pass, no copies of unused draft rows: those are the manager's own (counted as
    overhead).
    """
    if drafts is None:
        fill_many(raws, None)
        return
    offsets, row = [], 0
    for d in drafts:
        offsets.append(row)
        row += 1 + len(d)
    fill_many(raws, offsets)
    acc, active, depth = [0] * len(raws), [i for i, d in enumerate(drafts) if d], 0
    while active:
        depth += 1
        go, rows, nxt = [], [], []
        for i in active:
            t = drafts[i][depth - 1]
            if t == eos or not accept(raws[i], t):
                continue
            acc[i] = depth
            go.append(raws[i])
            rows.append(offsets[i] + depth)
            if len(drafts[i]) > depth:
                nxt.append(i)
        if go:
            fill_many(go, rows)
        active = nxt
    for raw, a in zip(raws, acc):
        if a:
            raw.rollback(a)


def _library_calls(
    backend_name: str, buf: torch.Tensor, executor: bool = False
) -> tuple[object, object, object]:
    """(raw object of a wrapper, ``fill_many(raws, rows or None)``, ``accept(raw, token)``), the cheapest
    library calls the manager's fast path makes. xgrammar: its C++ handles (under the public classes,
    which add ~3 us per batch call and ~60 ns per matcher) and ``BatchGrammarMatcher`` on one thread;
    llguidance: one ``unsafe_compute_mask_ptr`` per matcher (or, with ``executor``, its LLExecutor)."""
    if backend_name == "xgrammar":
        import xgrammar as xgr

        bgm = xgr.BatchGrammarMatcher(1)._handle
        return (
            (lambda w: w.raw._handle),
            (lambda raws, rows: bgm.batch_fill_next_token_bitmask(raws, buf, rows, False)),
            (lambda h, t: h.accept_token(t, False)),
        )
    import llguidance as llg

    nbytes, ptr = buf.shape[1] * 4, buf.data_ptr()
    accept = lambda raw, t: raw.try_consume_tokens([t]) == 1  # noqa: E731
    if executor:
        ex = llg.LLExecutor(num_threads=1)

        def via_executor(raws: list, rows: list[int] | None) -> None:
            ex.unsafe_compute_mask_ptr(
                list(zip(raws, range(len(raws)) if rows is None else rows)), ptr, nbytes, buf.shape[0]
            )

        return (lambda w: w.raw), via_executor, accept

    def per_matcher(raws: list, rows: list[int] | None) -> None:
        if rows is None:
            p = ptr
            for raw in raws:
                raw.unsafe_compute_mask_ptr(p, nbytes)
                p += nbytes
            return
        for raw, r in zip(raws, rows):
            raw.unsafe_compute_mask_ptr(ptr + r * nbytes, nbytes)

    return (lambda w: w.raw), per_matcher, accept


def bench_masks(
    toks: dict[str, object], quick: bool, only: str | None = None, batches_arg: str | None = None
) -> list[dict]:
    batches = (1, 16) if quick else (1, 4, 16, 64, 256)
    if batches_arg:
        batches = tuple(int(b) for b in batches_arg.split(","))
    steps = 3 if quick else 12
    reps = 2 if quick else 7
    results = []
    combos = [(b, v, g) for b in ("xgrammar", "llguidance") for v in toks for g in GRAMMARS]
    if only:  # e.g. "llguidance/byte" or "xgrammar/bpe128k/json_schema": a subset of the configurations
        combos = [c for c in combos if only in "/".join(c)]
    for backend_name, vocab, gname in tqdm(combos, desc="masks"):
        # One mask thread: CPU time then measures work, not a thread pool spinning on 2 shared cores.
        backend = make_backend(backend_name, toks[vocab], mask_threads=1)
        spec = GRAMMARS[gname]
        t0 = time.perf_counter()
        backend.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        p = {"backend": backend_name, "vocab": vocab, "vocab_size": backend.vocab_size, "grammar": gname}
        emit(BENCH, p, "compile_ms", round(compile_ms, 2), "ms")
        for batch in batches:
            for k in (0, 3) if batch in (16, 64) else (0,):
                mgr = StructuredOutputManager(backend, compile_workers=1)
                walk = _Walk(mgr, spec, batch, seed=batch)
                # The bare variants fill the same rows of the same memory as the manager (its own buffer,
                # sized once here): separate buffers let whichever variant ran just before warm the
                # cache for the next, a bias of up to tens of percent at 128k x 256 rows.
                mgr._fast_view(batch * (1 + k))
                buf = mgr._buf[: batch * (1 + k)]
                raw_of, fill_many, accept = _library_calls(backend_name, buf)
                eos, llg = backend.eos_token_id, backend_name == "llguidance"
                # bare: gathers this step's library objects from a dict by request id, as an engine
                # holding them itself would; bare_list: the list prebuilt (a lower bound, no gather).
                # general: the manager's general path (round 1's code path, kept as the reference), for a
                # before/after in the same run.
                times: dict[str, list[float]] = {
                    "mgr": [],
                    "general": [],
                    "bare": [],
                    "bare_list": [],
                    "serial": [],
                }
                if llg:
                    times["executor"] = []
                    _, fill_exec, _ = _library_calls(backend_name, buf, executor=True)
                rows_total = 0
                order_rng = np.random.default_rng(batch + 1000 * k)
                out: list = []
                raws_by_id: dict = {}
                prebuilt: list = []

                def run(which: str) -> None:
                    if which == "mgr":
                        out.append(mgr.fill_bitmask(batch_arg))  # noqa: B023
                        return
                    if which == "general":
                        mgr._fill_general(batch_arg)  # noqa: B023
                        return
                    d = drafts if k else None  # noqa: B023
                    if which == "bare":
                        raws = [raws_by_id[r] for r in walk.ids]  # noqa: B023
                        _bare_wavefront(raws, d, eos, fill_many, accept)  # noqa: B023
                    elif which == "bare_list":
                        _bare_wavefront(prebuilt, d, eos, fill_many, accept)  # noqa: B023
                    elif which == "executor":
                        _bare_wavefront(prebuilt, d, eos, fill_exec, accept)  # noqa: B023
                    else:
                        _bare_fill([mgr.matcher(r).raw for r in walk.ids], drafts, buf, eos, llg)  # noqa: B023

                for s in range(steps + 1):
                    drafts = walk.drafts(k) if k else [[] for _ in walk.ids]
                    batch_arg = list(zip(walk.ids, drafts))
                    raws_by_id = {r: raw_of(mgr.matcher(r)) for r in walk.ids}
                    prebuilt = [raws_by_id[r] for r in walk.ids]
                    # fill_bitmask leaves the matchers where they were, so all variants are repeated on
                    # the same states, interleaved in a random order; the minimum CPU time of each is
                    # kept (robust on a shared box).
                    # Cheap steps are timed over `inner` back-to-back calls (each leaves the states
                    # unchanged) so one sample spans >= ~1 ms of CPU, far above the clock's cost.
                    t0 = time.process_time()
                    run("mgr")
                    inner = int(min(400, max(1, 1e-3 / max(time.process_time() - t0, 1e-6))))
                    best = dict.fromkeys(times, float("inf"))
                    for rep in range(reps):
                        for which in order_rng.permutation(list(times)):  # no variant always follows another
                            t0 = time.process_time()
                            for _ in range(inner):
                                run(which)
                            best[which] = min(best[which], (time.process_time() - t0) / inner)
                        if rep >= 1 and best["mgr"] > 0.05:  # slow configurations: 2 repeats suffice
                            break
                    bm = out[-1]
                    out.clear()
                    if s > 0:  # step 0 warms up
                        for key in times:
                            times[key].append(best[key])
                        rows_total += bm.num_rows
                    walk.step(bm.bitmask, bm.offsets)
                mgr.close()
                us = {key: sum(v) / rows_total * 1e6 for key, v in times.items()}
                q = {**p, "batch": batch, "drafts": k, "steps": steps}
                emit(BENCH, q, "mask_us_per_token", round(us["mgr"], 3), "us")
                emit(BENCH, q, "bare_batch_us_per_token", round(us["bare"], 3), "us")
                emit(BENCH, q, "bare_list_us_per_token", round(us["bare_list"], 3), "us")
                emit(BENCH, q, "bare_serial_us_per_token", round(us["serial"], 3), "us")
                emit(BENCH, q, "manager_overhead_pct", round(100 * (us["mgr"] / us["bare"] - 1), 2), "%")
                emit(BENCH, q, "general_us_per_token", round(us["general"], 3), "us")
                emit(BENCH, q, "general_overhead_pct", round(100 * (us["general"] / us["bare"] - 1), 2), "%")
                emit(
                    BENCH,
                    q,
                    "manager_overhead_vs_list_pct",
                    round(100 * (us["mgr"] / us["bare_list"] - 1), 2),
                    "%",
                )
                emit(
                    BENCH,
                    q,
                    "manager_overhead_us_per_step",
                    round((sum(times["mgr"]) - sum(times["bare"])) / steps * 1e6, 3),
                    "us",
                )
                emit(BENCH, q, "batch_api_speedup", round(us["serial"] / us["bare"], 3), "x")
                if llg:
                    emit(BENCH, q, "llexecutor_us_per_token", round(us["executor"], 3), "us")
                results.append({**q, "us": us["mgr"], "bare_us": us["bare"]})
    return results


def bench_schemas(root: str, max_tokens: int, seed: int) -> None:
    """(d): the table per backend on every schema under ``root`` (see the module docstring)."""
    from deepinfer_core.structured.evaluate import load_sample, run_sample, summarize

    tok = ByteTokenizer()
    schemas = load_sample(root)
    rows = []
    variants = [(b, g) for b in ("xgrammar", "llguidance", "auto") for g in (True, False)]
    for name, guarded in tqdm(variants, desc="backends"):
        backend = make_backend(name, tok, mask_threads=1)
        mgr = StructuredOutputManager(backend, compile_workers=1, utf8=guarded, validate=guarded)
        outs = run_sample(mgr, name, schemas, backend.vocab.token_bytes, seed=seed, max_tokens=max_tokens)
        mgr.close()
        s = summarize(outs)
        p = {
            "backend": name,
            "guarantees": guarded,
            "vocab": "byte",
            "max_tokens": max_tokens,
            "schemas": len(schemas),
        }
        for metric in ("compiled", "valid", "invalid_stop", "violation", "dead_end", "length", "unchecked"):
            emit(BENCH, p, metric, s.get(metric, 0), "schemas")
        emit(BENCH, p, "compiled_pct", s["compiled_pct"], "%")
        emit(BENCH, p, "valid_pct", s["valid_pct"], "%")
        emit(BENCH, p, "mask_us_per_token", s["mask_us_per_token"], "us")
        emit(BENCH, p, "advance_us_per_token", s["advance_us_per_token"], "us")
        for e in ("xgrammar", "llguidance"):
            if s.get(f"served_{e}"):
                emit(BENCH, p, f"served_{e}", s[f"served_{e}"], "schemas")
        rows.append((name, guarded, s))
    guarded = {n: s for n, g, s in rows if g}
    own = {n: s for n, g, s in rows if not g}
    fastest = min(own["xgrammar"]["mask_us_per_token"], own["llguidance"]["mask_us_per_token"])
    fastest_g = min(guarded["xgrammar"]["mask_us_per_token"], guarded["llguidance"]["mask_us_per_token"])
    emit(
        BENCH,
        {"backend": "auto", "vs": "faster engine alone, guarantees off"},
        "mask_cost_ratio",
        round(guarded["auto"]["mask_us_per_token"] / fastest, 3),
        "x",
    )
    emit(
        BENCH,
        {"backend": "auto", "vs": "faster engine, guarantees on"},
        "mask_cost_ratio",
        round(guarded["auto"]["mask_us_per_token"] / fastest_g, 3),
        "x",
    )
    log(f"\n{len(schemas)} schemas, byte vocabulary, max_tokens {max_tokens}, seed {seed}")
    log(
        "| backend | guarantees | compiled | valid | invalid `stop` | `grammar_violation` | length | mask us/token | advance us/token |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    for n, g, s in rows:
        log(
            f"| {n} | {'on' if g else 'off'} | {s['compiled']} ({s['compiled_pct']}%) | {s.get('valid', 0)} ({s['valid_pct']}%) | "
            f"{s.get('invalid_stop', 0)} | {s.get('violation', 0)} | {s.get('length', 0)} | {s['mask_us_per_token']} | "
            f"{s['advance_us_per_token']} |"
        )


def _plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    series: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        if r["drafts"] == 0:
            series[(r["vocab"], r["backend"], r["grammar"])].append((r["batch"], r["us"]))
    vocabs = sorted({r["vocab"] for r in results}, key=lambda v: v != "byte")
    for ax, vocab in zip(axes, vocabs):
        for (v, b, g), pts in sorted(series.items()):
            if v == vocab:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=f"{b} / {g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("mask time per token (us, CPU)")
        ax.set_title(f"vocab: {vocab}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_path("structured_mask_cost.png")
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the configurations whose 'backend/vocab/grammar' contains this")
    ap.add_argument("--batches", help="comma-separated batch sizes instead of 1,4,16,64,256")
    ap.add_argument("--schemas", help="a JSON-schema sample directory (manifest.json): run (d) instead")
    ap.add_argument("--max-tokens", type=int, default=4096, help="(d): tokens per document at most")
    ap.add_argument("--seed", type=int, default=0, help="(d): sampling seed")
    args = ap.parse_args()
    torch.set_num_threads(1)  # masks are filled on the calling thread; keep torch's pool out of the way
    if args.schemas:
        bench_schemas(args.schemas, args.max_tokens, args.seed)
        return
    toks = _tokenizers(args.quick)
    results = bench_masks(toks, args.quick, args.only, args.batches)
    if args.plot:
        _plot(results)


if __name__ == "__main__":
    main()
