"""StatePool, SWA ring arithmetic (against a brute-force list simulation) and the memory planner."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.kv import StatePool, ring
from deepinfer_core.kv.formats import get_format
from deepinfer_core.kv.planner import KVModelConfig, StateLayout, block_bytes, plan_memory

# ---------------------------------------------------------------- ring arithmetic


class RingSim:
    """Brute force: a list of R slots, each holding the position last written into it."""

    def __init__(self, r: int) -> None:
        self.slots = [-1] * r
        self.n = 0
        self.hw = 0

    def write(self, count: int) -> None:
        for _ in range(count):
            self.slots[self.n % len(self.slots)] = self.n
            self.n += 1
        self.hw = max(self.hw, self.n)


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 12),
    back=st.integers(0, 6),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=40),
)
def test_ring_matches_simulation(window: int, back: int, ops: list[tuple[bool, int]]) -> None:
    r = window + back
    sim = RingSim(r)
    for is_write, amount in ops:
        if is_write:
            first, cnt = ring.surviving_write(sim.n, amount, window, back)
            assert first + cnt == sim.n + amount and cnt == min(amount, r)
            idx = ring.ring_indices(sim.n, amount, window, back)
            assert idx.tolist() == [p % r for p in range(sim.n, sim.n + amount)]
            if amount:
                assert ring.write_index(sim.n, window, back) == idx[0]
            sim.write(amount)
        else:
            k = min(amount, sim.n)
            limit = ring.max_rollback(sim.n, window, back, sim.hw)
            # brute-force limit: the largest k such that every rollback up to k leaves an intact window
            brute = 0
            while brute < sim.n and all(
                sim.slots[p % r] == p for p in range(max(0, sim.n - brute - 1 - window), sim.n - brute - 1)
            ):
                brute += 1
            assert limit == brute
            if k > limit:
                with pytest.raises(ValueError, match="backtracking"):
                    ring.rollback(sim.n, k, window, back, sim.hw)
                continue
            sim.n = ring.rollback(sim.n, k, window, back, sim.hw)
        n = sim.n
        # live window: every position the attention reads is physically in its slot
        live = ring.live_ring_indices(n, window, back)
        lo, hi = ring.live_range(n, window, back)
        assert list(range(lo, hi)) == [sim.slots[i] for i in live]
        # ring_positions: exactly the slots holding a valid (not rolled-back) position
        pos = ring.ring_positions(n, window, back, sim.hw)
        assert pos.tolist() == [p if 0 <= p < n else -1 for p in sim.slots]
        hlo, hhi = ring.held_range(n, window, back, sim.hw)
        assert sorted(p for p in pos.tolist() if p >= 0) == list(range(hlo, hhi))


def test_max_rollback_is_exact() -> None:
    w, b = 128, 6
    # before the ring wraps any rollback is safe; afterwards exactly `backtracking`
    assert ring.max_rollback(100, w, b) == 100
    assert ring.max_rollback(134, w, b) == 134
    assert ring.max_rollback(135, w, b) == 6
    assert ring.rollback(1000, 6, w, b) == 994
    with pytest.raises(ValueError, match="at most 6"):
        ring.rollback(1000, 7, w, b)
    arr = np.array([10, 500, 134])
    assert ring.max_rollback(arr, w, b).tolist() == [10, 6, 134]
    assert ring.rollback(arr, np.array([3, 6, 0]), w, b).tolist() == [7, 494, 134]
    assert ring.write_index(np.array([0, 133, 134, 1000]), w, b).tolist() == [0, 133, 0, 1000 % 134]
    # rollbacks share one budget until a write reaches a new high-water mark
    n = ring.rollback(1000, 5, w, b, high_water=1000)
    assert ring.max_rollback(n, w, b, high_water=1000) == 1
    with pytest.raises(ValueError, match="at most 1"):
        ring.rollback(n, 2, w, b, high_water=1000)
    assert ring.max_rollback(np.array([995, 990]), w, b, high_water=np.array([1000, 1000])).tolist() == [1, 0]
    with pytest.raises(ValueError, match="high_water"):
        ring.max_rollback(10, w, b, high_water=5)


def test_accumulator_fill_rule() -> None:
    for r in (0, 1, 2, 4):
        for n in range(40):
            fired = sum(1 for p in range(n) if r >= 1 and (p + 1) % r == 0)
            pending = n - fired * max(r, 1) if r >= 2 else 0
            assert ring.accumulator_fill(n, r) == pending


def test_ring_bad_input() -> None:
    with pytest.raises(ValueError, match="window"):
        ring.ring_size(0, 6)
    with pytest.raises(ValueError, match="num_tokens"):
        ring.write_index(-1, 4, 2)
    with pytest.raises(TypeError, match="start"):
        ring.ring_indices(1.5, 2, 4, 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------- planner


def test_persisted_swa_bytes_reproduce_the_released_figure() -> None:
    cfg = KVModelConfig()
    layout = StateLayout.build(cfg)
    assert cfg.ring_tokens == 134 and cfg.swa_bytes_per_token == 528
    assert layout.persisted_bytes == 20 * 134 * 528 == 1_415_040
    plan = plan_memory(cfg, 64 * 2**30, max_num_seqs=128)
    assert plan.persisted_swa_bytes_per_seq == 1_415_040
    # the persisted rings come first and are contiguous
    assert layout.ring_offsets[:20] == tuple(i * 134 * 528 for i in range(20))
    assert min(layout.ring_offsets[20:]) == layout.persisted_bytes


def test_block_bytes_by_hand() -> None:
    cfg = KVModelConfig()
    main, index = block_bytes(cfg, 64)
    # main KV sources 2, 8, 14 (ratio 2) and 20 (ratio 1): 3 * 32 + 64 entries of 288 B
    assert main == (3 * 32 + 64) * 288
    # index sources 2, 8, 14 (ratio 2) and 20..36 (ratio 1): 3 * 32 + 5 * 64 entries of 68 B
    assert index == (3 * 32 + 5 * 64) * 68
    with pytest.raises(ValueError, match="multiple of the largest compress ratio 2"):
        block_bytes(cfg, 63)


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(0, 2**36), seqs=st.integers(1, 512), bs=st.sampled_from([16, 32, 64, 128]))
def test_plan_fits_budget_and_is_maximal(budget: int, seqs: int, bs: int) -> None:
    cfg = KVModelConfig()
    layout = StateLayout.build(cfg)
    main, index = block_bytes(cfg, bs)
    per_block = main + index
    if budget - seqs * layout.bytes_per_seq < 2 * per_block:
        with pytest.raises(ValueError, match="max_num_seqs"):
            plan_memory(cfg, budget, max_num_seqs=seqs, block_size=bs)
        return
    p = plan_memory(cfg, budget, max_num_seqs=seqs, block_size=bs)
    assert p.total_bytes <= budget
    assert budget - p.total_bytes < per_block  # one more block would not fit
    assert p.total_bytes == seqs * p.state_bytes_per_seq + p.num_blocks * p.bytes_per_block
    assert p.max_cached_tokens == (p.num_blocks - 1) * bs


def test_state_layout_sums_and_tiny_config() -> None:
    for cfg in (KVModelConfig(), KVModelConfig.tiny()):
        lay = StateLayout.build(cfg)
        swa = (
            (cfg.num_layers + cfg.num_draft_layers)
            * cfg.ring_tokens
            * get_format("fp8", cfg.head_dim).bytes_per_token
        )
        acc = sum(cfg.compress_ratios[i] * cfg.accumulator_bytes_per_token for i in cfg.compressing_layers())
        assert lay.bytes_per_seq == swa + acc
        spans = sorted(
            [(o, o + lay.ring_bytes) for o in lay.ring_offsets]
            + [
                (lay.accumulator_offsets[k], lay.accumulator_offsets[k] + lay.accumulator_bytes[k])
                for k in lay.accumulator_offsets
            ]
        )
        assert spans[0][0] == 0 and spans[-1][1] == lay.bytes_per_seq
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gaps, no overlaps


def test_config_validation_and_hf_mapping() -> None:
    with pytest.raises(ValueError, match="compress_ratios must have num_layers=8"):
        KVModelConfig(num_layers=8)
    with pytest.raises(ValueError, match="kv_source_layer_ids holds layer 0"):
        attrs.evolve(KVModelConfig.tiny(), kv_source_layer_ids=(0,))
    hf = {
        "num_hidden_layers": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        "sliding_window": 16,
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "head_dim": 64,
        "index_head_dim": 32,
    }
    cfg = KVModelConfig.from_hf_config(hf, accumulator_bytes_per_token=512)
    assert cfg == KVModelConfig.tiny()


# ---------------------------------------------------------------- StatePool


def test_state_pool_slots_and_views() -> None:
    cfg = KVModelConfig.tiny()
    lay = StateLayout.build(cfg)
    pool = StatePool(3, layout=lay)
    assert pool.num_free_slots == 3
    s = [pool.acquire(10), pool.acquire(11), pool.acquire(12)]
    assert sorted(s) == [0, 1, 2] and pool.acquire(13) is None
    with pytest.raises(ValueError, match="already holds"):
        pool.acquire(10)
    assert pool.slots([12, 10]).tolist() == [s[2], s[0]]
    # views alias the right bytes: a ring write shows up in the persisted prefix of that slot only
    r = pool.ring(11, 1)
    assert r.shape == (cfg.ring_tokens, 64 + 2)  # fp8 at head_dim 64: 64 e4m3 + 2 ue8m0 scales
    r[3] = 7
    assert pool.storage is not None
    flat = pool.storage[s[1]]
    off = lay.ring_offsets[1] + 3 * lay.token_bytes
    assert (flat[off : off + lay.token_bytes] == 7).all() and int(flat.sum()) == 7 * lay.token_bytes
    assert int(pool.persisted(11).sum()) == 7 * lay.token_bytes
    assert int(pool.storage[s[0]].sum()) == 0
    assert pool.accumulator(11, 2).numel() == 2 * cfg.accumulator_bytes_per_token
    with pytest.raises(ValueError, match="compressing layers"):
        pool.accumulator(11, 5)
    pool.release(11)
    assert pool.acquire(20) == s[1]
    with pytest.raises(ValueError, match="unknown seq_id 99"):
        pool.release(99)
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="no bytes"):
        StatePool(1).ring(0, 0)
    assert isinstance(pool.storage, torch.Tensor)


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 15)), max_size=80), n=st.integers(0, 8))
def test_state_pool_property(ops: list[tuple[bool, int]], n: int) -> None:
    pool = StatePool(n)
    held: dict[int, int] = {}
    for acquire, sid in ops:
        if acquire:
            if sid in held:
                with pytest.raises(ValueError):
                    pool.acquire(sid)
                continue
            s = pool.acquire(sid)
            if len(held) == n:
                assert s is None
            else:
                assert s is not None and s not in held.values() and 0 <= s < n
                held[sid] = s
        elif sid in held:
            pool.release(sid)
            del held[sid]
        else:
            with pytest.raises(ValueError):
                pool.release(sid)
        pool.check_invariants()
        assert pool.num_free_slots == n - len(held)
        assert all(pool.slot(k) == v for k, v in held.items())
    for sid in list(held):
        pool.release(sid)
    assert pool.num_free_slots == n
