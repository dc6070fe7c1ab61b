"""Engram: hash throughput (tokens/s) and fetch throughput (rows/s) for local, host and sharded tables.

(a) Hash: ``EngramHasher.hash`` end to end (canonical map, n-gram builder, ``engram_hash`` op) and the op
    alone, V4.1-Flash shape (2 layers x 3 orders x 8 heads, ~384M-row tables), packed batches of 1k-64k
    tokens; on a CUDA machine also the op on the GPU and tile_kernels' engram_hash when importable.
(b) Fetch: rows of 256 values (bf16 and fp8 + scales) for ids drawn like hashed n-grams (uniform over
    the table), from a LocalEngramTable, a HostEngramTable (pinned + copy when CUDA exists; on a CPU-only
    machine it is a plain host gather) and a ShardedEngramTable over 2 gloo processes on this machine
    (rows/s seen by one rank; every rank fetches the same number of ids at once). Side by side in one run.

    python benchmarks/engram.py [--quick] [--plot]
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from _common import emit, log, out_path, parser, time_it
from deepinfer_core.engram import (
    EngramConfig,
    EngramHasher,
    HostEngramTable,
    LocalEngramTable,
    ShardedEngramTable,
    make_storage,
    shard_range,
)
from deepinfer_kernels import get_op

BENCH = "engram"
ROW_DIM = 256


def _packed(cfg: EngramConfig, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    cu = torch.arange(0, t, 512)  # sequences of 512 tokens
    return toks, torch.cat([cu, torch.tensor([t])])


def bench_hash(quick: bool) -> list[tuple[str, int, float]]:
    cfg = EngramConfig.v41_flash()
    h = EngramHasher(cfg)
    op = get_op("engram_hash")
    out = []
    sizes = (1024, 16384) if quick else (1024, 4096, 16384, 65536)
    for t in tqdm(sizes, desc="hash", disable=quick):
        toks, cu = _packed(cfg, t)
        grams = h.ngram_token_ids(toks, cu)
        m, p, o = h.device_params("cpu")
        rep = 3 if quick else 7
        p_ = {
            "tokens": t,
            "layers": len(cfg.layer_ids),
            "cols": cfg.num_columns,
            "device": "cpu",
            "threads": torch.get_num_threads(),
        }
        for name, fn in (
            ("hash_end_to_end", lambda: h.hash(toks, cu)),  # noqa: B023 (timed right here, in this iteration)
            ("hash_op", lambda: op(grams, m, p, o)),  # noqa: B023
        ):
            s = time_it(fn, repeat=rep)
            emit(BENCH, p_, f"{name}_cpu", t / s, "tokens/s")
            out.append((name + "_cpu", t, t / s))
        if torch.cuda.is_available():
            out += _bench_hash_cuda(h, toks, cu, p_)
    return out


def _bench_hash_cuda(h: EngramHasher, toks, cu, params) -> list[tuple[str, int, float]]:
    t = toks.numel()
    toks_d, cu_d = toks.cuda(), cu.cuda()
    grams = h.ngram_token_ids(toks_d, cu_d)
    m, p, o = h.device_params("cuda")
    ref = get_op("engram_hash", "reference")  # torch ops on the GPU; "cuda" would pick tile_kernels
    fns = {
        "hash_end_to_end_torch_cuda": lambda: h.hash(toks_d, cu_d),
        "hash_op_torch_cuda": lambda: ref(grams, m, p, o),
    }
    try:
        from tile_kernels.engram import engram_hash as tk

        g32 = grams.to(torch.int32).contiguous()
        fns["hash_op_tile_kernels"] = lambda: tk(g32, m, p, o)
    except ImportError:
        log("tile_kernels not importable: skipping its engram_hash")
    out = []
    for name, fn in fns.items():
        s = time_it(lambda fn=fn: (fn(), torch.cuda.synchronize()), repeat=7, number=10)
        emit(BENCH, {**params, "device": "cuda"}, name, t / s, "tokens/s")
        out.append((name, t, t / s))
    return out


def _table(num_rows: int, fmt: str, lo: int = 0, hi: int | None = None):
    hi = num_rows if hi is None else hi
    g = torch.Generator().manual_seed(lo)
    return make_storage(torch.randn(hi - lo, ROW_DIM, generator=g) * 0.02, fmt)


def _sharded_worker(rank: int, world: int, init: str, num_rows: int, n_ids: int, rep: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        for fmt in ("bf16", "fp8"):
            lo, hi = shard_range(num_rows, world, rank)
            data, scales = _table(num_rows, fmt, lo, hi)
            table = ShardedEngramTable(data, scales, num_rows)
            ids = torch.randint(0, num_rows, (n_ids,), generator=torch.Generator().manual_seed(rank))
            dist.barrier()
            s = time_it(lambda: table.fetch(ids), repeat=rep)  # noqa: B023
            if rank == 0:
                queue.put((fmt, s))
    finally:
        dist.destroy_process_group()


def bench_fetch(quick: bool) -> list[tuple[str, str, float]]:
    num_rows = 1 << 16 if quick else 1 << 20
    n_ids = 24 * 1024  # 1,024 tokens x 24 row ids (3 orders x 8 heads): one layer of a 1k-token step
    rep = 3 if quick else 9
    out = []
    for fmt in ("bf16", "fp8"):
        data, scales = _table(num_rows, fmt)
        ids = torch.randint(0, num_rows, (n_ids,), generator=torch.Generator().manual_seed(0))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for name, table in (
            ("local", LocalEngramTable(data, scales, dev)),
            ("host", HostEngramTable(data, scales, dev)),
        ):
            ids_in = ids.to(dev) if name == "local" else ids
            s = time_it(
                lambda t=table, i=ids_in: (
                    t.fetch(i),
                    torch.cuda.is_available() and torch.cuda.synchronize(),
                ),
                repeat=rep,
            )
            p = {"rows": num_rows, "row_dim": ROW_DIM, "fmt": fmt, "ids": n_ids, "device": dev}
            emit(BENCH, p, f"fetch_{name}", n_ids / s, "rows/s")
            out.append((name, fmt, n_ids / s))
    world = 2
    mp.set_forkserver_preload(["torch", "torch.distributed", "deepinfer_core.engram"])
    ctx = mp.get_context("forkserver")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _sharded_worker,
            args=(world, os.path.join(d, "init"), num_rows, n_ids, rep, queue),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )
    while not queue.empty():
        fmt, s = queue.get()
        p = {
            "rows": num_rows,
            "row_dim": ROW_DIM,
            "fmt": fmt,
            "ids": n_ids,
            "world": world,
            "backend": "gloo",
        }
        emit(BENCH, p, "fetch_sharded_per_rank", n_ids / s, "rows/s")
        out.append((f"sharded x{world}", fmt, n_ids / s))
    return out


def plot(hash_rows, fetch_rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in sorted({r[0] for r in hash_rows}):
        pts = [(t, v) for n, t, v in hash_rows if n == name]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    a.set(
        xscale="log",
        yscale="log",
        xlabel="tokens per batch",
        ylabel="tokens/s",
        title="Engram hash (V4.1 shape)",
    )
    a.legend(fontsize=7)
    labels = [f"{n}\n{f}" for n, f, _ in fetch_rows]
    b.bar(range(len(fetch_rows)), [v for *_, v in fetch_rows])
    b.set_xticks(range(len(fetch_rows)), labels, fontsize=7)
    b.set(ylabel="rows/s", title="Engram fetch, 24k ids of 256 values")
    fig.tight_layout()
    path = out_path("engram.png")
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    # One intra-op thread: on a shared 2-core machine torch's thread pool mostly adds contention (measured
    # 5x slower at 1k tokens with 2 threads under load), and ratios are steadier single-threaded.
    torch.set_num_threads(1)
    hash_rows = bench_hash(args.quick)
    fetch_rows = bench_fetch(args.quick)
    if args.plot:
        plot(hash_rows, fetch_rows)


if __name__ == "__main__":
    main()
