"""Host SWA store: byte budget, LRU order, exact-position lookups, chained digests (hypothesis vs a model)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.swa import HostSWAStore, prefix_digests


def _rings(nbytes: int, fill: int = 0) -> np.ndarray:
    return np.full((1, 1, nbytes), fill, np.uint8)


def test_released_shape_entry_size():
    # 20 encoder layers x 134 ring tokens x 528 B (FP8 SWA): the seeds' 1,415,040 B per sequence
    assert np.zeros((20, 134, 528), np.uint8).nbytes == 1_415_040


def test_budget_and_lru():
    s = HostSWAStore(300)
    assert s.put(b"a", 8, _rings(100)) and s.put(b"b", 16, _rings(100)) and s.put(b"c", 24, _rings(100))
    assert s.get(b"a", 8) is not None  # a is now the most recent
    assert s.put(b"d", 32, _rings(100))  # evicts b, the least recently used
    assert b"b" not in s and {b"a", b"c", b"d"} <= set(s._d) and s.nbytes == 300
    assert s.stats.evictions == 1
    assert not s.put(b"e", 8, _rings(301)) and s.stats.rejected == 1 and b"a" in s  # too big: nothing evicted
    assert s.get(b"a", 9) is None and s.get(b"a", 8, b"other-model") is None  # exact position and extra key


def test_stored_copy_is_independent():
    s = HostSWAStore(10)
    r = _rings(4, 7)
    s.put(b"k", 4, r)
    r[...] = 0
    assert (s.get(b"k", 4) == 7).all()


def test_bad_input():
    with pytest.raises(ValueError, match="byte_budget"):
        HostSWAStore(-1)
    s = HostSWAStore(10)
    with pytest.raises(ValueError, match="key"):
        s.put(b"", 1, _rings(1))
    with pytest.raises(ValueError, match="pos"):
        s.put(b"k", 0, _rings(1))
    with pytest.raises(ValueError, match="rings"):
        s.put(b"k", 1, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="block"):
        prefix_digests([1, 2], 0)


def test_digests_chain_and_continue():
    t = np.arange(40) % 7
    d = prefix_digests(t, 8)
    assert len(d) == 5 and len(set(d)) == 5
    assert prefix_digests(t[:24], 8) == d[:3]
    assert prefix_digests(t, 8, start=d[:2]) == d
    u = t.copy()
    u[3] += 1  # a change in block 0 changes every later digest
    assert all(a != b for a, b in zip(prefix_digests(u, 8), d))


@given(
    st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5), st.integers(1, 60)), max_size=60),
    st.integers(0, 150),
)
def test_store_matches_an_lru_model(ops, budget):
    s = HostSWAStore(budget)
    model: OrderedDict[int, int] = OrderedDict()
    for op, k, size in ops:
        key = bytes([k + 1])
        if op == "put":
            ok = s.put(key, 1, _rings(size))
            assert ok == (size <= budget)
            if ok:
                model.pop(k, None)
                while model and sum(model.values()) + size > budget:
                    model.popitem(last=False)
                model[k] = size
        else:
            got = s.get(key, 1)
            assert (got is not None) == (k in model)
            if k in model:
                model.move_to_end(k)
        assert list(s._d) == [bytes([m + 1]) for m in model] and s.nbytes == sum(model.values()) <= budget
