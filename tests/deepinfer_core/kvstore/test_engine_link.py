"""BlockCodec (pool blocks <-> bytes) and StoreLink (fetch up to the first miss, write-back once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.kvstore import BlockCodec, InMemoryKVStore, StoreLink, TTLPolicy


def _caches(seed: int, blocks: int = 12):
    g = torch.Generator().manual_seed(seed)
    shapes = [(blocks, 4, 9), (blocks, 4, 3), (blocks, 4, 9), (blocks, 4, 3)]  # kv, idx of two layers
    return [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in shapes]


class _Ex:  # the two dicts of a ModelExecutor that a block lives in
    def __init__(self, caches):
        self.kv = {3: caches[2], 0: caches[0]}
        self.index_keys = {0: caches[1], 3: caches[3]}


def test_codec_roundtrip_and_layout():
    src, dst = _caches(0), _caches(1)
    a = BlockCodec.from_executor(_Ex(src))
    assert [c is s for c, s in zip(a.caches, src)] == [True] * 4  # layer 0 kv, idx, then layer 3
    assert a.nbytes == 4 * (9 + 3 + 9 + 3)
    got = a.read([5, 2])
    want = np.concatenate([c[5].reshape(-1).numpy() for c in src])
    assert np.array_equal(got[0], want)
    b = BlockCodec(dst)
    before = [c.clone() for c in dst]
    b.write([7, 1], got)
    for c, s, o in zip(dst, src, before):
        assert torch.equal(c[7], s[5]) and torch.equal(c[1], s[2])
        keep = [i for i in range(12) if i not in (7, 1)]
        assert torch.equal(c[keep], o[keep])  # nothing else written
    with pytest.raises(ValueError, match="block 0 is the null block"):
        a.read([0])
    with pytest.raises(ValueError, match=r"payloads\[0\]: 3 bytes"):
        b.write([1], [b"abc"])


def test_link_fetches_up_to_the_first_miss_and_writes_back_once():
    store = InMemoryKVStore(TTLPolicy({"chatbot": 100.0}))
    src = _caches(2)
    link = StoreLink(store, BlockCodec(src), 4, extra_key=b"tiny-seed0-fp4")
    tokens = np.arange(21) % 7  # 5 full blocks
    table = np.array([3, 9, 4, 11, 6])
    link.write_back(tokens, table, 0, 3)
    assert link.written_blocks == 3 and len(store) == 3
    link.write_back(tokens, table, 0, 3)  # already there: nothing rewritten
    assert link.written_blocks == 3
    dst = _caches(3)
    other = StoreLink(store, BlockCodec(dst), 4, extra_key=b"tiny-seed0-fp4")
    got = other.fetch(tokens, 0)
    assert len(got) == 3  # blocks 3, 4 were never written
    other.codec.write([1, 2, 5], got)
    for c, s in zip(dst, src):
        assert torch.equal(c[[1, 2, 5]], s[[3, 9, 4]])
    assert len(other.fetch(tokens, 1)) == 2
    changed = tokens.copy()
    changed[5] += 1  # block 1 differs: blocks 1.. have other keys
    assert len(other.fetch(changed, 0)) == 1
    assert StoreLink(store, BlockCodec(dst), 4, extra_key=b"other-model").fetch(tokens, 0) == []
    with pytest.raises(ValueError, match="extra_key"):
        StoreLink(store, BlockCodec(dst), 4, extra_key=b"")
