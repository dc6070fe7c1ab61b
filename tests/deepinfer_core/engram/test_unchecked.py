"""The check-free Engram paths (issue #24): ``LocalEngramTable.fetch(check=False)``, the ``engram_gather`` /
``engram_hash`` ops with ``check=False`` and ``EngramHasher.hash(validate=False)``.

Oracles: a per-id brute-force row read (fp8 dequantised in float64) and the per-token Python-int hash
(``_oracle.py``); on valid inputs the check-free results equal those and the checked ones (hypothesis,
random sizes). The checked paths still raise naming the field. "No host read" is shown twice: on the meta
device, where any read of a value (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``) raises, the
check-free paths run and the checked ones fail (so the test can fail); on the CPU a dispatch mode counts
the ops that synchronise on CUDA (``_local_scalar_dense`` behind ``.item()`` / ``bool()``, ``nonzero``...).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engram import EngramConfig, EngramHasher, LocalEngramTable, quantize_fp8
from deepinfer_kernels import get_op
from tests.deepinfer_core.model.test_cuda_graphs import SyncOps

from ._oracle import oracle_hash


def _table_values(rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes 2**-8 .. 2**6 per row: the fp8 block scales differ and no product is subnormal
    return torch.randn(rows, dim, generator=g) * torch.exp2(
        torch.randint(-8, 6, (rows, 1), generator=g).float()
    )


def _brute_rows(values: torch.Tensor, fmt: str, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row by row: bf16 storage as stored; fp8 values times 2**(code - 127) per 32-value block in float64."""
    dim = values.shape[1]
    if fmt == "bf16":
        stored = values.to(torch.bfloat16)
        rows = [stored[i].to(torch.float64) for i in ids.reshape(-1).tolist()]
    else:
        data, codes = quantize_fp8(values)
        rows = [
            torch.cat(
                [
                    data[i, b * 32 : (b + 1) * 32].to(torch.float64) * 2.0 ** (int(codes[i, b]) - 127)
                    for b in range(dim // 32)
                ]
            )
            for i in ids.reshape(-1).tolist()
        ]
    flat = torch.stack(rows) if rows else torch.empty(0, dim, dtype=torch.float64)
    return flat.to(out_dtype).reshape(*ids.shape, dim)


def _table(values: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.bfloat16) -> LocalEngramTable:
    data, scales = quantize_fp8(values) if fmt == "fp8" else (values.to(torch.bfloat16), None)
    return LocalEngramTable(data, scales, out_dtype=out_dtype)


# ---------------------------------------------------------------- fetch / engram_gather


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 200),
    blocks=st.integers(1, 3),
    fmt=st.sampled_from(["bf16", "fp8"]),
    shape=st.lists(st.integers(0, 5), max_size=3),
    id_dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_unchecked_fetch_equals_checked_and_brute_force(
    rows: int,
    blocks: int,
    fmt: str,
    shape: list[int],
    id_dtype: torch.dtype,
    out_dtype: torch.dtype,
    seed: int,
) -> None:
    values = _table_values(rows, 32 * blocks, seed)
    t = _table(values, fmt, out_dtype)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, tuple(shape), generator=g).to(id_dtype)
    if ids.numel():
        ids.view(-1)[0] = rows - 1  # the last row
    want = _brute_rows(values, fmt, ids, out_dtype)
    got = t.fetch(ids, check=False)
    assert got.shape == (*shape, 32 * blocks) and got.dtype == out_dtype
    assert torch.equal(got, want)
    assert torch.equal(t.fetch(ids), want)
    op = get_op("engram_gather")
    assert torch.equal(op(t.data, ids, t.scales, out_dtype, check=False), want)
    assert torch.equal(op(t.data, ids, t.scales, out_dtype), want)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 100),
    past=st.integers(0, 50),
    negative=st.booleans(),
    fmt=st.sampled_from(["bf16", "fp8"]),
)
def test_checked_fetch_still_raises_naming_the_ids(rows: int, past: int, negative: bool, fmt: str) -> None:
    t = _table(_table_values(rows, 32, rows), fmt)
    bad = -1 - past if negative else rows + past
    ids = torch.tensor([[0, bad], [rows - 1, 0]])
    msg = rf"row_ids: id {bad} is outside \[0, num_rows={rows}\)"
    with pytest.raises(IndexError, match=msg):
        t.fetch(ids)
    with pytest.raises(IndexError, match=msg):
        get_op("engram_gather")(t.data, ids, t.scales)
    with pytest.raises(TypeError, match="row_ids"):  # the dtype check reads no value: kept when unchecked
        t.fetch(torch.tensor([0.0]), check=False)


# ---------------------------------------------------------------- engram_hash / EngramHasher.hash

_HASHERS: dict[tuple, EngramHasher] = {}


def _hasher(layers: int, max_ngram: int, heads: int, base: int, vocab: int, seed: int) -> EngramHasher:
    key = (layers, max_ngram, heads, base, vocab, seed)
    if key not in _HASHERS:
        cfg = EngramConfig(
            layer_ids=tuple(range(0, 3 * layers, 3)),
            max_ngram=max_ngram,
            heads_per_order=heads,
            table_sizes=base,
            vocab_size=vocab,
            pad_id=0,
            seed=seed,
        )
        _HASHERS[key] = EngramHasher(cfg)
    return _HASHERS[key]


def _oracle(h: EngramHasher, toks: np.ndarray, cu: np.ndarray, ctx: np.ndarray) -> list:
    seqs = [(int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    return oracle_hash(
        toks.tolist(),
        seqs,
        h.multipliers.tolist(),
        h.primes.tolist(),
        h.offsets.tolist(),
        h.pad_canonical,
        None,
        ctx.tolist(),
    )


@settings(max_examples=50, deadline=None)
@given(
    layers=st.integers(1, 3),
    max_ngram=st.integers(2, 4),
    heads=st.integers(1, 3),
    base=st.integers(2, 400),
    vocab=st.integers(2, 300),
    lens=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    seed=st.integers(0, 999),
)
def test_unvalidated_hash_equals_validated_and_oracle(
    layers: int, max_ngram: int, heads: int, base: int, vocab: int, lens: list[int], seed: int
) -> None:
    h = _hasher(layers, max_ngram, heads, base, vocab, seed)
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    toks = rng.integers(0, vocab, int(cu[-1]))
    ctx = rng.integers(-1, vocab, (len(lens), max_ngram - 1))
    want = _oracle(h, toks, cu, ctx)
    args = (torch.from_numpy(toks), torch.from_numpy(cu), torch.from_numpy(ctx))
    assert h.hash(*args, validate=False).tolist() == want
    assert h.hash(*args).tolist() == want
    grams = h.ngram_token_ids(*args, validate=False)
    op = get_op("engram_hash")
    assert op(grams, *h.device_params("cpu", torch.int64), check=False).tolist() == want
    assert op(grams, *h.device_params("cpu")).tolist() == want
    if len(set(lens)) == 1 and lens[0]:  # 2-D input: every sequence as long, no context
        flat = h.hash(args[0], args[1], validate=False)
        two = h.hash(args[0].reshape(len(lens), lens[0]), validate=False)
        assert torch.equal(two.reshape(flat.shape), flat)


def test_device_params_dtypes_and_cache() -> None:
    h = _hasher(2, 3, 2, 50, 100, 1)
    m32, p32, o32 = h.device_params("cpu")
    m64, p64, o64 = h.device_params("cpu", torch.int64)
    assert (p32.dtype, o32.dtype, p64.dtype, o64.dtype) == (
        torch.int32,
        torch.int32,
        torch.int64,
        torch.int64,
    )
    assert m32.dtype == m64.dtype == torch.int64
    assert (
        p64.tolist() == h.primes.tolist() == p32.tolist()
        and o64.tolist() == h.offsets.tolist() == o32.tolist()
    )
    assert h.device_params("cpu", torch.int64)[1] is p64  # cached
    m0, pd, od = h.decode_params("cpu")  # broadcast over a decode step's tokens
    assert m0.tolist() == h.multipliers[:, :1].tolist() and pd.dtype == od.dtype == torch.int64
    assert pd.tolist() == h.primes[:, None].tolist() and od.tolist() == h.offsets[:, None].tolist()
    assert h.decode_params("cpu")[1] is pd


def test_checked_hash_still_raises_naming_the_field() -> None:
    h = _hasher(2, 3, 2, 50, 100, 1)
    m, p, o = h.device_params("cpu")
    grams = h.ngram_token_ids(torch.arange(5))
    with pytest.raises(ValueError, match="vocab_sizes: table sizes must be positive"):
        get_op("engram_hash")(grams, m, torch.zeros_like(p), o)
    with pytest.raises(ValueError, match=r"token_ids: id 100 is outside \[0, vocab_size=100\)"):
        h.hash(torch.tensor([3, 100]))
    with pytest.raises(ValueError, match="context: id -2"):
        h.hash(torch.tensor([3, 4]), torch.tensor([0, 2]), torch.tensor([[-2, 0]]))
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        h.hash(torch.tensor([3, 4]), torch.tensor([0, 3]))


# ---------------------------------------------------------------- no host read


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_unchecked_paths_read_no_value_on_meta(fmt: str) -> None:
    """Meta tensors hold no values: any host read raises. The check-free paths run there; the checked
    ones do not (they read the ids' min / max back)."""
    t = _table(_table_values(40, 64, 0), fmt).to("meta")
    ids = torch.randint(0, 40, (3, 5), dtype=torch.int32).to("meta")
    assert t.fetch(ids, check=False).shape == (3, 5, 64)
    assert get_op("engram_gather")(t.data, ids, t.scales, check=False).shape == (3, 5, 64)
    with pytest.raises(RuntimeError, match="meta"):
        t.fetch(ids)
    with pytest.raises(RuntimeError, match="meta"):
        get_op("engram_gather")(t.data, ids, t.scales)

    h = _hasher(2, 4, 2, 60, 100, 3)
    x = torch.randint(0, 100, (12,)).to("meta")
    cu, ctx = torch.tensor([0, 5, 12]).to("meta"), torch.tensor([[5, -1, -1], [7, 8, 9]]).to("meta")
    cols = h.config.num_columns
    assert h.hash(x, cu, ctx, validate=False).shape == (2, 12, cols)
    assert h.hash(x, validate=False).shape == (2, 12, cols)  # no cu_seqlens: [0, T] built on the device
    assert h.hash(x.reshape(3, 4), validate=False).shape == (2, 3, 4, cols)
    grams = h.ngram_token_ids(x, cu, ctx, validate=False)
    assert get_op("engram_hash")(grams, *h.device_params("meta", torch.int64), check=False).shape == (
        2,
        12,
        cols,
    )
    with pytest.raises(RuntimeError, match="meta"):
        h.hash(x, cu, ctx)
    with pytest.raises(RuntimeError, match="meta"):
        get_op("engram_hash")(grams, *h.device_params("meta"))


def test_unchecked_paths_dispatch_no_syncing_op() -> None:
    """On the CPU: no op that synchronises on CUDA (``.item()``, ``bool()``, ``nonzero``...) in the
    check-free fetch and hash; the checked ones have some (the counter can fail)."""
    t = _table(_table_values(40, 64, 0), "fp8")
    ids = torch.randint(0, 40, (3, 5), dtype=torch.int32)
    h = _hasher(2, 4, 2, 60, 100, 3)
    x, cu, ctx = (
        torch.randint(0, 100, (12,)),
        torch.tensor([0, 5, 12]),
        torch.tensor([[5, -1, -1], [7, 8, 9]]),
    )
    want_rows, want_ids = t.fetch(ids), h.hash(x, cu, ctx)
    with SyncOps() as free:
        rows = t.fetch(ids, check=False)
        got = h.hash(x, cu, ctx, validate=False)
    assert not free.hits, free.hits
    assert torch.equal(rows, want_rows) and torch.equal(got, want_ids)
    for checked in (lambda: t.fetch(ids), lambda: h.hash(x, cu, ctx)):
        with SyncOps() as counter:
            checked()
        assert counter.hits
