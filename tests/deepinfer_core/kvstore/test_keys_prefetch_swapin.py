"""block_keys (prefix property, brute force), the prefetcher (results, in-flight bound) and the
layer-wise swap-in (bytes equal to a direct copy; layer i ready before later layers on the CPU path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.kvstore import (
    InMemoryKVStore,
    LayerwiseSwapIn,
    Prefetcher,
    TTLPolicy,
    block_keys,
    pack_layers,
)


@settings(max_examples=60)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=70),
    bs=st.integers(1, 8),
    pos=st.integers(0, 69),
    extra=st.one_of(st.none(), st.binary(max_size=8)),
)
def test_block_keys_are_prefix_hashes(tokens, bs, pos, extra):
    keys = block_keys(tokens, bs, extra)
    assert len(keys) == len(tokens) // bs and all(len(k) == 16 for k in keys)
    for n in range(len(keys) + 1):  # a prefix's keys are the prefix of the keys
        assert block_keys(tokens[: n * bs], bs, extra) == keys[:n]
    if tokens:
        p = pos % len(tokens)
        changed = list(tokens)
        changed[p] += 1
        k2 = block_keys(changed, bs, extra)
        first = p // bs
        assert k2[:first] == keys[:first]
        assert all(a != b for a, b in zip(k2[first:], keys[first:]))  # chained: every later block differs
        other_extra = (extra or b"") + b"!"
        assert all(a != b for a, b in zip(block_keys(tokens, bs, other_extra), keys))
    assert len(set(keys)) == len(keys)


def test_block_keys_errors():
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0)
    with pytest.raises(ValueError, match="tokens: must be 1-D"):
        block_keys([[1, 2]], 1)


class _SlowStore(InMemoryKVStore):
    """Counts concurrent gets, to check the prefetcher's in-flight bound."""

    def __init__(self):
        super().__init__(TTLPolicy({"chatbot": 1000.0}))
        self.active = 0
        self.peak = 0
        self._m = threading.Lock()

    def get(self, key):
        with self._m:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.002)
        try:
            return super().get(key)
        finally:
            with self._m:
                self.active -= 1


def test_prefetch_returns_blocks_and_respects_inflight_bound():
    store = _SlowStore()
    rng = np.random.default_rng(5)
    keys = [os.urandom(16) for _ in range(40)]
    blocks = {}
    for k in keys[:30]:
        b = rng.integers(0, 256, 1000, dtype=np.uint8)
        store.put(k, b)
        blocks[k] = b
    order = [keys[i] for i in rng.permutation(40)]
    with Prefetcher(store, num_workers=8, max_inflight_bytes=3000, expected_block_bytes=1000) as pf:
        batch = pf.prefetch(order)
        res = batch.result(timeout=30)
    assert batch.done()
    for k, r in zip(order, res):
        if k in blocks:
            assert r is not None and r.dtype == np.uint8 and np.array_equal(r, blocks[k])
        else:
            assert r is None
    assert 1 <= store.peak <= 3  # 3000 bytes in flight / 1000 per read
    with Prefetcher(store, num_workers=2) as pf:
        lead = pf.prefetch([keys[0], keys[1], keys[35], keys[2]]).leading_hits()
    assert [x.tobytes() for x in lead] == [blocks[keys[0]].tobytes(), blocks[keys[1]].tobytes()]
    with pytest.raises(ValueError, match=r"Prefetcher\.num_workers"):
        Prefetcher(store, num_workers=0)


def _swap_case(seed: int, device: str):
    rng = np.random.default_rng(seed)
    nl, width, rows, n = 4, 96, 20, 6
    ids = rng.choice(rows, n, replace=False)
    per_layer = [[rng.integers(0, 256, width, dtype=np.uint8) for _ in range(nl)] for _ in range(n)]
    host = [pack_layers(layers) for layers in per_layer]
    before = [torch.from_numpy(rng.integers(0, 256, (rows, width), dtype=np.uint8)) for _ in range(nl)]
    dst = [b.clone().to(device) for b in before]
    expect = [b.clone() for b in before]
    for j, r in enumerate(ids):
        for i in range(nl):
            expect[i][r] = torch.from_numpy(per_layer[j][i])
    return dst, host, ids, expect, before


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swapin_cpu_layer_by_layer(seed):
    dst, host, ids, expect, before = _swap_case(seed, "cpu")
    swap = LayerwiseSwapIn(dst, host, ids)
    for i in range(len(dst)):
        swap.wait_layer(i)
        assert torch.equal(dst[i], expect[i])  # this layer is in place
        for later in range(i + 1, len(dst)):  # and later ones are not yet (copied when asked)
            assert torch.equal(dst[later], before[later])
    swap.wait_all()
    assert all(torch.equal(a, b) for a, b in zip(dst, expect))


def test_swapin_errors():
    dst, host, ids, *_ = _swap_case(0, "cpu")
    with pytest.raises(ValueError, match="block_ids"):
        LayerwiseSwapIn(dst, host, ids[:-1])
    with pytest.raises(ValueError, match=r"host_blocks\[0\]"):
        LayerwiseSwapIn(dst, [h[:-1] for h in host], ids)
    with pytest.raises(ValueError, match="block_ids: must lie in"):
        LayerwiseSwapIn(dst, host, [99] * len(ids))
    with pytest.raises(ValueError, match="layer=9"):
        LayerwiseSwapIn(dst, host, ids).wait_layer(9)


@pytest.mark.gpu
def test_swapin_cuda_matches_direct_copy():
    dst, host, ids, expect, _ = _swap_case(7, "cuda")
    swap = LayerwiseSwapIn(dst, host, ids)
    for i in range(len(dst)):
        swap.wait_layer(i)
        assert torch.equal(dst[i].cpu(), expect[i])


def test_kvstore_imports_no_torch():
    code = "import sys, deepinfer_core.kvstore; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_swapin_from_staged_tensor():
    from deepinfer_core.kvstore import stage

    dst, host, ids, expect, _ = _swap_case(3, "cpu")
    staged = stage(host, len(dst), int(dst[0].shape[1]))
    assert staged.shape == (len(dst), len(host), dst[0].shape[1])
    LayerwiseSwapIn(dst, staged, ids).wait_all()
    assert all(torch.equal(a, b) for a, b in zip(dst, expect))
    with pytest.raises(ValueError, match="staged tensor must be uint8"):
        LayerwiseSwapIn(dst, staged[:, :, :-1], ids)
