"""PrefixIndex: hand-worked cases (hits, extra keys, LRU eviction order, revival, re-caching)."""

from __future__ import annotations

import pytest

from deepinfer_core.kv import PagedKVPool, PrefixIndex


def make(num_blocks: int = 10, bs: int = 4) -> tuple[PagedKVPool, PrefixIndex]:
    pool = PagedKVPool(num_blocks, bs)
    return pool, PrefixIndex(pool)


def test_insert_then_match_whole_blocks_only() -> None:
    pool, idx = make()
    toks = list(range(10))  # 2 full blocks + 2 tokens
    assert pool.allocate(1, 10)
    idx.insert_seq(1, toks)
    assert idx.num_cached_blocks == 2  # the partial block is never cached
    t = pool.block_table(1).tolist()
    assert idx.match(toks) == (8, t[:2])
    assert idx.match(toks[:7]) == (4, t[:1])
    assert idx.match([0, 1, 2, 9, 4, 5, 6, 7]) == (0, [])
    assert idx.match(toks, extra_key=b"other") == (0, [])  # the extra key is part of the identity
    # a second request shares the two blocks by refcount and gets a fresh third one
    assert idx.allocate(2, [*toks, 42]) == 8
    t2 = pool.block_table(2).tolist()
    assert t2[:2] == t[:2] and t2[2] != t[2]
    assert pool.refcount(t[0]) == 2 and pool.refcount(t[2]) == 1
    pool.check_invariants()


def test_freed_cached_blocks_stay_matchable_and_count_as_free() -> None:
    pool, idx = make(num_blocks=5)  # 4 usable
    assert pool.allocate(1, 8)
    idx.insert_seq(1, [1] * 8)
    pool.free(1)
    assert pool.num_free_blocks == 4 and idx.num_evictable_blocks == 2
    hit = idx.match([1] * 8)
    assert hit[0] == 8
    # reviving them takes them off the evictable list
    assert pool.allocate(2, 8, prefix_blocks=hit[1])
    assert pool.num_free_blocks == 2 and idx.num_evictable_blocks == 0
    pool.free(2)


def test_lru_eviction_order_and_never_returning_evicted_blocks() -> None:
    pool, idx = make(num_blocks=5, bs=2)  # 4 usable
    for sid, tok in ((1, 7), (2, 8)):
        assert pool.allocate(sid, 4)
        idx.insert_seq(sid, [tok] * 4)
    pool.free(1)  # released first: oldest
    pool.free(2)
    assert pool.num_free_blocks == 4 and idx.num_evictable_blocks == 4
    # a 3-block sequence must evict 3 cached blocks: seq 1's two (tail first), then seq 2's tail
    assert pool.allocate(3, 6)
    assert idx.match([7] * 4) == (0, [])
    n, blocks = idx.match([8] * 4)
    assert n == 2 and pool.refcount(blocks[0]) == 0 and idx.is_cached(blocks[0])
    pool.check_invariants()


def test_allocation_failure_leaves_cache_intact() -> None:
    pool, idx = make(num_blocks=4, bs=2)  # 3 usable
    assert pool.allocate(1, 4)
    idx.insert_seq(1, [5, 5, 5, 5])
    assert idx.allocate(2, [5, 5, 5, 5, 6, 6, 6, 6]) is None  # needs 2 fresh, 1 free
    assert not pool.contains(2) and idx.num_cached_blocks == 2
    assert idx.allocate(2, [5, 5, 5, 5, 6, 6]) == 4
    pool.check_invariants()


def test_recache_after_parent_eviction_adopts_the_block() -> None:
    # regression (found by the stateful test): a cached block whose parent entry was evicted must be
    # re-insertable under the re-cached parent, and then be found again.
    pool, idx = make(num_blocks=14, bs=4)
    a = [0, 1, 2, 0, 1, 2, 0, 1]
    b = [0, 1, 2, 0, 1, 2, 0, 2]
    pool.allocate(0, 8)
    idx.insert_seq(0, a)
    pool.free(0)
    pool.allocate(1, 8)  # fresh blocks; its first block duplicates a cached one
    idx.insert_seq(1, b)
    idx.evict_all()  # drops seq 0's blocks: seq 1's second block is now an orphan
    assert idx.match(b)[0] == 0
    idx.insert_seq(1, b)
    assert idx.match(b) == (8, pool.block_table(1).tolist())
    pool.check_invariants()


def test_bad_prefix_arguments() -> None:
    pool, idx = make()
    pool.allocate(1, 4)
    with pytest.raises(ValueError, match="free"):
        pool.allocate(2, 8, prefix_blocks=[5])  # a free block: stale match result
    with pytest.raises(ValueError, match="at most 1"):
        pool.allocate(2, 4, prefix_blocks=[*pool.block_table(1).tolist(), 3])
    with pytest.raises(ValueError, match="not in use"):
        idx.insert([1, 2, 3, 4], [7])
    with pytest.raises(TypeError, match="extra_key"):
        idx.match([1, 2, 3, 4], extra_key=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PagedKVPool"):
        PrefixIndex(object())  # type: ignore[arg-type]
