"""KV block store benchmark: put / get bandwidth per backend, the checksum's share, async prefetch.

1. put and get of 64 KiB and 1 MiB blocks on InMemoryKVStore, FileKVStore (a temp dir on local disk,
   fsync on and off) and RedisKVStore (a redis-server this script starts on a free port, when the binary
   exists): MB/s, median of repeats, side by side in one run (quote ratios: the machine is noisy).
2. The record's BLAKE2b-256 digest alone, against a plain copy of the same bytes.
3. Prefetch: 64 blocks of 1 MiB read one after another vs through ``Prefetcher`` (4 workers), and
   read after a step vs prefetched during it (the step stood in for by a sleep: device work frees the CPU).
4. ``--swapin`` (CUDA only): layer-by-layer swap-in overlapped with a per-layer compute stand-in (a bf16
   GEMM sized to about the layer's copy time), 61 layers, against copy-everything-then-compute; the
   bytes landed are checked against the host blocks.

Usage: python benchmarks/kvstore.py [--quick] [--swapin]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np

from _common import emit, log, parser, time_it
from deepinfer_core.kvstore import FileKVStore, InMemoryKVStore, Prefetcher, RedisKVStore, TTLPolicy

BENCH = "kvstore"


def start_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        log("redis-server not found: Redis rows skipped")
        return None, None, None
    d = tempfile.mkdtemp(prefix="dkv-bench-redis-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.025)
    return proc, d, f"redis://127.0.0.1:{port}/0"


def swapin_bench(quick: bool) -> None:
    import torch

    from deepinfer_core.kvstore import LayerwiseSwapIn, pack_layers, stage

    dev = torch.device("cuda")
    layers, width, pool, n = 61, 64 << 10, 512, 64  # 64 blocks x 61 layers x 64 KiB = 250 MB to move
    rng = np.random.default_rng(0)
    host = [
        pack_layers([rng.integers(0, 256, width, dtype=np.uint8) for _ in range(layers)]) for _ in range(n)
    ]
    ids = rng.choice(pool, n, replace=False)
    caches = [torch.zeros(pool, width, dtype=torch.uint8, device=dev) for _ in range(layers)]
    ids_t = torch.from_numpy(ids).to(dev)
    pinned = stage(host, layers, width, pin=True)  # what the prefetcher lands, ahead of the step

    def copy_all():
        for i in range(layers):
            caches[i].index_copy_(0, ids_t, pinned[i].to(dev, non_blocking=True))

    def timed(fn, reps=5):
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    t_copy = timed(copy_all) / layers
    # a GEMM per layer whose time is about one layer's copy: the case where overlap matters most
    m = 1024
    a = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    t_gemm = timed(lambda: a @ w, reps=20)
    reps_per_layer = max(1, round(t_copy / t_gemm))

    def compute(i):
        x = a
        for _ in range(reps_per_layer):
            x = (x @ w)[:, :4096]
        return x

    def sequential():
        copy_all()
        for i in range(layers):
            compute(i)

    def overlapped():
        swap = LayerwiseSwapIn(caches, pinned, ids)
        for i in range(layers):
            swap.wait_layer(i)
            compute(i)

    t_compute = timed(lambda: [compute(i) for i in range(layers)])
    t_seq = timed(sequential)
    t_ovl = timed(overlapped)
    for c in caches:
        c.zero_()
    overlapped()
    torch.cuda.synchronize()
    ok = all(torch.equal(caches[i][ids_t].cpu(), pinned[i]) for i in range(layers))
    p = {"layers": layers, "blocks": n, "layer_bytes_per_block": width, "gpu": torch.cuda.get_device_name()}
    emit(BENCH, p, "swapin_copy_GBps", n * width / t_copy / 1e9, "GB/s")
    emit(BENCH, p, "compute_only_s", t_compute, "s")
    emit(BENCH, p, "copy_then_compute_s", t_seq, "s")
    emit(BENCH, p, "layerwise_overlapped_s", t_ovl, "s")
    emit(BENCH, p, "overlapped_over_sequential", t_ovl / t_seq, "ratio")
    emit(BENCH, p, "overlapped_over_max_of_parts", t_ovl / max(t_compute, t_copy * layers), "ratio")
    emit(BENCH, p, "bytes_equal", float(ok), "bool")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--swapin", action="store_true", help="only the CUDA layer-wise swap-in measurement")
    args = ap.parse_args()
    quick = args.quick
    if args.swapin:
        swapin_bench(quick)
        return
    repeat = 3 if quick else 7
    nblocks = 8 if quick else 32
    rng = np.random.default_rng(0)
    proc, rdir, url = start_redis()
    tmp = tempfile.mkdtemp(prefix="dkv-bench-")
    try:
        stores = {
            "memory": InMemoryKVStore(TTLPolicy()),
            "file": FileKVStore(os.path.join(tmp, "f"), fsync=False),
            "file_fsync": FileKVStore(os.path.join(tmp, "fs"), fsync=True),
        }
        if url:
            stores["redis"] = RedisKVStore(url=url)
        for size in (64 << 10, 1 << 20):
            blocks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(nblocks)]
            keys = [os.urandom(16) for _ in range(nblocks)]
            for name, st in stores.items():

                def put(st=st, keys=keys, blocks=blocks):
                    for k, b in zip(keys, blocks):
                        st.put(k, b)

                def get(st=st, keys=keys):
                    for k in keys:
                        assert st.get(k) is not None

                tp = time_it(put, repeat=repeat)
                tg = time_it(get, repeat=repeat)
                p = {"backend": name, "block_bytes": size, "blocks": nblocks}
                emit(BENCH, p, "put_MBps", size * nblocks / tp / 1e6, "MB/s")
                emit(BENCH, p, "get_MBps", size * nblocks / tg / 1e6, "MB/s")
        data = rng.integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
        th = time_it(lambda: hashlib.blake2b(data, digest_size=32).digest(), repeat=repeat)
        tc = time_it(lambda: bytearray(data), repeat=repeat)
        emit(BENCH, {"bytes": len(data)}, "blake2b_MBps", len(data) / th / 1e6, "MB/s")
        emit(BENCH, {"bytes": len(data)}, "copy_MBps", len(data) / tc / 1e6, "MB/s")
        emit(BENCH, {"bytes": len(data)}, "blake2b_over_copy_time", th / tc, "ratio")
        n = 16 if quick else 64
        blocks = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(n)]
        keys = [os.urandom(16) for _ in range(n)]
        for name in [s for s in ("file", "redis") if s in stores]:
            st = stores[name]
            for k, b in zip(keys, blocks):
                st.put(k, b)
            pf = Prefetcher(st, num_workers=4, max_inflight_bytes=64 << 20)

            def serial(st=st):
                for k in keys:
                    st.get(k)

            def parallel(pf=pf):
                pf.prefetch(keys).result()

            ts = time_it(serial, repeat=repeat)
            tpf = time_it(parallel, repeat=repeat)

            # overlap with the step before the one that needs the blocks: a device forward leaves the CPU
            # free, stood in for by a sleep as long as the serial reads
            def step_then_read(st=st, ts=ts):
                time.sleep(ts)
                serial(st)

            def prefetch_during_step(pf=pf, ts=ts):
                batch = pf.prefetch(keys)
                time.sleep(ts)
                batch.result()

            t_seq = time_it(step_then_read, repeat=repeat)
            t_ovl = time_it(prefetch_during_step, repeat=repeat)
            pf.close()
            p = {"backend": name, "blocks": n, "block_bytes": 1 << 20, "workers": 4}
            emit(BENCH, p, "serial_get_s", ts, "s")
            emit(BENCH, p, "prefetch_s", tpf, "s")
            emit(BENCH, p, "prefetch_speedup", ts / tpf, "ratio")
            emit(BENCH, p, "step_then_read_s", t_seq, "s")
            emit(BENCH, p, "prefetch_during_step_s", t_ovl, "s")
            emit(BENCH, p, "overlap_ratio", t_ovl / t_seq, "ratio")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(rdir, ignore_errors=True)


if __name__ == "__main__":
    main()
