"""The engine with an external KV store (EngineConfig.kv_store): exact mode gives the tokens of a run
without it, while a fresh engine (empty GPU prefix index) really fetches its prefix from the store.

Oracle: the same prompts on an engine without prefix caching. float64, raw KV (as the engine's own
prefix-caching tests). A damaged store (every block file bit-flipped) only costs hits.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.kvstore import FileKVStore, InMemoryKVStore, TTLPolicy
from deepinfer_core.sampling_params import SamplingParams

EXACT = {"model": "tiny-random", "seed": 5, "dtype": "float64", "quantize": False}
ENGINE = {
    "num_blocks": 256,
    "block_size": 16,
    "max_num_seqs": 4,
    "async_scheduling": False,
    "swa_replay": "exact",
}


@functools.cache
def reference() -> LLM:
    return LLM(prefix_caching=False, **ENGINE, **EXACT)


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, 150).tolist()  # 9 whole blocks of 16
    first = [prefix + rng.integers(3, 259, 7).tolist()]
    second = [prefix + rng.integers(3, 259, int(rng.integers(1, 30))).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return first, second, params


def _run(store, first, second, params):
    writer = LLM(kv_store=store, **ENGINE, **EXACT)
    a = writer.generate(first, params, use_tqdm=False)
    reader = LLM(kv_store=store, **ENGINE, **EXACT)  # fresh engine: its GPU index is empty
    b = reader.generate(second, params, use_tqdm=False)
    return a, b, writer.engine.prefix.link, reader.engine.prefix.link


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_engine_tokens_equal_with_the_store_on_and_off(backend, tmp_path):
    first, second, params = _workload(3)
    want = reference().generate(first + second, params, use_tqdm=False)
    store = InMemoryKVStore(TTLPolicy()) if backend == "memory" else FileKVStore(tmp_path, fsync=False)
    a, b, wlink, rlink = _run(store, first, second, params)
    for g, w in zip(a + b, want):
        assert g.ok and w.ok, (g.error, w.error)
        assert g.token_ids == w.token_ids
    assert wlink.written_blocks >= 9  # the writer stored its prefix blocks
    assert rlink.fetched_blocks >= 9  # the reader fetched them instead of computing
    # the store's hit is the hit the same engine gets from its own GPU index after the first wave
    warm = LLM(**ENGINE, **EXACT)
    warm.generate(first, params, use_tqdm=False)
    gpu = warm.generate(second[:1], params, use_tqdm=False)[0]
    # (the store holds block KV only: the fresh engine has no host SWA rings, so it replays the encoder too)
    assert b[0].cached_tokens == gpu.cached_tokens > 0 and b[0].replayed_tokens >= gpu.replayed_tokens


def test_damaged_store_costs_hits_not_tokens(tmp_path):
    first, second, params = _workload(4)
    want = reference().generate(second, params, use_tqdm=False)
    store = FileKVStore(tmp_path, fsync=False)
    LLM(kv_store=store, **ENGINE, **EXACT).generate(first, params, use_tqdm=False)
    files = list(tmp_path.rglob("*.kvb"))
    assert files
    for f in files:  # flip one byte of every stored block
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        mt = f.stat().st_mtime_ns
        f.write_bytes(bytes(raw))
        os.utime(f, ns=(mt, mt))
    reader = LLM(kv_store=store, **ENGINE, **EXACT)
    got = reader.generate(second, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert reader.engine.prefix.link.fetched_blocks < 9 * len(second)  # the damaged blocks were misses


def test_kv_store_config_errors():
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_store: dict: must be None or a KVBlockStore"):
        EngineConfig(kv_store={})
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_store: needs prefix_caching=True"):
        EngineConfig(kv_store=InMemoryKVStore(), prefix_caching=False)
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_store_traffic_class"):
        EngineConfig(kv_store_traffic_class="")
