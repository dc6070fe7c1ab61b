"""How large the paged KV pool and the running batch are: from the device memory left after the weights.

On the ``cuda`` backend an ``EngineConfig`` that leaves ``num_blocks`` / ``max_num_seqs`` unset (None) gets
them from the memory the GPU has left, as vLLM's and SGLang's ``gpu_memory_utilization`` /
``mem_fraction_static`` users expect: of ``gpu_memory_utilization x total`` bytes, what is not already in
use (the weights, other processes) less an activation reserve goes to the caches. On the ``reference``
backend (the CPU, tests) the fixed defaults stay (1,024 blocks, 32 sequences): host memory is no budget
to fill.

The cache bytes of one block and of one state slot come from the executor's own accounting
(``ModelExecutor.cache_bytes``) of two small probe executors, not from a second copy of its layout: the
executor allocates linearly in blocks and slots, so two probes give both slopes exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.protocols import ModelExecutor

log = logging.getLogger(__name__)

DEFAULT_NUM_BLOCKS = 1024  # the reference backend's pool when num_blocks is None
DEFAULT_MAX_NUM_SEQS = 32  # the reference backend's batch when max_num_seqs is None
GPU_MAX_NUM_SEQS = 256  # the cuda backend's batch when max_num_seqs is None (memory permitting)
MIN_RESERVE = 1 << 30  # activation reserve floor: workspace, CUDA graphs' pool, the allocator's slack
# the reserve grows with one step's tokens: a prefill chunk's activations (MoE rows, attention tiles,
# logits) are a few dozen hidden-size vectors per token
RESERVE_VECTORS_PER_TOKEN = 64
# blocks beyond every running sequence at full length only keep more prefix-cache hits; past this many
# such fills the pool stops growing (host-side tables grow with it)
FULL_FILLS_CAP = 8


@attrs.frozen
class CacheBytes:
    """Device bytes one paged block and one state slot cost (every cache kind summed)."""

    per_block: int
    per_slot: int


@attrs.frozen
class PoolSize:
    """What was chosen, and from which budget (for the log and for tests)."""

    num_blocks: int
    max_num_seqs: int
    budget_bytes: int  # bytes given to the caches
    cache_bytes: int  # bytes the chosen sizes take
    source: str  # "config", "default" or "memory"


def probe_cache_bytes(make_executor: Callable[[int, int], ModelExecutor]) -> CacheBytes:
    """Per-block and per-slot bytes from the executor's ``cache_bytes()`` at (2, 1), (3, 1) and (2, 2)
    (blocks, slots); ``make_executor(num_blocks, num_slots)`` builds one."""

    def total(n: int, s: int) -> int:
        ex = make_executor(n, s)
        return int(sum(ex.cache_bytes().values()))

    base = total(2, 1)
    return CacheBytes(per_block=total(3, 1) - base, per_slot=total(2, 2) - base)


def activation_reserve(cfg: EngineConfig, hidden_size: int, dtype_bytes: int) -> int:
    """Bytes kept out of the caches for one step's activations (an estimate; the knob is
    ``gpu_memory_utilization``)."""
    return max(
        MIN_RESERVE, cfg.max_num_batched_tokens * hidden_size * dtype_bytes * RESERVE_VECTORS_PER_TOKEN
    )


def blocks_per_seq(cfg: EngineConfig) -> int:
    return -(-cfg.max_model_len // cfg.block_size)


def size_pool(
    cfg: EngineConfig, cost: CacheBytes, *, free_bytes: int, total_bytes: int, reserve_bytes: int
) -> PoolSize:
    """The pool for ``cfg`` on a device with ``free_bytes`` of ``total_bytes`` free now (weights loaded).

    Budget: ``gpu_memory_utilization * total - (total - free) - reserve``. ``max_num_seqs`` (when None):
    the most of ``GPU_MAX_NUM_SEQS`` whose state slots take at most a quarter of the budget. ``num_blocks``
    (when None): what the rest holds, at most ``FULL_FILLS_CAP`` times every running sequence at
    ``max_model_len``. Raises ValueError naming ``gpu_memory_utilization`` when one sequence of
    ``max_model_len`` does not fit."""
    used = total_bytes - free_bytes
    budget = int(cfg.gpu_memory_utilization * total_bytes) - used - reserve_bytes
    per_seq = blocks_per_seq(cfg)
    need_one = cost.per_slot + (per_seq + 1) * cost.per_block
    if budget < need_one:
        gib = 1 << 30
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization: {cfg.gpu_memory_utilization} of {total_bytes / gib:.1f} GiB "
            f"leaves {budget / gib:.2f} GiB for the KV caches after {used / gib:.1f} GiB in use (weights, other "
            f"processes) and a {reserve_bytes / gib:.1f} GiB activation reserve; one sequence of max_model_len="
            f"{cfg.max_model_len} needs {need_one / gib:.3f} GiB: raise gpu_memory_utilization, lower "
            "max_model_len, or set num_blocks / max_num_seqs"
        )
    seqs = cfg.max_num_seqs
    if seqs is None:
        fit = (budget // 4) // max(cost.per_slot, 1)
        seqs = int(max(1, min(GPU_MAX_NUM_SEQS, fit)))
    blocks = cfg.num_blocks
    if blocks is None:
        left = budget - seqs * cost.per_slot
        fit = left // max(cost.per_block, 1)
        blocks = int(min(fit, FULL_FILLS_CAP * seqs * per_seq + 1, 2**31 - 1))
        if blocks < per_seq + 1:
            raise ValueError(
                f"EngineConfig.max_num_seqs: {seqs} state slots leave room for {blocks} blocks, fewer than one "
                f"sequence of max_model_len={cfg.max_model_len} needs ({per_seq + 1}): lower max_num_seqs or "
                "raise gpu_memory_utilization"
            )
    used_cache = blocks * cost.per_block + seqs * cost.per_slot
    return PoolSize(
        num_blocks=blocks, max_num_seqs=seqs, budget_bytes=budget, cache_bytes=used_cache, source="memory"
    )


def resolve(
    cfg: EngineConfig,
    *,
    on_gpu: bool,
    cost: Callable[[], CacheBytes],
    memory: Callable[[], tuple[int, int]],
    hidden_size: int,
    dtype_bytes: int,
) -> tuple[EngineConfig, PoolSize]:
    """``cfg`` with ``num_blocks`` and ``max_num_seqs`` set. Off the GPU (or both given): the fixed defaults
    for what is None. On the GPU: :func:`size_pool` over ``memory()`` = (free, total) bytes, with
    ``cost()`` (called only then: it builds probe executors) giving the per-block / per-slot bytes."""
    if cfg.num_blocks is not None and cfg.max_num_seqs is not None:
        return cfg, PoolSize(cfg.num_blocks, cfg.max_num_seqs, 0, 0, "config")
    if not on_gpu:
        n = DEFAULT_NUM_BLOCKS if cfg.num_blocks is None else cfg.num_blocks
        s = DEFAULT_MAX_NUM_SEQS if cfg.max_num_seqs is None else cfg.max_num_seqs
        return attrs.evolve(cfg, num_blocks=n, max_num_seqs=s), PoolSize(n, s, 0, 0, "default")
    free, total = memory()
    size = size_pool(
        cfg,
        cost(),
        free_bytes=free,
        total_bytes=total,
        reserve_bytes=activation_reserve(cfg, hidden_size, dtype_bytes),
    )
    gib = 1 << 30
    log.info(
        "engine: KV pool from GPU memory (gpu_memory_utilization=%.2f of %.1f GiB, %.1f GiB free after the "
        "weights): %d blocks x %d tokens, max_num_seqs %d, %.2f GiB of caches",
        cfg.gpu_memory_utilization,
        total / gib,
        free / gib,
        size.num_blocks,
        cfg.block_size,
        size.max_num_seqs,
        size.cache_bytes / gib,
    )
    return attrs.evolve(cfg, num_blocks=size.num_blocks, max_num_seqs=size.max_num_seqs), size
