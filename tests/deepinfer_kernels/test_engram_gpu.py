"""Engram on the GPU: our hash equals tile_kernels' engram_hash bit for bit; throughput is printed.

Self-contained: run with ``pytest -s -m gpu tests/deepinfer_kernels/test_engram_gpu.py``. Lines starting
with ``ENGRAM_GPU`` are JSON measurements (the benchmarks/_common.py line format).
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch

from deepinfer_core.engram import EngramConfig, EngramHasher, HostEngramTable, LocalEngramTable, random_values
from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


def _emit(metric: str, params: dict, value: float, unit: str) -> None:
    line = {"bench": "engram_gpu", "params": params, "metric": metric, "value": value, "unit": unit}
    print("ENGRAM_GPU " + json.dumps(line), flush=True)


def _tile_engram_hash():
    tk = pytest.importorskip("tile_kernels", reason="tile_kernels not importable")
    fn = getattr(tk, "engram_hash", None)
    if fn is None:
        from tile_kernels.engram import engram_hash as fn  # type: ignore[no-redef]
    return fn


def _cuda_time(fn, iters: int = 20) -> float:
    """Median seconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3)
    return float(np.median(samples))


CONFIGS = {
    "v41_flash": EngramConfig.v41_flash(),
    "tiny": EngramConfig.tiny(),
    "orders2-3_h8": EngramConfig(
        layer_ids=(1, 15), max_ngram=3, heads_per_order=8, table_sizes=646_400, vocab_size=129_280
    ),
}


def _inputs(cfg: EngramConfig, t: int, seed: int = 0):
    h = EngramHasher(cfg)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    lens = torch.randint(1, 300, (t,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    cu = torch.cat([cu[cu < t], torch.tensor([t])])  # a packed batch of random-length sequences
    return h, toks, cu


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_on_gpu_equals_cpu(name: str) -> None:
    h, toks, cu = _inputs(CONFIGS[name], 8192)
    assert torch.equal(h.hash(toks.cuda(), cu.cuda()).cpu(), h.hash(toks, cu))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hash_equals_tile_kernels_bit_for_bit(name: str) -> None:
    tk_hash = _tile_engram_hash()
    cfg = CONFIGS[name]
    h, toks, cu = _inputs(cfg, 65536)
    grams = h.ngram_token_ids(toks.cuda(), cu.cuda())
    mult, primes, offsets = h.device_params("cuda")
    ours = get_op("engram_hash", "reference")(grams, mult, primes, offsets)  # the torch reference, on the GPU
    theirs = tk_hash(
        grams.to(torch.int32).contiguous(), mult.contiguous(), primes.contiguous(), offsets.contiguous()
    )
    assert theirs.dtype == torch.int32 and theirs.shape == ours.shape
    mism = int((ours != theirs).sum())
    assert mism == 0, f"{mism} of {ours.numel()} row ids differ from tile_kernels.engram_hash"
    # the hasher end to end (its own ngram builder) also equals the kernel's output, and the "cuda"
    # backend (deepinfer_kernels.cuda.engram: tile_kernels or TileLang) gives the same
    assert torch.equal(h.hash(toks.cuda(), cu.cuda()), theirs)
    assert torch.equal(h.hash(toks.cuda(), cu.cuda(), backend="cuda"), theirs)


def test_full_range_multipliers_against_tile_kernels() -> None:
    """Arbitrary 64-bit multipliers make products wrap and hashes negative: does the kernel floor-mod too?
    (Derived multipliers never produce negative hashes, so this only matters for foreign multipliers.)"""
    tk_hash = _tile_engram_hash()
    rng = np.random.default_rng(3)
    n, layers, heads, t = 4, 2, 8, 32768
    mult = torch.from_numpy(
        rng.integers(-(2**63), 2**63 - 1, (layers, n), dtype=np.int64, endpoint=True)
    ).cuda()
    primes = torch.from_numpy(
        rng.integers(1_000_000, 2_000_000, (layers, n - 1, heads)).astype(np.int32)
    ).cuda()
    offsets = torch.from_numpy(rng.integers(0, 10_000, (layers, (n - 1) * heads)).astype(np.int32)).cuda()
    ids = torch.from_numpy(rng.integers(0, 129_280, (t, n)).astype(np.int32)).cuda()
    ours = get_op("engram_hash", "reference")(ids, mult, primes, offsets)
    theirs = tk_hash(ids, mult, primes, offsets)
    bad = ours != theirs
    if not bool(bad.any()):
        return
    # Explain a mismatch: is it exactly C's truncated remainder on negative hashes?
    prod = ids.long().unsqueeze(0) * mult.unsqueeze(1)
    hsh, cols = prod[:, :, 0], []
    for k in range(1, n):
        hsh = hsh ^ prod[:, :, k]
        cols.append(torch.fmod(hsh.unsqueeze(-1), primes[:, k - 1, :].long().unsqueeze(1)))
    trunc = (torch.cat(cols, -1) + offsets.long().unsqueeze(1)).to(torch.int32)
    if torch.equal(trunc, theirs):
        pytest.xfail(
            f"tile_kernels uses a truncated (C) remainder: {int(bad.sum())} negative-hash ids differ; "
            "with the public (bounded) multipliers hashes are never negative, so the two agree"
        )
    raise AssertionError(f"{int(bad.sum())} row ids differ and the difference is not the remainder's sign")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_tables_on_gpu(fmt: str) -> None:
    values = random_values(100_000, 256, seed=1)
    cpu = LocalEngramTable.from_values(values, fmt)
    gpu = LocalEngramTable.from_values(values, fmt, device="cuda")
    host = HostEngramTable.from_values(values, fmt, device="cuda")
    assert host.pinned
    ids = torch.randint(0, 100_000, (4096, 24))
    want = cpu.fetch(ids)
    assert torch.equal(gpu.fetch(ids.cuda()).cpu(), want)
    assert torch.equal(host.fetch(ids).cpu(), want)
    kernel = LocalEngramTable(gpu.data, gpu.scales, backend="cuda")  # the cuda engram_gather registration
    assert torch.equal(kernel.fetch(ids.cuda()).cpu(), want)


def test_throughput() -> None:
    """Prints hash throughput (tokens/s) of our torch reference and tile_kernels, and fetch rows/s."""
    cfg = EngramConfig.v41_flash()
    try:
        tk_hash = _tile_engram_hash()
    except pytest.skip.Exception:
        tk_hash = None
    for t in (4096, 65536, 1 << 20):
        h, toks, cu = _inputs(cfg, t)
        toks, cu = toks.cuda(), cu.cuda()
        grams = h.ngram_token_ids(toks, cu)
        mult, primes, offsets = h.device_params("cuda")
        op = get_op("engram_hash", "reference")  # torch on the GPU
        p = {"tokens": t, "layers": 2, "cols": cfg.num_columns}
        s = _cuda_time(partial(h.hash, toks, cu))
        _emit("hash_end_to_end_torch", p, t / s, "tokens/s")
        s = _cuda_time(partial(op, grams, mult, primes, offsets))
        _emit("hash_op_torch", p, t / s, "tokens/s")
        if tk_hash is not None:
            g32 = grams.to(torch.int32).contiguous()
            s = _cuda_time(partial(tk_hash, g32, mult, primes, offsets))
            _emit("hash_op_tile_kernels", p, t / s, "tokens/s")
    rows = 1 << 22  # 4M rows x 256: 1 GiB fp8, 2 GiB bf16
    for fmt in ("bf16", "fp8"):
        values = torch.randn(rows, 256, device="cuda") * 0.02
        table = LocalEngramTable.from_values(values, fmt)
        host = HostEngramTable(
            table.data.cpu(), table.scales.cpu() if table.scales is not None else None, "cuda"
        )
        del values
        for n in (4096 * 24, 65536 * 24):
            ids = torch.randint(0, rows, (n,), device="cuda")
            p = {"rows": rows, "row_dim": 256, "fmt": fmt, "ids": n}
            _emit("fetch_local_gpu", p, n / _cuda_time(partial(table.fetch, ids), 10), "rows/s")
            ids_cpu = ids.cpu()
            _emit("fetch_host_pinned", p, n / _cuda_time(partial(host.fetch, ids_cpu), 5), "rows/s")
        table = host = None  # free the GPU copy before the next format
        torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sharded_table_over_nccl_group_of_one(fmt: str, tmp_path) -> None:
    """The sharded fetch's device path (unique, bincount, NCCL all-to-all of ids and packed bytes)."""
    import torch.distributed as dist

    from deepinfer_core.engram import ShardedEngramTable

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        values = random_values(10_000, 256, seed=2)
        table = ShardedEngramTable.from_full(values, fmt, device="cuda")
        local = LocalEngramTable.from_values(values, fmt, device="cuda")
        ids = torch.randint(0, 10_000, (512, 24), device="cuda")
        assert torch.equal(table.fetch(ids), local.fetch(ids))
    finally:
        dist.destroy_process_group()
