"""CPU tests of the references the cuda kernels are checked against (ops/kv_store.py, ops/indexer.py).

Each is compared with a brute-force oracle written independently here (loops over tokens / keys).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.kv.formats import get_format
from deepinfer_kernels import get_op


@pytest.mark.parametrize(("fmt", "dim"), [("fp8", 512), ("fp4", 512), ("mxfp4", 128), ("bf16", 64)])
def test_kv_store_and_load_against_loops(fmt: str, dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    f = get_format(fmt, dim)
    blocks, bs = 6, 4
    pool = torch.randint(0, 256, (blocks, bs, f.bytes_per_token), dtype=torch.uint8, generator=g)
    before = pool.clone()
    x = torch.randn(9, dim, generator=g) * 3
    slots = torch.randperm(blocks * bs, generator=g)[:9]
    slots[4] = -1
    get_op("kv_store")(pool, x, slots, fmt)
    flat, flat0 = pool.view(-1, f.bytes_per_token), before.view(-1, f.bytes_per_token)
    written = set()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], f.quantize(x[i]))
            written.add(s)
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert torch.equal(flat[untouched], flat0[untouched])
    table = torch.tensor([[2, 0, 5], [1, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 3])
    out = get_op("kv_load")(pool, table, lens, fmt, dim)
    assert out.shape == (2, 12, dim)
    for b in range(2):
        for t in range(12):
            want = f.dequantize(pool[table[b, t // bs], t % bs]) if t < lens[b] else torch.zeros(dim)
            torch.testing.assert_close(
                out[b, t], want, rtol=0, atol=0, equal_nan=True
            )  # random bytes: NaN codes


def test_kv_bad_input_named() -> None:
    pool = torch.zeros(2, 4, 528, dtype=torch.uint8)
    with pytest.raises(IndexError, match="slot_mapping"):
        get_op("kv_store")(pool, torch.randn(1, 512), torch.tensor([8]), "fp8")
    with pytest.raises(ValueError, match="pool"):
        get_op("kv_store")(pool, torch.randn(1, 512), torch.tensor([0]), "fp4")
    with pytest.raises(ValueError, match="seq_lens"):
        get_op("kv_load")(pool, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5]), "fp8")


def test_last_writer_only_brute_force() -> None:
    from deepinfer_kernels.ops.kv_store import last_writer_only

    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        s = torch.randint(0, 6, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        got = last_writer_only(s).tolist()
        want = [v if v not in s.tolist()[i + 1 :] else -1 for i, v in enumerate(s.tolist())]
        assert got == want


def test_swa_ring_rollback_keeps_window() -> None:
    write, read = get_op("swa_ring_write"), get_op("swa_ring_read")
    f = get_format("fp8", 512)
    g = torch.Generator().manual_seed(2)
    ring = torch.zeros(2, 10, 528, dtype=torch.uint8)  # window 8 + 2 backtracking
    x = torch.randn(13, 512, generator=g)
    write(ring, x, torch.zeros(13, dtype=torch.int64), torch.arange(13))  # longer than the ring: last wins
    drafts = torch.randn(2, 512, generator=g)
    write(ring, drafts, torch.zeros(2, dtype=torch.int64), torch.tensor([13, 14]))
    # both drafts rejected: length stays 13; the window is tokens 5..12
    got = read(ring, torch.tensor([0, 1]), torch.tensor([13, 0]), window=8)
    assert torch.equal(got[0], f.dequantize(f.quantize(x[5:13])))
    assert not got[1].any()
    with pytest.raises(ValueError, match="window"):
        read(ring, torch.tensor([0]), torch.tensor([13]), window=11)


def test_indexer_scores_and_topk_brute_force() -> None:
    g = torch.Generator().manual_seed(4)
    t, h, d, s = 3, 4, 8, 11
    q, k, w = torch.randn(t, h, d, generator=g), torch.randn(s, d, generator=g), torch.rand(t, h, generator=g)
    ks, ke = torch.tensor([0, 2, 5]), torch.tensor([11, 6, 5])
    scores = get_op("indexer_scores")(q, w, k, ks, ke)
    for i in range(t):
        for j in range(s):
            if ks[i] <= j < ke[i]:
                want = sum(
                    float(w[i, hh]) * max(0.0, float(q[i, hh].double() @ k[j].double())) for hh in range(h)
                )
                assert scores[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
            else:
                assert scores[i, j] == float("-inf")
    idx = get_op("indexer_topk")(scores, 6)
    assert idx.shape == (3, 6) and idx.dtype == torch.int32
    for i in range(t):
        valid = [j for j in range(s) if ks[i] <= j < ke[i]]
        best = sorted(valid, key=lambda j: -scores[i, j].item())[:6]
        got = [j for j in idx[i].tolist() if j >= 0]
        assert sorted(scores[i, got].tolist()) == sorted(scores[i, best].tolist())
        assert idx[i].tolist().count(-1) == 6 - len(best)
    with pytest.raises(ValueError, match="weights"):
        get_op("indexer_scores")(q, w[:, :2], k, ks, ke)
