"""PagedKVPool / _C.kv.BlockPool: unit tests against hand-worked expectations and invariants."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.kv import PagedKVPool, compression_fires, num_compressed_entries


def test_allocate_append_free_roundtrip() -> None:
    p = PagedKVPool(num_blocks=9, block_size=4)
    assert p.num_free_blocks == 8  # block 0 is the null block
    assert p.allocate(1, 5)
    assert p.block_table(1).tolist() == [1, 2]
    assert p.num_free_blocks == 6
    assert p.append_slots(1, 3)  # 8 tokens: still 2 blocks
    assert p.num_free_blocks == 6
    assert p.append_slots(1, 1)  # 9 tokens: third block
    assert len(p.block_table(1)) == 3 and p.num_tokens(1) == 9
    p.free(1)
    assert p.num_free_blocks == 8 and not p.contains(1)
    p.check_invariants()


def test_out_of_blocks_is_false_and_no_change() -> None:
    p = PagedKVPool(num_blocks=4, block_size=2)
    assert p.allocate(1, 4)
    assert not p.can_allocate(3)
    assert not p.allocate(2, 3)
    assert not p.contains(2) and p.num_free_blocks == 1
    assert not p.append_slots(1, 3)  # needs 2 more
    assert p.num_tokens(1) == 4 and p.num_free_blocks == 1
    assert p.append_slots(1, 2)
    p.check_invariants()


def test_caller_bugs_raise_with_field_names() -> None:
    p = PagedKVPool(num_blocks=4, block_size=2)
    p.allocate(1, 1)
    with pytest.raises(ValueError, match="already exists"):
        p.allocate(1, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        p.allocate(2, -1)
    with pytest.raises(ValueError, match="unknown seq_id 7"):
        p.free(7)
    with pytest.raises(ValueError, match="already exists"):
        p.fork(1, 1)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVPool(num_blocks=0, block_size=2)
    with pytest.raises(TypeError, match="seq_id"):
        p.append_slots("a", 1)  # type: ignore[arg-type]


def test_fork_shares_then_copy_on_write_of_partial_last_block() -> None:
    p = PagedKVPool(num_blocks=10, block_size=4)
    p.allocate(1, 6)  # blocks [1, 2], last holds 2 of 4
    p.fork(1, 2)
    assert p.block_table(2).tolist() == [1, 2]
    assert p.refcount(1) == 2 and p.refcount(2) == 2
    free_before = p.num_free_blocks
    assert p.append_slots(2, 1)
    # the child writes position 6 into a private copy of block 2; block 1 (full) stays shared
    t2 = p.block_table(2).tolist()
    assert t2[0] == 1 and t2[1] != 2
    assert p.take_copy_ops().tolist() == [[2, t2[1], 2]]
    assert p.take_copy_ops().shape == (0, 3)
    assert p.num_free_blocks == free_before - 1
    # the parent is now the sole owner of block 2: it appends in place, no copy
    assert p.append_slots(1, 2)
    assert p.block_table(1).tolist() == [1, 2]
    assert p.take_copy_ops().shape == (0, 3)
    p.free(1)
    p.free(2)
    assert p.num_free_blocks == 9
    p.check_invariants()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    p = PagedKVPool(num_blocks=10, block_size=4)
    p.allocate(1, 8)
    p.fork(1, 2)
    assert p.append_slots(2, 1)
    assert p.block_table(2).tolist()[:2] == [1, 2]
    assert p.take_copy_ops().shape == (0, 3)


def test_cow_counts_in_can_append() -> None:
    p = PagedKVPool(num_blocks=3, block_size=4)  # 2 usable blocks
    p.allocate(1, 5)
    p.fork(1, 2)
    assert p.num_free_blocks == 0
    assert not p.can_append(2, 1)  # the private copy needs a block
    assert not p.append_slots(2, 1)
    p.check_invariants()


def test_block_tables_batch_and_slots() -> None:
    rng = np.random.default_rng()
    p = PagedKVPool(num_blocks=200, block_size=8)
    lens = rng.integers(0, 60, size=20)
    for i, n in enumerate(lens):
        assert p.allocate(100 + i, int(n))
    ids = np.arange(100, 120)
    bt = p.block_tables(ids)
    want_w = max(-(-int(n) // 8) for n in lens)
    assert bt.dtype == np.int32 and bt.shape == (20, want_w)
    for i, sid in enumerate(ids):
        row = p.block_table(int(sid))
        assert bt[i, : len(row)].tolist() == row.tolist()
        assert (bt[i, len(row) :] == 0).all()
    with pytest.raises(ValueError, match="width"):
        p.block_tables(ids, width=want_w - 1)
    out = np.full((20, want_w + 2), -1, dtype=np.int32)
    p.impl.fill_block_tables(ids, out)
    assert (out[:, :want_w] == bt).all() and (out[:, want_w:] == 0).all()
    sid = int(ids[np.argmax(lens)])
    n = p.num_tokens(sid)
    table = p.block_table(sid)
    slots = p.slot_mapping(sid, 0, n)
    assert slots.tolist() == [int(table[i // 8]) * 8 + i % 8 for i in range(n)]
    assert p.slot(sid, n - 1) == slots[-1]


def test_batch_forms_match_single_calls() -> None:
    p = PagedKVPool(num_blocks=12, block_size=4)  # 11 usable blocks
    ok = p.allocate_many([1, 2, 3, 4], [16, 16, 16, 4])
    assert ok.tolist() == [True, True, False, True]  # the third needs 4 of the 3 left
    assert p.append_slots_many([1, 4, 2], 4).tolist() == [True, True, False]  # 1 free, then 0
    p.free_many([1, 2, 4])
    assert p.num_free_blocks == 11 and p.num_seqs == 0
    p.check_invariants()


def test_compressed_entry_rule() -> None:
    for r in (1, 2, 4, 128):
        for n in range(0, 300):
            fired = sum(compression_fires(pos, r) for pos in range(n))
            assert num_compressed_entries(n, r) == fired == n // r
    assert [p for p in range(8) if compression_fires(p, 2)] == [1, 3, 5, 7]
    assert compression_fires(np.arange(8), 4).tolist() == [False, False, False, True] * 2


def test_batch_slot_mapping_tokens_and_compressed_entries() -> None:
    rng = np.random.default_rng()
    bs = 8
    p = PagedKVPool(num_blocks=100, block_size=bs)
    lens = rng.integers(1, 70, size=6)
    for i, n in enumerate(lens):
        p.allocate(i, int(n))
    starts = np.array([int(rng.integers(0, n)) for n in lens])
    counts = np.array([int(rng.integers(0, n - s + 1)) for n, s in zip(lens, starts, strict=True)])
    got = p.batch_slot_mapping(np.arange(6), starts, counts)
    want = [p.slot(i, pos) for i in range(6) for pos in range(starts[i], starts[i] + counts[i])]
    assert got.tolist() == want
    # ratio 2: entry e of a sequence sits in block e // 4 at entry offset e % 4; each slot unique per block
    for r in (2, 4, 8):
        epb = bs // r
        for i, n in enumerate(lens):
            ne = num_compressed_entries(int(n), r)
            s = p.slot_mapping(i, 0, ne, ratio=r)
            table = p.block_table(i)
            assert s.tolist() == [int(table[e // epb]) * epb + e % epb for e in range(ne)]
            assert len(set(s.tolist())) == ne
        with pytest.raises(ValueError, match="complete entries"):
            p.slot_mapping(0, 0, num_compressed_entries(int(lens[0]), r) + 1, ratio=r)
    with pytest.raises(ValueError, match="divide block_size"):
        p.slot_mapping(0, 0, 1, ratio=3)
    with pytest.raises(ValueError, match="outside"):
        p.slot_mapping(0, int(lens[0]), 1)


def test_truncate_releases_trailing_blocks_and_cow_still_applies() -> None:
    p = PagedKVPool(num_blocks=10, block_size=4)
    p.allocate(1, 10)  # 3 blocks
    p.fork(1, 2)
    p.truncate(2, 5)  # child keeps 2 shared blocks, drops its reference to the third
    assert p.block_table(2).tolist() == p.block_table(1).tolist()[:2]
    assert p.refcount(p.block_table(1).tolist()[2]) == 1
    assert p.append_slots(2, 1)  # writes position 5 into shared block 2: copy-on-write
    assert p.take_copy_ops().shape == (1, 3)
    p.truncate(1, 0)
    assert p.block_table(1).tolist() == [] and p.contains(1)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 0\]"):
        p.truncate(1, 3)
    p.check_invariants()
