"""The C++ fill_bitmask (``_C.structured.FastFill``, round 3 of issue #7) on the cases it hands back.

Every case runs on two managers over the same backend and requests, the C++ one and one with
``fast_path=False`` (the general path, checked against token-by-token stepping elsewhere), and requires
identical masks, offsets, surviving drafts, dead-end flags and finish reasons, or the same exception.
The counters of the C++ object say which route a call took (answered in C++, finished by the manager's
dead-row methods, or handed to the Python path), so each test also pins the route it meant to exercise.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from deepinfer_core.structured import FinishReason, StructuredOutputManager, _fastpath, make_backend

from .test_manager import DigitsTokenizer

pytestmark = pytest.mark.skipif(
    _fastpath._FastFill is None, reason="extension built without csrc/structured/fastfill.cpp"
)

BACKENDS = ["xgrammar", "llguidance"]


def _pair(
    backend: object, specs: dict[object, dict]
) -> tuple[StructuredOutputManager, StructuredOutputManager]:
    fast = StructuredOutputManager(backend, compile_workers=1)
    slow = StructuredOutputManager(backend, compile_workers=1, fast_path=False)
    for mgr in (fast, slow):
        for rid, spec in specs.items():
            mgr.add_request(rid, spec)
        mgr.wait(list(specs))
    assert fast._fast_fill is not None and slow._fast_fill is None
    assert type(fast.fill_bitmask).__name__ == "builtin_function_or_method"  # the C++ entry point
    return fast, slow


def _calls(mgr: StructuredOutputManager) -> tuple[int, int, int]:
    ff = mgr._fast_fill
    return ff.fast_calls, ff.tail_calls, ff.fallback_calls


def _both(fast, slow, batch, **kw) -> tuple[object, object]:
    """fill_bitmask on both; the masks compared (the fast result is copied before the slow call)."""
    a = fast.fill_bitmask(batch, **kw)
    a_bits = a.bitmask.clone()
    b = slow.fill_bitmask(batch, **kw)
    assert torch.equal(a_bits, b.bitmask)
    assert a.offsets.tolist() == b.offsets.tolist()
    assert a.num_drafts.tolist() == b.num_drafts.tolist()
    assert a.dead_end.tolist() == b.dead_end.tolist()
    assert type(a) is type(b)
    for rid, _ in batch:
        assert fast.finish_reason(rid) is slow.finish_reason(rid)
    return a, b


def _delta(before: tuple[int, int, int], mgr) -> tuple[int, int, int]:
    return tuple(x - y for x, y in zip(_calls(mgr), before))  # type: ignore[return-value]


@pytest.mark.parametrize("name", BACKENDS)
def test_buffer_growth_invalidates_cached_views(name: str, backend_for, byte_tok) -> None:
    fast, slow = _pair(backend_for(name, "byte"), {i: {"regex": "[a-z]{1,30}[0-9]"} for i in range(6)})
    word = byte_tok.encode("abcdefghij")
    _both(fast, slow, [(0, [])])
    small = fast._buf
    for k in (3, 9, 1, 10):  # 6 * (1 + k) rows: the buffer doubles twice, then shrinking reuses it
        before = _calls(fast)
        a, _ = _both(fast, slow, [(i, word[:k]) for i in range(6)])
        assert _delta(before, fast) == (1, 0, 0)
        buf = fast._buf
        # The mask is a view of the current buffer, never of a replaced one.
        assert buf.data_ptr() <= a.bitmask.data_ptr() < buf.data_ptr() + buf.numel() * 4
    assert fast._buf is not small
    a, _ = _both(fast, slow, [(i, []) for i in range(6)])
    assert fast._buf.data_ptr() == a.bitmask.data_ptr()


@pytest.mark.parametrize("name", BACKENDS)
def test_unusual_drafts_take_the_python_path(name: str, backend_for, byte_tok) -> None:
    be = backend_for(name, "byte")
    fast, slow = _pair(be, {"a": {"regex": "[a-z]{1,8}"}, "b": {"regex": "[0-9]{1,8}"}})
    x, one = byte_tok.encode("x")[0], byte_tok.encode("1")[0]
    for drafts in (
        [np.int64(x), np.int32(x)],  # numpy ints: the Python path takes them
        np.array([x, x]),  # an array of drafts
        (x, x),  # a tuple: stays in C++
        [be.vocab_size + 5],  # out of range: the library refuses it
        [-1],
        [True],
        [2**70],
    ):
        before = _calls(fast)
        try:
            _both(fast, slow, [("a", drafts), ("b", [one])])
        except Exception as e:  # the general path's error must be what the caller sees
            with pytest.raises(type(e)):
                slow.fill_bitmask([("a", drafts), ("b", [one])])
            with pytest.raises(type(e)):
                fast.fill_bitmask([("a", drafts), ("b", [one])])
            continue
        d = _delta(before, fast)
        assert d == ((1, 0, 0) if isinstance(drafts, tuple) else (0, 0, 1)), (drafts, d)
    # Every matcher is where it was: the next draft-free step is identical and in C++.
    before = _calls(fast)
    _both(fast, slow, [("a", []), ("b", [])])
    assert _delta(before, fast) == (1, 0, 0)


@pytest.mark.parametrize("name", BACKENDS)
def test_batch_shapes_out_and_keywords(name: str, backend_for, byte_tok) -> None:
    fast, slow = _pair(
        backend_for(name, "byte"), {"a": {"regex": "[a-z]{2}"}, 7: {"json_schema": {"type": "integer"}}}
    )
    a_tok = byte_tok.encode("q")
    before = _calls(fast)
    _both(fast, slow, (("a", []), (7, ())))  # tuple batch, tuple drafts: C++
    _both(fast, slow, [["a", a_tok], [7, []]])  # list items: C++
    assert _delta(before, fast) == (2, 0, 0)
    before = _calls(fast)
    _both(fast, slow, [("a", [])], out=torch.zeros((3, fast._words), dtype=torch.int32))  # out=: Python
    assert _delta(before, fast) == (0, 0, 1)
    a = fast.fill_bitmask(batch=[("a", [])], out=None)
    assert a.num_rows == 1
    with pytest.raises(TypeError):
        fast.fill_bitmask()
    with pytest.raises(TypeError):
        fast.fill_bitmask([("a", [])], None, None)
    with pytest.raises(TypeError):
        fast.fill_bitmask([("a", [])], bogus=1)
    with pytest.raises(ValueError, match="out"):
        fast.fill_bitmask([("a", [])], out=torch.zeros((1, fast._words), dtype=torch.int64))
    # The empty batch and other iterables go to the Python path, which handles them as before (a
    # generator is not a Sequence: both paths raise TypeError).
    assert fast.fill_bitmask([]).num_rows == slow.fill_bitmask([]).num_rows == 0
    for mgr in (fast, slow):
        with pytest.raises(TypeError):
            mgr.fill_bitmask(x for x in [("a", [])])


@pytest.mark.parametrize("name", BACKENDS)
def test_misses_raise_the_general_paths_errors(name: str, backend_for) -> None:
    fast, _ = _pair(backend_for(name, "byte"), {"a": {"regex": "[a-z]{2}"}})
    before = _calls(fast)
    with pytest.raises(KeyError, match="not registered"):
        fast.fill_bitmask([("a", []), ("nope", [])])
    with pytest.raises(TypeError):
        fast.fill_bitmask([(["unhashable"], [])])
    with pytest.raises((TypeError, ValueError)):
        fast.fill_bitmask([("a",)])
    assert _delta(before, fast)[2] == 3
    fast.remove_request("a")
    with pytest.raises(KeyError, match="not registered"):
        fast.fill_bitmask([("a", [])])


@pytest.mark.parametrize("name", BACKENDS)
def test_dead_rows_in_draft_free_and_drafted_batches(name: str) -> None:
    # Digits only: "[a-z]+" is dead at row 0, "[0-9]x" after one digit (a draft into it is cut there).
    be = make_backend(name, DigitsTokenizer())
    specs = {
        "dead": {"regex": "[a-z]+"},
        "live": {"regex": "[0-9]{1,3}"},
        "later": {"regex": "[0-9]x"},
        "ok": {"regex": "[0-9]{2}"},
    }
    fast, slow = _pair(be, specs)
    before = _calls(fast)
    a, _ = _both(fast, slow, [("live", [1, 2]), ("later", [5, 5]), ("ok", [3])])
    assert a.num_drafts.tolist() == [2, 0, 1] and not a.dead_end.any()
    a, _ = _both(fast, slow, [("live", []), ("dead", []), ("ok", [])])
    assert a.dead_end.tolist() == [False, True, False]
    assert fast.finish_reason("dead") is FinishReason.DEAD_END
    assert _delta(before, fast) == (0, 2, 0)  # both finished by the manager's dead-row methods
    before = _calls(fast)
    _both(fast, slow, [("live", []), ("ok", [])])
    assert _delta(before, fast) == (1, 0, 0)


@pytest.mark.parametrize("name", BACKENDS)
def test_terminated_outside_the_manager_with_drafts(name: str, backend_for, byte_tok) -> None:
    fast, slow = _pair(backend_for(name, "byte"), {"a": {"regex": "ab"}, "b": {"regex": "[a-z]{1,5}"}})
    for mgr in (fast, slow):
        m = mgr.matcher("a")
        assert all(m.accept_token(t) for t in byte_tok.encode("ab"))
        assert m.accept_token(byte_tok.eos_token_id)
    before = _calls(fast)
    a, _ = _both(fast, slow, [("b", byte_tok.encode("xy")), ("a", [byte_tok.eos_token_id])])
    assert a.dead_end.tolist() == [False, True] and a.num_drafts.tolist() == [2, 0]
    d = _delta(before, fast)
    assert d[0] == 0 and d[1] + d[2] == 1  # xgrammar raises (Python path), llguidance: an all-zero row


@pytest.mark.parametrize("name", BACKENDS)
def test_only_eos_rows_are_not_dead(name: str, backend_for, byte_tok) -> None:
    # After "ab" only EOS may follow: a live row (llguidance's error rows look the same; the C++ path
    # asks the matcher only then and must not end the request).
    fast, slow = _pair(backend_for(name, "byte"), {"a": {"regex": "ab"}, "b": {"regex": "[a-z]{1,5}"}})
    for mgr in (fast, slow):
        assert mgr.advance("a", byte_tok.encode("ab")) == 2
    before = _calls(fast)
    for batch in ([("a", []), ("b", [])], [("b", byte_tok.encode("q")), ("a", [byte_tok.eos_token_id])]):
        a, _ = _both(fast, slow, batch)
        assert not a.dead_end.any()
    assert _delta(before, fast) == (2, 0, 0)
    assert fast.finish_reason("a") is None


def test_manager_is_collected_and_a_kept_fill_bitmask_says_so(backend_for) -> None:
    fast, _ = _pair(backend_for("xgrammar", "byte"), {"a": {"regex": "[a-z]{2}"}})
    fill, ref = fast.fill_bitmask, weakref.ref(fast)
    assert fill([("a", [])]).num_rows == 1
    fast.close()
    del fast
    gc.collect()
    assert ref() is None  # FastFill holds the manager weakly: no cycle keeps it (and its buffer) alive
    with pytest.raises(RuntimeError, match="outlived"):
        fill([("missing", [])])  # a miss needs the manager


def test_constructor_rejects_bad_arguments(backend_for) -> None:
    from deepinfer_core.structured.manager import BatchMask

    mgr = StructuredOutputManager(backend_for("xgrammar", "byte"))
    be = backend_for("xgrammar", "byte")
    good = dict(
        kind=0,
        keys={},
        views={},
        manager=mgr,
        fallback=type(mgr).fill_bitmask,
        fill_keys=be.fill_keys,
        accept_key=None,
        batch_mask_type=BatchMask,
        np_empty=np.empty,
        np_zeros=np.zeros,
        dt_int64=np.dtype(np.int64),
        dt_bool=np.dtype(np.bool_),
        words=16,
        vocab=512,
        tail_keep=-1,
        eos=0,
        refuse=[],
    )
    _fastpath._FastFill(**good)
    for bad, match in (
        ({"kind": 5}, "kind"),
        ({"vocab": 600}, "vocab"),
        ({"tail_keep": -2}, "tail_keep"),
        ({"eos": 512}, "eos"),
        ({"refuse": [512]}, "refuse"),
        ({"fill_keys": None}, "fill_keys"),
        ({"kind": 1}, "accept_key"),
    ):
        with pytest.raises(ValueError, match=match):
            _fastpath._FastFill(**{**good, **bad})
