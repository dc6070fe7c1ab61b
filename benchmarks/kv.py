"""KV memory: block-pool op throughput at 1k-100k live sequences, batched block-table export, prefix match
cost per block, and the torch-reference cache formats.

(a) Pool ops with N live sequences (random lengths 64-4096 tokens, block size 64): allocate+free of a new
    sequence, fork+free, append of one token, each timed per op through the Python wrapper
    (``PagedKVPool``) and through the raw binding (``pool.impl``), side by side.
(b) One decode step's bookkeeping for all N sequences: ``append_slots_many`` (one C++ call) vs a Python
    loop over ``impl.append_slots``; block-table export ``block_tables(ids)`` (one call, int32 [N, W]) vs
    a Python loop of ``block_table(id)`` into a preallocated array.
(c) Prefix index, block size 64: match of a cached prompt of K blocks (cost per block), insert
    (per block), match+allocate in one call (per block).
(d) Formats: quantize/dequantize tokens/s of the torch reference on this CPU (for orientation only;
    device kernels come later).

    python benchmarks/kv.py [--quick] [--plot]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from _common import emit, log, out_path, parser, time_it
from deepinfer_core.kv import PagedKVPool, PrefixIndex, formats

BENCH = "kv"
BS = 64


def side_by_side(fa: Callable[[], object], fb: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median seconds of fa and fb, timed alternately (A B A B ...) so machine-load drift hits both."""
    fa()
    fb()
    ta, tb = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _pool_with(n_seqs: int, rng: np.random.Generator) -> tuple[PagedKVPool, np.ndarray]:
    lens = rng.integers(64, 4097, size=n_seqs)
    need = int(sum(-(-int(x) // BS) for x in lens))
    pool = PagedKVPool(num_blocks=need + n_seqs * 4 + 4096, block_size=BS)
    ids = np.arange(n_seqs, dtype=np.int64)
    ok = pool.allocate_many(ids, lens.astype(np.int64))
    assert ok.all()
    return pool, ids


def bench_ops(sizes: tuple[int, ...], quick: bool) -> dict[str, list[tuple[int, float]]]:
    rng = np.random.default_rng(0)
    series: dict[str, list[tuple[int, float]]] = {}
    reps = 2000 if quick else 20000
    for n in tqdm(sizes, desc="pool ops", disable=quick):
        _ops_at(n, reps, rng, series)
    return series


def _ops_at(n: int, reps: int, rng: np.random.Generator, series: dict[str, list[tuple[int, float]]]) -> None:
    pool, ids = _pool_with(n, rng)
    impl = pool.impl
    fresh = 10**9
    picks = rng.integers(0, n, size=reps)

    def alloc_free_wrapper() -> None:
        for _ in range(reps):
            pool.allocate(fresh, 1000)
            pool.free(fresh)

    def alloc_free_impl() -> None:
        for _ in range(reps):
            impl.allocate(fresh, 1000)
            impl.free(fresh)

    def fork_free_impl() -> None:
        for s in picks:
            impl.fork(int(s), fresh)
            impl.free(fresh)

    def fork_free_wrapper() -> None:
        for s in picks:
            pool.fork(int(s), fresh)
            pool.free(fresh)

    def append_impl() -> None:
        for s in picks:
            impl.append_slots(int(s), 1)

    def append_wrapper() -> None:
        for s in picks:
            pool.append_slots(int(s), 1)

    p = {"live_seqs": n, "block_size": BS, "ops": reps}
    for name, fi, fw in (
        ("allocate_free", alloc_free_impl, alloc_free_wrapper),
        ("fork_free", fork_free_impl, fork_free_wrapper),
        ("append1", append_impl, append_wrapper),
    ):
        ti, tw = side_by_side(fi, fw, rounds=5)
        emit(BENCH, p, f"{name}_impl", ti / reps * 1e9, "ns/op")
        emit(BENCH, p, f"{name}_wrapper", tw / reps * 1e9, "ns/op")
        series.setdefault(f"{name}_impl", []).append((n, ti / reps * 1e9))

    # (b) one decode step for all sequences
    def step_batched() -> None:
        impl.append_slots_many(ids, 1)

    def step_loop() -> None:
        for s in ids.tolist():
            impl.append_slots(s, 1)

    tb, tl = side_by_side(step_batched, step_loop, rounds=7)
    emit(BENCH, p, "decode_append_batched", tb / n * 1e9, "ns/seq")
    emit(BENCH, p, "decode_append_python_loop", tl / n * 1e9, "ns/seq")
    emit(BENCH, p, "decode_append_speedup", tl / tb, "x")
    series.setdefault("decode_append_batched", []).append((n, tb / n * 1e9))

    width = int(pool.block_tables(ids).shape[1])
    out = np.zeros((n, width), dtype=np.int32)

    def export_batched() -> None:
        pool.block_tables(ids)

    def export_into() -> None:
        impl.fill_block_tables(ids, out)

    def export_loop() -> None:
        for i, s in enumerate(ids.tolist()):
            row = impl.block_table(s)
            out[i, : len(row)] = row
            out[i, len(row) :] = 0

    te, tx = side_by_side(export_batched, export_loop, rounds=5)
    ti = time_it(export_into, repeat=5, warmup=1)
    pe = {**p, "width": width}
    emit(BENCH, pe, "block_tables_export", te * 1e3, "ms")
    emit(BENCH, pe, "block_tables_export_per_seq", te / n * 1e9, "ns/seq")
    emit(BENCH, pe, "block_tables_fill_into_per_seq", ti / n * 1e9, "ns/seq")
    emit(BENCH, pe, "block_tables_python_loop_per_seq", tx / n * 1e9, "ns/seq")
    emit(BENCH, pe, "block_tables_export_speedup", tx / te, "x")
    series.setdefault("block_tables_export", []).append((n, te / n * 1e9))
    pool.check_invariants()


def bench_prefix(quick: bool) -> list[tuple[int, float]]:
    rng = np.random.default_rng(1)
    return [(k, _prefix_at(k, rng)) for k in ((16, 256) if quick else (16, 64, 256, 1024))]


def _prefix_at(k: int, rng: np.random.Generator) -> float:
    pool = PagedKVPool(num_blocks=4 * k + 16, block_size=BS)
    idx = PrefixIndex(pool)
    toks = rng.integers(0, 129280, size=k * BS).astype(np.int32)
    assert pool.allocate(1, len(toks))
    impl = pool.impl

    def insert() -> None:
        impl.cache_seq(1, toks, b"")

    t_ins_first = time_it(insert, repeat=1, warmup=0)  # first call creates the entries
    t_ins = time_it(insert, repeat=5, warmup=1)  # later calls walk existing entries
    hit = idx.match(toks)
    assert hit[0] == len(toks)

    def match() -> None:
        impl.match(toks, b"")

    def alloc_cached() -> None:
        impl.allocate_cached(2, toks, b"")
        impl.free(2)

    t_m = time_it(match, repeat=7, number=20, warmup=2)
    t_a = time_it(alloc_cached, repeat=7, number=20, warmup=2)
    p = {"blocks": k, "block_size": BS}
    emit(BENCH, p, "prefix_insert_new_per_block", t_ins_first / k * 1e9, "ns/block")
    emit(BENCH, p, "prefix_insert_existing_per_block", t_ins / k * 1e9, "ns/block")
    emit(BENCH, p, "prefix_match_per_block", t_m / k * 1e9, "ns/block")
    emit(BENCH, p, "prefix_match_allocate_free_per_block", t_a / k * 1e9, "ns/block")
    return t_m / k * 1e9


def bench_formats(quick: bool) -> None:
    t = 256 if quick else 4096
    for name in ("fp4", "fp8", "mxfp4", "v32", "bf16"):
        f = formats.get_format(name)
        x = torch.randn(t, f.dim)
        b = f.quantize(x)
        tq = time_it(lambda: f.quantize(x), repeat=3)  # noqa: B023
        td = time_it(lambda: f.dequantize(b), repeat=3)  # noqa: B023
        p = {"format": name, "dim": f.dim, "tokens": t, "device": "cpu", "threads": torch.get_num_threads()}
        emit(BENCH, p, "quantize_tokens_per_s", t / tq, "tokens/s")
        emit(BENCH, p, "dequantize_tokens_per_s", t / td, "tokens/s")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    sizes = (1000,) if args.quick else (1000, 10000, 100000)
    log("pool ops ...")
    series = bench_ops(sizes, args.quick)
    log("prefix index ...")
    pref = bench_prefix(args.quick)
    log("formats ...")
    bench_formats(args.quick)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name, pts in series.items():
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("live sequences")
        a.set_ylabel("ns per op / per sequence")
        a.legend(fontsize=7)
        b.plot([p[0] for p in pref], [p[1] for p in pref], marker="o")
        b.set_xscale("log")
        b.set_xlabel("cached prompt blocks (64 tokens)")
        b.set_ylabel("match ns per block")
        fig.tight_layout()
        path = out_path("kv.png")
        fig.savefig(path, dpi=110)
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
