"""engine/sizing.py: the KV pool and batch sized from device memory (cuda) or the fixed defaults (CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import sizing
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-random", num_blocks=8, max_num_seqs=2, max_model_len=64))


def test_probe_is_the_executors_own_accounting(engine: LLMEngine) -> None:
    """The two slopes predict the executor's cache bytes at other sizes exactly (the allocation is linear),
    and a block costs what the formats say: per KV-source layer, block_size tokens of main + index bytes."""
    cost = sizing.probe_cache_bytes(engine._make_executor)
    assert cost.per_block > 0 and cost.per_slot > 0
    base = sum(engine._make_executor(2, 1).cache_bytes().values())
    for n, s in ((7, 1), (2, 5), (11, 3)):
        got = sum(engine._make_executor(n, s).cache_bytes().values())
        assert got == base + (n - 2) * cost.per_block + (s - 1) * cost.per_slot
    fmt = engine.executor.fmt
    sources = len(engine.model_config.kv_source_layer_ids)
    bs = engine.config.block_size
    assert cost.per_block == sources * bs * (fmt.main.bytes_per_token + fmt.index.bytes_per_token)


def _cfg(**kw: object) -> EngineConfig:
    return EngineConfig(**kw)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    per_block=st.integers(1, 1 << 20),
    per_slot=st.integers(1, 1 << 24),
    total=st.integers(1 << 30, 1 << 38),
    used_share=st.floats(0.0, 0.5),
    util=st.floats(0.3, 1.0),
    seqs=st.one_of(st.none(), st.integers(1, 512)),
    mml=st.integers(16, 8192),
    reserve=st.integers(0, 1 << 31),
)
def test_size_pool_is_the_largest_pool_that_fits(
    per_block: int,
    per_slot: int,
    total: int,
    used_share: float,
    util: float,
    seqs: int | None,
    mml: int,
    reserve: int,
) -> None:
    """Brute-force oracle: the chosen pool fits the budget, one more block would not (or the cap binds),
    and a budget below one full-length sequence is refused naming the field."""
    cfg = _cfg(max_num_seqs=seqs, max_model_len=mml, gpu_memory_utilization=util)
    free = total - int(used_share * total)
    cost = sizing.CacheBytes(per_block, per_slot)
    budget = int(util * total) - (total - free) - reserve
    per_seq = -(-mml // cfg.block_size)
    try:
        size = sizing.size_pool(cfg, cost, free_bytes=free, total_bytes=total, reserve_bytes=reserve)
    except ValueError as e:
        # the field in error is the message's first word (the max_num_seqs message also suggests raising
        # gpu_memory_utilization)
        field = str(e).split(":")[0]
        assert field in ("EngineConfig.gpu_memory_utilization", "EngineConfig.max_num_seqs")
        if field == "EngineConfig.gpu_memory_utilization":
            assert budget < per_slot + (per_seq + 1) * per_block
        else:  # the given max_num_seqs' slots leave less than one sequence's blocks
            assert seqs is not None and (budget - seqs * per_slot) // per_block < per_seq + 1
        return
    s, n = size.max_num_seqs, size.num_blocks
    assert size.budget_bytes == budget
    assert s == seqs if seqs is not None else 1 <= s <= sizing.GPU_MAX_NUM_SEQS
    assert n >= per_seq + 1
    assert n * per_block + s * per_slot <= budget  # fits
    cap = sizing.FULL_FILLS_CAP * s * per_seq + 1
    assert n == cap or (n + 1) * per_block + s * per_slot > budget  # the largest that fits, or the cap
    if seqs is None and s < sizing.GPU_MAX_NUM_SEQS:  # fewer sequences only because their slots would not fit
        assert (s + 1) * per_slot > budget // 4


def test_reference_backend_keeps_the_fixed_defaults(engine: LLMEngine) -> None:
    cfg, size = sizing.resolve(
        _cfg(),
        on_gpu=False,
        cost=lambda: pytest.fail("no probe off the GPU"),
        memory=lambda: pytest.fail("no memory query off the GPU"),
        hidden_size=8,
        dtype_bytes=4,
    )
    assert (cfg.num_blocks, cfg.max_num_seqs, size.source) == (1024, 32, "default")
    cfg, size = sizing.resolve(
        _cfg(num_blocks=40, max_num_seqs=3),
        on_gpu=True,
        cost=lambda: pytest.fail("probe"),
        memory=lambda: pytest.fail("memory"),
        hidden_size=8,
        dtype_bytes=4,
    )
    assert (cfg.num_blocks, cfg.max_num_seqs, size.source) == (40, 3, "config")
    eng = LLMEngine(EngineConfig(model="tiny-random", max_model_len=64))
    assert (eng.config.num_blocks, eng.config.max_num_seqs) == (1024, 32)
    assert eng.kv_pool.num_free_blocks == 1023 and eng.state_pool.num_free_slots == 32


def test_gpu_path_sizes_from_memory_with_fake_numbers() -> None:
    """resolve() on the GPU path with a fake card: the config carries the chosen sizes."""
    cost = sizing.CacheBytes(per_block=4096, per_slot=1 << 20)
    gib = 1 << 30
    cfg, size = sizing.resolve(
        _cfg(max_model_len=1024),
        on_gpu=True,
        cost=lambda: cost,
        memory=lambda: (70 * gib, 80 * gib),
        hidden_size=256,
        dtype_bytes=2,
    )
    assert size.source == "memory" and cfg.max_num_seqs == sizing.GPU_MAX_NUM_SEQS
    assert cfg.num_blocks == sizing.FULL_FILLS_CAP * 256 * 64 + 1  # plenty of memory: the cap binds
    with pytest.raises(ValueError, match=r"EngineConfig\.gpu_memory_utilization"):
        sizing.resolve(
            _cfg(max_model_len=1024, gpu_memory_utilization=0.1),
            on_gpu=True,
            cost=lambda: cost,
            memory=lambda: (70 * gib, 80 * gib),
            hidden_size=256,
            dtype_bytes=2,
        )


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "0.9", None])
def test_bad_gpu_memory_utilization_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.gpu_memory_utilization: .*\(0, 1\]"):
        _cfg(gpu_memory_utilization=bad)


@pytest.mark.parametrize("field,bad", [("num_blocks", 1), ("num_blocks", 2.5), ("max_num_seqs", 0)])
def test_bad_sizes_name_the_field(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field}: .*None"):
        _cfg(**{field: bad})


@pytest.mark.gpu
def test_cuda_engine_fills_the_budget_it_chose() -> None:
    """On a GPU the engine's caches take what it chose, and the process stays within the budget."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = LLMEngine(EngineConfig(model="tiny", backend="cuda", max_model_len=512, gpu_memory_utilization=0.3))
    free, total = torch.cuda.mem_get_info()
    held = sum(eng.executor.cache_bytes().values())
    assert (
        eng.config.num_blocks > 1024
        or eng.config.num_blocks == sizing.FULL_FILLS_CAP * eng.config.max_num_seqs * 32 + 1
    )
    assert total - free <= 0.3 * total + (1 << 30)
    assert held > 0
