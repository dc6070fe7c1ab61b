"""TileLang ``moe_grouped_gemm``: the MoE's expert products over expert-sorted rows, for decode batches.

At decode batch sizes each expert sees a few dozen rows (B = 64, top-6 of 8: ~48, never more than 64), so
the products are a weight stream: on the H200 (wide config, 2026-12-01) ``torch._grouped_mm`` read the
3.4 GB of expert weights a step at 66 % of copy bandwidth. Here the weights stream through a TMA pipeline.

Launch contract (a :class:`GGConfig`: tile width ``bn``, K block ``bk``, ``stages``, consumer ``threads``,
``min_blocks``, ``ws``): grid (N / bn, E); CTA (nb, e) computes columns [bn nb, bn nb + bn) of expert
e's rows, ``offs[e - 1] .. offs[e]``, in tiles of 64 rows (a runtime loop: ceil(rows / 64) tiles, one at
B = 64), each tile a ``stages``-deep ``T.Pipelined`` loop over K in ``bk``-wide blocks: x's rows (rows past
the tensor read as zeros) and the expert's weight block to shared memory, one wgmma GEMM into a
[64, bn] fp32 fragment; only the tile's rows of the expert are stored (rows of the next expert inside the
tile are not). The CTAs of the last expert also store zeros in rows ``offs[-1] .. R`` of their columns
(the reference's contract), so the output is allocated without a fill kernel (13 fewer launches a wide
decode step). ``ws`` (TileLang's warp specialisation, the default): a producer warpgroup of 128 threads,
added to the ``threads`` consumers, issues TMA loads through an mbarrier ring; without it the consumers
issue cp.async loads themselves (a software pipeline), which saves the producer's registers.

Why the configuration matters: every CTA streams the same bytes (bn x K weights), so a launch is fastest
when all CTAs are resident at once (no second wave where a few CTAs keep too few bytes in flight). At
~90 registers x 256 threads the default config fits 2 CTAs an SM by registers (not the 3 its 72 KB of
shared memory allow): 264 slots for gate / up's 288 CTAs and down's 320, i.e. a 24- or 56-CTA second
wave (92 registers with the tail zeroing). Without warp specialisation, 140 registers x 128 threads fit 3
(all of those CTAs resident). ``min_blocks`` (``__launch_bounds__``' second argument) caps the registers;
``bn`` trades CTA count against x re-reads from L2 (each CTA reads its expert's x tile once).
:data:`CONFIGS` (in ``ops/grouped_gemm``, host-side and importable without a device, with the sweep's
candidates and the reasons for them) holds the configuration per (E, N, K) from the H200 sweep
(``benchmarks/grouped_gemm.py``); other shapes take :data:`DEFAULT` (the 2026-12-01 configuration).

Shapes the kernel takes: bf16 / fp16, K a multiple of ``bk``, N a multiple of ``bn``; anything else takes
the reference (same contract).
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import concurrent.futures
import logging
import os
import time

import torch

from deepinfer_kernels.cuda import _tl
from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, torch_dtype_name
from deepinfer_kernels.libs.switch import enabled
from deepinfer_kernels.ops import grouped_gemm as ref
from deepinfer_kernels.ops.grouped_gemm import (
    CANDIDATES,
    CONFIGS,
    DEFAULT,
    SWEEP_SHAPES,
    GGConfig,
    config_for,
)
from deepinfer_kernels.registry import register

log = logging.getLogger(__name__)
__all__ = [
    "CANDIDATES",
    "CONFIGS",
    "DEFAULT",
    "SWEEP_SHAPES",
    "GGConfig",
    "config_for",
    "kernel_takes",
    "moe_grouped_gemm",
    "precompile",
]
_BM = ref.GG_BM


def _build(e: int, n: int, k: int, dtype: str, cfg: GGConfig = DEFAULT):
    bn, bk, stages, threads, min_blocks, _ = cfg
    # M = 64 is one warpgroup's wgmma: several warpgroups split the columns
    policy = T.GemmWarpPolicy.FullCol if threads > 128 else T.GemmWarpPolicy.Square
    r_dyn = T.dynamic("r")
    acc = "float32"

    @T.prim_func
    def gg(
        x: T.Tensor((r_dyn, k), dtype),
        w: T.Tensor((e, n, k), dtype),
        offs: T.Tensor((e,), "int32"),
        out: T.Tensor((r_dyn, n), dtype),
    ):
        with T.Kernel(n // bn, e, threads=threads) as (nb, ex):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            a_sh = T.alloc_shared((_BM, bk), dtype)
            b_sh = T.alloc_shared((bn, bk), dtype)
            c = T.alloc_fragment((_BM, bn), acc)
            # the expert's rows as expressions over offs (an alloc_var assigned here was moved into the
            # producer branch by the warp specialisation, leaving the loop bound unset)
            lo = T.if_then_else(ex == 0, 0, offs[T.max(ex - 1, 0)])
            hi = offs[ex]
            for mt in T.serial(T.ceildiv(hi - lo, _BM)):
                T.clear(c)
                for kb in T.Pipelined(k // bk, num_stages=stages):
                    T.copy(x[lo + mt * _BM : lo + mt * _BM + _BM, kb * bk : kb * bk + bk], a_sh)
                    T.copy(w[ex, nb * bn : nb * bn + bn, kb * bk : kb * bk + bk], b_sh)
                    T.gemm(a_sh, b_sh, c, transpose_B=True, policy=policy)
                for i, j in T.Parallel(_BM, bn):
                    if lo + mt * _BM + i < hi:
                        out[lo + mt * _BM + i, nb * bn + j] = c[i, j]
            # rows past the last expert's end: zeros, written by the last expert's CTAs (no fill kernel)
            tail = T.if_then_else(ex == e - 1, T.max(r_dyn - hi, 0), 0)
            for zt in T.serial(T.ceildiv(tail, _BM)):
                for i, j in T.Parallel(_BM, bn):
                    if hi + zt * _BM + i < r_dyn:
                        out[hi + zt * _BM + i, nb * bn + j] = T.cast(0, dtype)

    return gg


def _key(e: int, n: int, k: int, dtype: str, cfg: GGConfig) -> tuple:
    return ("moe_grouped_gemm", e, n, k, dtype, tuple(cfg))


def kernel_takes(x: torch.Tensor, w: torch.Tensor, cfg: GGConfig | None = None) -> bool:
    """Whether these inputs run the kernel (else the reference); ``cfg`` None: the shape's table entry."""
    if not (
        HAVE_TILELANG
        and x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and w.dim() == 3
        and x.shape[0] > 0
    ):
        return False
    c = cfg or config_for(w.shape[0], w.shape[1], x.shape[1])
    return c is not None and c.takes(w.shape[1], x.shape[1])


def _compile(job: tuple[int, int, int, str, GGConfig], func=None):
    """Compile (E, N, K, dtype, config); ``func``: its prim_func, built already."""
    t0 = time.perf_counter()
    func = _build(*job) if func is None else func
    kern = _tl.tilelang.compile(func, target=_tl.target(), pass_configs=job[4].pass_configs() or None)
    log.info("tilelang compiled moe_grouped_gemm %s in %.1f s", job, time.perf_counter() - t0)
    return kern


def _kernel(job: tuple[int, int, int, str, GGConfig]):
    """The compiled kernel of (E, N, K, dtype, config), compiled on first use (the shared cache and lock of
    ``_tl.compile_kernel``; here because the configs without warp specialisation need a pass config)."""
    key = _key(*job)
    k = _tl._CACHE.get(key)
    if k is None:
        with _tl._LOCK:
            k = _tl._CACHE.get(key)
            if k is None:
                k = _tl._CACHE[key] = _compile(job)
    return k


def precompile(
    jobs: list[tuple[int, int, int, str, GGConfig]], workers: int | None = None
) -> dict[tuple, float | str]:
    """Compile every (E, N, K, dtype, config) of ``jobs`` into the kernel cache, ``workers`` at a time
    (threads: TileLang's lowering releases the GIL and nvcc runs as a subprocess, as in its own
    ``par_compile``, which also builds the prim_funcs first, in the calling thread). Returns {job: compile
    seconds (0: cached), or the error's text}; a failing config does not stop the others."""
    res: dict[tuple, float | str] = {}
    todo = {}
    for j in jobs:
        if _key(*j) in _tl._CACHE:
            res[j] = 0.0
            continue
        try:
            todo[j] = _build(*j)
        except Exception as exc:
            res[j] = f"{type(exc).__name__}: {str(exc)[-300:]}"

    def one(job: tuple) -> float:
        t0 = time.perf_counter()
        _tl._CACHE[_key(*job)] = _compile(job, todo[job])
        return time.perf_counter() - t0

    if not todo:
        return res
    with concurrent.futures.ThreadPoolExecutor(workers or min(len(todo), os.cpu_count() or 1)) as pool:
        futs = {pool.submit(one, j): j for j in todo}
        for f in concurrent.futures.as_completed(futs):
            try:
                res[futs[f]] = f.result()
            except Exception as exc:  # one config failing to lower must not end the sweep
                res[futs[f]] = f"{type(exc).__name__}: {str(exc)[-300:]}"
    return res


@register("moe_grouped_gemm", "cuda")
def moe_grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, config: GGConfig | None = None
) -> torch.Tensor:
    """Same contract as the reference; the shapes of :func:`kernel_takes` run the TileLang kernel (no host
    synchronisation: capturable in a CUDA graph). ``config``: a launch configuration other than the
    shape's table entry (the sweep, the tests). Where ``DEEPINFER_KERNEL_LIBS`` selects deep_gemm, bf16
    products with K a multiple of 128 run DeepGEMM's masked FP8 grouped GEMM instead (weights quantised
    once to 128 x 128 FP8 blocks, activations per token per 128: FP8 numerics, not bf16's)."""
    if (
        config is None
        and x.dtype == torch.bfloat16
        and x.is_cuda
        and w.shape[-1] % 128 == 0
        and enabled("deep_gemm")
    ):
        from deepinfer_kernels.cuda import deep_gemm_adapter as dga

        ref.check_grouped_gemm_inputs(x, w, offs)
        return dga.grouped_fp8_masked(x, *dga.fp8_weights(w), offs)
    if not kernel_takes(x, w, config):
        return ref.moe_grouped_gemm(x, w, offs)
    r, k, e, n = ref.check_grouped_gemm_inputs(x, w, offs)
    cfg = config or config_for(e, n, k)
    assert cfg is not None  # kernel_takes found a configuration that tiles the shape
    dt = torch_dtype_name(x.dtype)
    # no fill: the kernel writes every row (the experts' products, zeros past the last expert's end)
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    kern = _kernel((e, n, k, dt, cfg))
    kern(x.contiguous(), w.contiguous(), offs.to(device=x.device, dtype=torch.int32).contiguous(), out)
    return out
