"""The manager's fast path (backend batch keys, C++ finishing pass) against its general path.

Two managers over the same backend, one with ``fast_path=False`` (the general path, itself checked
against token-by-token stepping in test_speculative.py), are driven through the same random decode:
every step both fill the same batch (random drafts with junk, special and EOS tokens mixed in), and
the masks, offsets, surviving drafts and dead-end flags must be identical; then both commit the same
sampled tokens.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

from deepinfer_core.structured import GrammarSpec, StructuredOutputManager, _fastpath, make_backend
from deepinfer_core.structured import manager as M

from ._decode import allowed_ids
from .test_end_to_end import EBNF, REGEXES, SCHEMA

pytestmark = pytest.mark.skipif(
    _fastpath.FINISH_PTR is None, reason="extension built without csrc/structured"
)

SPECS = [GrammarSpec("regex", r) for r in REGEXES] + [
    GrammarSpec("json_schema", SCHEMA),
    GrammarSpec("ebnf", EBNF),
]


def _same(a, b) -> None:
    assert a.offsets.tolist() == b.offsets.tolist()
    assert a.num_drafts.tolist() == b.num_drafts.tolist()
    assert a.dead_end.tolist() == b.dead_end.tolist()
    assert torch.equal(a.bitmask, b.bitmask)


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("vocab", ["byte", "bpe"])
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_fast_path_equals_general_path(
    name: str, vocab: str, threads: int | None, backend_for, tok_for
) -> None:
    backend = (
        backend_for(name, vocab)
        if threads is None
        else make_backend(name, tok_for(vocab), mask_threads=threads)
    )
    V = backend.vocab_size
    rng = np.random.default_rng(zlib.crc32(f"{name}-{vocab}-{threads}".encode()))
    fast = StructuredOutputManager(backend, compile_workers=1)
    slow = StructuredOutputManager(backend, compile_workers=1, fast_path=False)
    assert fast._keys is not None and slow._keys is None
    rids = []
    for i, spec in enumerate(SPECS * 2):
        fast.add_request(i, spec)
        slow.add_request(i, spec)
        rids.append(i)
    fast.wait(rids)
    slow.wait(rids)
    specials = sorted(backend._vocab.special_ids)
    steps_with_drafts = steps_without = cut = kept = 0
    for step in range(14):
        live = [r for r in rids if fast.finish_reason(r) is None]
        assert live == [r for r in rids if slow.finish_reason(r) is None]
        if not live:
            break
        with_drafts = step % 2 == 1
        batch = []
        for r in live:
            drafts: list[int] = []
            if with_drafts:
                m, taken = slow.matcher(r), 0
                buf = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
                for _ in range(int(rng.integers(0, 5))):
                    u = rng.random()
                    if u < 0.15 or m.is_terminated():  # junk, a control token or EOS
                        drafts.append(int(rng.choice([int(rng.integers(0, V)), *specials])))
                        continue
                    m.fill_next_token_bitmask(buf, 0)
                    ok = allowed_ids(buf[0], V)
                    if len(ok) == 0:
                        break
                    t = int(rng.choice(ok))
                    drafts.append(t)
                    taken += m.accept_token(t)
                m.rollback(taken)
            batch.append((r, drafts))
        a = fast.fill_bitmask(batch)
        a_bits = a.bitmask.clone()
        b = slow.fill_bitmask(batch)
        assert torch.equal(a_bits, b.bitmask)
        _same(a, b)
        steps_with_drafts += with_drafts
        steps_without += not with_drafts
        if with_drafts:
            drafted = [len(d) for _, d in batch]
            cut += sum(int(k) < n for k, n in zip(b.num_drafts, drafted))
            kept += sum(int(k) == n > 0 for k, n in zip(b.num_drafts, drafted))
        # Commit the same sampled tokens (a prefix of surviving drafts + one from the next row).
        for j, (r, drafts) in enumerate(batch):
            if b.dead_end[j]:
                continue
            base, k = int(b.offsets[j]), int(b.num_drafts[j])
            acc = int(rng.integers(0, k + 1))
            ok = allowed_ids(b.bitmask[base + acc], V)
            commit = [*drafts[:acc], int(rng.choice(ok))]
            assert fast.advance(r, commit) == slow.advance(r, commit)
            assert fast.finish_reason(r) is slow.finish_reason(r)
    assert steps_with_drafts >= 3 and steps_without >= 3
    assert cut >= 3 and kept >= 3, (cut, kept)  # both draft outcomes compared
    # The C++ fill_bitmask (fastfill.cpp) ran these steps, except llguidance with its executor
    # (mask_threads > 1), which keeps the Python fast path.
    ff = fast._fast_fill
    assert (ff is not None) == (name == "xgrammar" or threads is None)
    if ff is not None:
        assert ff.fast_calls + ff.tail_calls >= 10 and ff.fallback_calls == 0, (
            ff.fast_calls,
            ff.tail_calls,
            ff.fallback_calls,
        )


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_matcher_terminated_outside_the_manager(name: str, backend_for, byte_tok) -> None:
    # EOS accepted through mgr.matcher(): the request is not finished, its next row must be all-zero
    # (xgrammar raises inside its batch call: the manager falls back to the general path).
    backend = backend_for(name, "byte")
    mgr = StructuredOutputManager(backend)
    mgr.add_request("a", {"regex": "ab"})
    mgr.add_request("b", {"regex": "ab"})
    mgr.wait(["a", "b"])
    m = mgr.matcher("a")
    for t in byte_tok.encode("ab"):
        assert m.accept_token(t)
    assert m.accept_token(byte_tok.eos_token_id) and m.is_terminated()
    bm = mgr.fill_bitmask([("a", []), ("b", [])])
    assert not bm.bitmask[0].any() and bm.bitmask[1].any()
    assert bm.dead_end.tolist() == [True, False]


def test_unknown_and_compiling_requests_still_raise(backend_for) -> None:
    mgr = StructuredOutputManager(backend_for("xgrammar", "byte"))
    with pytest.raises(KeyError, match="not registered"):
        mgr.fill_bitmask([("nope", [])])
    mgr.add_request("x", {"regex": "[a-z]{3}"})
    mgr.wait(["x"])
    assert mgr.fill_bitmask([("x", [])]).num_rows == 1
    mgr.remove_request("x")
    with pytest.raises(KeyError, match="not registered"):
        mgr.fill_bitmask([("x", [])])


def test_cached_batch_mask_is_read_only(backend_for) -> None:
    mgr = StructuredOutputManager(backend_for("llguidance", "byte"))
    mgr.add_request(0, {"regex": "[a-z]{3}"})
    mgr.wait([0])
    a, b = mgr.fill_bitmask([(0, [])]), mgr.fill_bitmask([(0, [])])
    assert a.offsets.tolist() == [0, 1] and a.num_drafts.tolist() == [0] and a.dead_end.tolist() == [False]
    assert a is b  # the draft-free result is built once per batch size
    with pytest.raises(ValueError):
        a.num_drafts[0] = 1


@pytest.mark.parametrize("seed", range(8))
def test_cpp_ptr_pass_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, words = int(rng.integers(1, 90)), int(rng.integers(1, 70))
    a = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    a[rng.random(rows) < 0.4] = 0
    a[rng.random(rows) < 0.3, :-1] = 0  # live only through the padding word
    tail_bits = int(rng.integers(0, 32))
    keep = None if tail_bits == 0 else np.int32(np.uint32((1 << tail_bits) - 1))
    keep_c = -1 if tail_bits == 0 else (1 << tail_bits) - 1
    # Random disjoint (src, end) copy ranges, as the draft path produces them.
    cuts = np.sort(
        rng.choice(np.arange(1, rows), size=min(rows - 1, int(rng.integers(0, 6))), replace=False)
    ).tolist()
    bounds = [0, *cuts, rows]
    copies = []
    want = a.copy()
    for lo, hi in itertools.pairwise(bounds):
        if rng.random() < 0.6:
            src = int(rng.integers(lo, hi))
            copies += [src, hi]
            want[src + 1 : hi] = want[src]
    b = a.copy()
    expect = M._finish_rows_numpy(want, want[:, -1] if keep is not None else None, keep)
    assert _fastpath.FINISH_PTR(a.ctypes.data, rows, words, keep_c, copies) == expect
    assert np.array_equal(a, want)
    bb = b.copy()
    dead = M._finish_rows_numpy(bb, bb[:, -1] if keep is not None else None, keep)
    assert _fastpath.COUNT_DEAD(b.ctypes.data, rows, words, keep_c) == len(dead)
    assert np.array_equal(b, bb)  # padding cleared the same way
    with pytest.raises(ValueError, match="copies"):
        _fastpath.FINISH_PTR(a.ctypes.data, rows, words, keep_c, [0, rows + 1])


@pytest.mark.parametrize("seed", range(6))
def test_cpp_eos_only_rows(seed: int) -> None:
    # Brute force: a row counts when it is all-zero or (eos given) exactly the eos bit.
    rng = np.random.default_rng(100 + seed)
    rows, words = int(rng.integers(1, 80)), int(rng.integers(1, 40))
    eos = int(rng.integers(0, words * 32))
    a = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    kind = rng.integers(0, 4, size=rows)
    a[kind == 0] = 0
    a[kind == 1] = 0
    a[kind == 1, eos // 32] = np.int32(np.uint32(1 << (eos % 32)))
    a[kind == 2, eos // 32] |= np.int32(np.uint32(1 << (eos % 32)))  # EOS plus others: not flagged
    bits = np.unpackbits(a.view(np.uint8), axis=1, bitorder="little")
    only = [r for r in range(rows) if bits[r].sum() == 1 and bits[r, eos] == 1]
    dead = [r for r in range(rows) if bits[r].sum() == 0]
    assert _fastpath.EOS_ONLY(a.ctypes.data, rows, words, eos) == only
    assert _fastpath.COUNT_DEAD(a.ctypes.data, rows, words, -1, eos) == len(only) + len(dead)
    assert _fastpath.COUNT_DEAD(a.ctypes.data, rows, words, -1) == len(dead)


def test_llguidance_dead_end_and_stop_in_a_draft_free_batch(backend_for, byte_tok) -> None:
    # The unchecked llguidance loop: an error row (dead end), a stopped matcher and live rows in one
    # draft-free batch give the general path's masks and flags.
    from .test_manager import DigitsTokenizer

    be = make_backend("llguidance", DigitsTokenizer())
    res = []
    for fast_path in (True, False):
        mgr = StructuredOutputManager(be, fast_path=fast_path)
        for rid, rx in (("dead", "[a-z]+"), ("live", "[0-9]{1,3}"), ("later", "[0-9]x"), ("stop", "[0-9]")):
            mgr.add_request(rid, {"regex": rx})
        mgr.wait(["dead", "live", "later", "stop"])
        assert mgr.advance("later", [5]) == 1
        m = mgr.matcher("stop")
        assert m.accept_token(3) and m.accept_token(be.eos_token_id)  # outside the manager
        bm = mgr.fill_bitmask([("live", []), ("dead", []), ("later", []), ("stop", [])])
        res.append(
            (bm.bitmask.clone(), bm.dead_end.tolist(), [mgr.finish_reason(r) for r in ("dead", "later")])
        )
        assert bm.dead_end.tolist() == [False, True, True, True]
    assert torch.equal(res[0][0], res[1][0]) and res[0][1:] == res[1][1:]
