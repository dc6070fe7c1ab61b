"""EngramHasher and the engram_hash reference op against an independent per-token oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.engram import CanonicalTokenMap, EngramConfig, EngramHasher, is_prime
from deepinfer_kernels import get_op

from ._oracle import oracle_hash


def _cfg(**kw) -> EngramConfig:
    base = dict(
        layer_ids=(1, 5, 9), max_ngram=4, heads_per_order=3, table_sizes=(101, 211, 307), vocab_size=1000
    )
    base.update(kw)
    return EngramConfig(**base)


def _oracle_for(h: EngramHasher, tokens, seqs, context=None):
    tm = None if h.token_map.is_identity() else h.token_map.lookup
    return oracle_hash(
        tokens,
        seqs,
        h.multipliers.tolist(),
        h.primes.tolist(),
        h.offsets.tolist(),
        h.pad_canonical,
        tm,
        context,
    )


def _seqs(cu):
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


@pytest.mark.parametrize(
    "cfg", [_cfg(), EngramConfig.tiny(), _cfg(max_ngram=2, heads_per_order=1, table_sizes=7)]
)
def test_packed_batch_matches_oracle(cfg: EngramConfig) -> None:
    g = torch.Generator().manual_seed(0)
    h = EngramHasher(cfg)
    lens = [1, 0, 5, 2, 17, 3]  # includes an empty sequence and sequences shorter than max_ngram
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    toks = torch.randint(0, cfg.vocab_size, (cu[-1],), generator=g)
    got = h.hash(toks, torch.tensor(cu))
    assert got.dtype == torch.int32 and got.shape == (len(cfg.layer_ids), cu[-1], cfg.num_columns)
    assert got.tolist() == _oracle_for(h, toks.tolist(), _seqs(cu))


_HASHERS: dict[int, EngramHasher] = {}  # hasher per seed, built once across hypothesis examples


@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    with_context=st.booleans(),
)
def test_packed_batches_property(lens: list[int], seed: int, with_context: bool) -> None:
    cfg = _cfg(seed=seed % 1000)
    h = _HASHERS.get(cfg.seed) or _HASHERS.setdefault(cfg.seed, EngramHasher(cfg))
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64).tolist()
    toks = rng.integers(0, cfg.vocab_size, cu[-1]).tolist()
    ctx = None
    if with_context:
        ctx = rng.integers(-1, cfg.vocab_size, (len(lens), cfg.max_ngram - 1)).tolist()
    got = h.hash(torch.tensor(toks, dtype=torch.int64), torch.tensor(cu), torch.tensor(ctx) if ctx else None)
    assert got.tolist() == _oracle_for(h, toks, _seqs(cu), ctx)


def test_2d_batch_rows_are_sequences() -> None:
    cfg = _cfg()
    h = EngramHasher(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, 11))
    got = h.hash(x)
    assert got.shape == (3, 3, 11, cfg.num_columns)
    for b in range(3):
        assert torch.equal(got[:, b], h.hash(x[b]))


def test_chunked_with_context_equals_whole_sequence() -> None:
    """A sequence hashed in chunks (each given the tokens before it) equals hashing it whole."""
    cfg = _cfg()
    h = EngramHasher(cfg)
    seq = torch.randint(0, cfg.vocab_size, (40,))
    whole = h.hash(seq)
    n = cfg.max_ngram - 1
    parts = []
    for a, b in [(0, 7), (7, 8), (8, 23), (23, 40)]:  # includes a one-token decode-like step
        prev = seq[max(0, a - n) : a].flip(0).tolist()
        ctx = torch.tensor([prev + [-1] * (n - len(prev))])
        parts.append(h.hash(seq[a:b], torch.tensor([0, b - a]), ctx))
    assert torch.equal(torch.cat(parts, dim=1), whole)


@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    canonical=st.booleans(),
)
def test_host_hash_equals_the_oracle_and_the_torch_path(lens: list[int], seed: int, canonical: bool) -> None:
    """``hash_host`` (numpy, the executor's per-step path) against the per-token oracle and ``hash``:
    packed sequences (empty ones and ones shorter than max_ngram), context with -1 entries, an identity or
    a many-to-one canonical map."""
    cfg = _cfg(seed=seed % 1000, vocab_size=40)
    rng = np.random.default_rng(seed)
    tm = CanonicalTokenMap(rng.integers(0, 25, cfg.vocab_size).tolist()) if canonical else None
    h = EngramHasher(cfg, tm)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    toks = rng.integers(0, cfg.vocab_size, int(cu[-1]))
    ctx = rng.integers(-1, cfg.vocab_size, (len(lens), cfg.max_ngram - 1))
    got = h.hash_host(toks, cu, ctx)
    assert got.dtype == np.int32 and got.tolist() == _oracle_for(
        h, toks.tolist(), _seqs(cu.tolist()), ctx.tolist()
    )
    assert np.array_equal(
        got, h.hash(torch.from_numpy(toks), torch.from_numpy(cu), torch.from_numpy(ctx)).numpy()
    )


def test_full_range_multipliers_wrap_like_int64() -> None:
    """The op's arithmetic with arbitrary 64-bit multipliers (products overflow) equals the Python-int oracle."""
    rng = np.random.default_rng(7)
    n, layers, heads = 4, 2, 3
    mult = rng.integers(-(2**63), 2**63 - 1, (layers, n), dtype=np.int64, endpoint=True)
    primes = np.array([[[1_000_003, 999_983, 65_537]] * (n - 1)] * layers, dtype=np.int64)
    offsets = rng.integers(0, 1000, (layers, (n - 1) * heads))
    ids = rng.integers(0, 2**31 - 1, (50, n))
    got = get_op("engram_hash")(
        torch.from_numpy(ids), torch.from_numpy(mult), torch.from_numpy(primes), torch.from_numpy(offsets)
    )
    for t in range(50):
        for li in range(layers):
            h, row = 0, []
            for k in range(n):
                h ^= (int(ids[t, k]) * int(mult[li, k])) & ((1 << 64) - 1)
                if k:
                    s = h - (1 << 64) if h >= (1 << 63) else h
                    row += [
                        s % int(p) + int(o)
                        for p, o in zip(primes[li, k - 1], offsets[li, (k - 1) * heads : k * heads])
                    ]
            assert got[li, t].tolist() == row


def test_primes_distinct_prime_and_above_base() -> None:
    cfg = _cfg(table_sizes=(100, 100, 90))  # overlapping search ranges across orders and layers
    h = EngramHasher(cfg)
    flat = h.primes.reshape(-1).tolist()
    assert len(set(flat)) == len(flat)
    for li in range(len(cfg.layer_ids)):
        for oi, order in enumerate(range(2, cfg.max_ngram + 1)):
            for p in h.primes[li, oi]:
                p = int(p)
                assert p >= cfg.base_size(order)
                assert all(p % d for d in range(2, int(p**0.5) + 1))  # brute-force primality
    # offsets are exclusive prefix sums of each layer's sub-table sizes; rows cover the layer's table
    for li in range(len(cfg.layer_ids)):
        sizes = h.primes[li].reshape(-1)
        assert h.offsets[li].tolist() == [int(sizes[:i].sum()) for i in range(sizes.size)]
        assert int(h.layer_rows[li]) == int(sizes.sum())


def test_is_prime_against_trial_division() -> None:
    for n in range(0, 5000):
        assert is_prime(n) == (n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)))
    assert is_prime(2**61 - 1) and not is_prime((2**31 - 1) * (2**61 - 1))


def test_multipliers_odd_and_overflow_free() -> None:
    cfg = _cfg()
    h = EngramHasher(cfg)
    m = h.multipliers
    assert m.shape == (3, cfg.max_ngram) and bool((m % 2 == 1).all()) and bool((m > 0).all())
    # the public bound: (canonical vocab - 1) * m stays within int64
    assert all((cfg.vocab_size - 1) * int(x) < 2**63 for x in m.reshape(-1))
    # seeded per layer: the same layer id gives the same multipliers whatever the other layers are
    other = EngramHasher(_cfg(layer_ids=(9, 2)))
    assert np.array_equal(other.multipliers[0], m[2])
    assert not np.array_equal(m[0], m[1])


def test_row_ids_inside_layer_table_and_spread() -> None:
    cfg = _cfg()
    h = EngramHasher(cfg)
    got = h.hash(torch.randint(0, cfg.vocab_size, (3000,)))
    for li in range(3):
        lo, hi = h.offsets[li], h.offsets[li] + h.primes[li].reshape(-1)
        g = got[li].numpy()
        assert bool((g >= lo).all()) and bool((g < hi).all())
    # each head's rows are spread over its table (a stuck hash would hit few rows)
    assert len(np.unique(got[0, :, 0].numpy())) > 0.6 * int(h.primes[0, 0, 0])


def test_canonical_map_changes_hash_only_through_canonical_ids() -> None:
    cfg = _cfg(vocab_size=6, table_sizes=(1009, 1013, 1019))
    tm = CanonicalTokenMap([0, 1, 2, 1, 3, 3])  # ids 1/3 and 4/5 are variants of one word each
    h = EngramHasher(cfg, tm)
    a = h.hash(torch.tensor([1, 4, 5, 1]))
    b = h.hash(torch.tensor([3, 5, 4, 3]))
    assert torch.equal(a, b)
    assert h.hash(torch.tensor([0, 1])).tolist() == _oracle_for(h, [0, 1], [(0, 2)])


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda h: h.hash(torch.tensor([0, 1000])), ValueError, "token_ids: id 1000"),
        (lambda h: h.hash(torch.tensor([-1, 3])), ValueError, "token_ids: id -1"),
        (lambda h: h.hash(torch.tensor([1.0])), TypeError, "token_ids"),
        (lambda h: h.hash(torch.tensor([1, 2]), torch.tensor([0, 3])), ValueError, "cu_seqlens"),
        (lambda h: h.hash(torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2])), ValueError, "non-decreasing"),
        (lambda h: h.hash(torch.tensor([1, 2]), None, torch.zeros(1, 2)), ValueError, "context: shape"),
        (lambda h: h.hash(torch.tensor([1, 2]), None, torch.full((1, 3), -5)), ValueError, "context: id -5"),
        (lambda h: h.layer_index(4), ValueError, "layer_id=4"),
    ],
)
def test_bad_input_raises_clearly(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call(EngramHasher(_cfg()))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_ngram": 1}, "max_ngram"),
        ({"table_sizes": (5, 6)}, "table_sizes"),
        ({"table_sizes": 2**31}, "table_sizes"),
        ({"layer_ids": (1, 1)}, "layer_ids"),
        ({"pad_id": 1000}, "pad_id"),
        ({"heads_per_order": 0}, "heads_per_order"),
    ],
)
def test_bad_config_raises(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_op_bad_shapes() -> None:
    op = get_op("engram_hash")
    ids = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="multipliers"):
        op(
            ids,
            torch.ones(2, 2, dtype=torch.int64),
            torch.ones(2, 2, 1, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="vocab_sizes"):
        op(
            ids,
            torch.ones(2, 3, dtype=torch.int64),
            torch.zeros(2, 2, 1, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int32),
        )


def test_cuda_backend_on_cpu_tensors_is_the_reference() -> None:
    cfg = _cfg()
    h = EngramHasher(cfg)
    x = torch.randint(0, cfg.vocab_size, (64,))
    assert torch.equal(h.hash(x, backend="cuda"), h.hash(x))


def test_validate_false_gives_the_same_rows() -> None:
    cfg = _cfg()
    h = EngramHasher(cfg)
    x = torch.randint(0, cfg.vocab_size, (50,))
    cu, ctx = torch.tensor([0, 20, 50]), torch.tensor([[5, -1, -1], [7, 8, 9]])
    assert torch.equal(h.hash(x, cu, ctx, validate=False), h.hash(x, cu, ctx))
    with pytest.raises(ValueError, match="cu_seqlens"):
        h.hash(x, torch.tensor([[0, 50]]), validate=False)  # shapes are still checked
