"""StructuredOutputManager: async compile, cache, per-request failures, dead ends, batch layout."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from deepinfer_core.structured import FinishReason, GrammarSpec, StructuredOutputManager, make_backend
from deepinfer_kernels import get_op

BACKENDS = ["xgrammar", "llguidance"]


class DigitsTokenizer:
    """A vocabulary of the ten digits, EOS and a pad: letters can never be produced."""

    vocab_size = 12
    eos_token_id = 10
    special_token_ids = frozenset({10, 11})

    def encode(self, text: str) -> list[int]:
        return [int(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(str(i) for i in ids if i < 10)

    def token_bytes(self) -> list[bytes]:
        return [str(i).encode() for i in range(10)] + [b"", b""]


class GatedBackend:
    """Wraps a backend; compiling a spec listed in ``gates`` blocks until its event is set."""

    def __init__(self, inner: object, gates: dict[GrammarSpec, threading.Event]) -> None:
        self.inner, self.gates, self.compiles = inner, gates, 0
        self.vocab_size = inner.vocab_size

    def compile(self, spec: GrammarSpec) -> object:
        self.compiles += 1
        gate = self.gates.get(spec)
        if gate is not None:
            assert gate.wait(10), "test gate never opened"
        return self.inner.compile(spec)

    def matcher(self, compiled: object) -> object:
        return self.inner.matcher(compiled)


@pytest.mark.parametrize("name", BACKENDS)
def test_slow_grammar_waits_alone_and_cache_shares_compiles(name: str, backend_for, byte_tok) -> None:
    slow = GrammarSpec("regex", "[a-z]{3}")
    gate = threading.Event()
    be = GatedBackend(backend_for(name, "byte"), {slow: gate})
    mgr = StructuredOutputManager(be, compile_workers=2)
    mgr.add_request("slow", slow)
    mgr.add_request("fast", {"regex": "[0-9]{2}"})
    mgr.add_request("fast2", GrammarSpec("regex", "[0-9]{2}"))  # same spec: one compile, shared
    assert mgr.wait(["fast", "fast2"], timeout=10) == ["fast", "fast2"]
    assert mgr.ready(["slow", "fast"]) == ["fast"]
    with pytest.raises(RuntimeError, match="still compiling"):
        mgr.fill_bitmask([("slow", [])])
    bm = mgr.fill_bitmask([("fast", []), ("fast2", [])])  # the rest of the batch proceeds
    assert torch.equal(bm.bitmask[0], bm.bitmask[1])
    gate.set()
    assert mgr.wait(["slow"], timeout=10) == ["slow"]
    assert be.compiles == 2 and mgr.cache_hits == 1 and mgr.cache_misses == 2
    # JSON schemas are keyed by compact JSON: spelling (dict vs str, whitespace) does not matter, key
    # order does (it is the order properties come out in, so it reaches the grammar unchanged).
    s1 = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    s2 = GrammarSpec("json_schema", '{"type": "object",  "properties": {"a": {"type": "integer"}}}')
    s3 = GrammarSpec("json_schema", '{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert s1 == s2 and hash(s1) == hash(s2) and s1 != s3
    mgr.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_grammar_fails_alone_with_backend_message(name: str, backend_for) -> None:
    mgr = StructuredOutputManager(backend_for(name, "byte"))
    mgr.add_request("bad", {"json_schema": {"type": "no-such-type"}})
    mgr.add_request("good", {"choice": ["yes", "no"]})
    mgr.wait(["bad", "good"])
    assert mgr.finish_reason("bad") is FinishReason.INVALID_GRAMMAR
    assert name in mgr.error("bad") and "no-such-type" in mgr.error("bad")
    assert mgr.finish_reason("good") is None
    with pytest.raises(RuntimeError, match="already finished"):
        mgr.fill_bitmask([("good", []), ("bad", [])])
    assert mgr.fill_bitmask([("good", [])]).num_rows == 1


@pytest.mark.parametrize("path", ["batched", "row_by_row", "two_threads"])
@pytest.mark.parametrize("name", BACKENDS)
def test_dead_end_finishes_request_without_nan(name: str, path: str) -> None:
    tok = DigitsTokenizer()
    be = make_backend(name, tok, mask_threads=2 if path == "two_threads" else None)
    mgr = StructuredOutputManager(GatedBackend(be, {}) if path == "row_by_row" else be)  # Gated: no fill_rows
    mgr.add_request("letters", {"regex": "[a-z]+"})  # dead at once: no letter in the vocabulary
    mgr.add_request("later", {"regex": "[0-9]x"})  # dead after one digit
    mgr.wait(["letters", "later"])
    bm = mgr.fill_bitmask([("letters", []), ("later", [3, 4])])
    assert bm.dead_end.tolist() == [True, False]
    assert mgr.finish_reason("letters") is FinishReason.DEAD_END
    # The digit draft leads to a state nothing continues: cut before it; its rows repeat row 0.
    assert bm.num_drafts.tolist() == [0, 0]
    rows = bm.bitmask[1:4]
    assert bool(rows.ne(0).any(dim=1).all())
    logits = torch.randn(3, 12)
    get_op("apply_token_bitmask")(logits, rows.clone())
    assert not torch.isnan(torch.softmax(logits, -1)).any()
    assert mgr.advance("later", [5]) == 1
    bm = mgr.fill_bitmask([("later", [])])
    assert bm.dead_end.tolist() == [True] and mgr.finish_reason("later") is FinishReason.DEAD_END


def test_advance_rejected_token_and_stop(backend_for, byte_tok) -> None:
    mgr = StructuredOutputManager(backend_for("xgrammar", "byte"))
    mgr.add_request(1, {"regex": "ab"})
    mgr.wait([1])
    a, b, c = byte_tok.encode("abc")
    assert mgr.advance(1, [a, c, b]) == 1  # 'c' is outside the grammar: the request ends there
    assert mgr.finish_reason(1) is FinishReason.REJECTED_TOKEN
    mgr.add_request(2, {"regex": "ab"})
    mgr.wait([2])
    assert mgr.advance(2, [a, b, byte_tok.eos_token_id, a]) == 3
    assert mgr.finish_reason(2) is FinishReason.STOP
    mgr.remove_request(2)
    with pytest.raises(KeyError, match="not registered"):
        mgr.finish_reason(2)


def test_batch_layout_and_buffer_checks(backend_for) -> None:
    be = backend_for("llguidance", "bpe")
    mgr = StructuredOutputManager(be)
    for r in range(3):
        mgr.add_request(r, {"regex": "[a-z ]{1,20}"})
    mgr.wait(range(3))
    bm = mgr.fill_bitmask([(0, []), (1, [1, 2]), (2, [3])])
    assert bm.offsets.tolist() == [0, 1, 4, 6] and bm.bitmask.shape == (6, (be.vocab_size + 31) // 32)
    out = torch.zeros((8, (be.vocab_size + 31) // 32), dtype=torch.int32)
    bm2 = mgr.fill_bitmask([(0, []), (1, [1, 2]), (2, [3])], out=out)
    assert bm2.bitmask.data_ptr() == out.data_ptr() and torch.equal(bm2.bitmask, bm.bitmask)
    with pytest.raises(ValueError, match="out: shape"):
        mgr.fill_bitmask([(0, [1, 2, 3])], out=out[:2])
    with pytest.raises(ValueError, match="int32"):
        mgr.fill_bitmask([(0, [])], out=out.to(torch.int64))
    with pytest.raises(ValueError, match="already registered"):
        mgr.add_request(0, {"regex": "x"})
    with pytest.raises(ValueError, match="so_args"):
        mgr.add_request(9, {"regex": "x", "ebnf": "y"})


class CrashingBackend(GatedBackend):
    def compile(self, spec: GrammarSpec) -> object:
        if spec.kind == "ebnf":
            raise RuntimeError("engine bug")
        return self.inner.compile(spec)


def test_unexpected_compile_exception_fails_only_that_request(backend_for) -> None:
    mgr = StructuredOutputManager(CrashingBackend(backend_for("xgrammar", "byte"), {}))
    mgr.add_request("crash", {"ebnf": 'root ::= "a"'})
    mgr.add_request("ok", {"regex": "a"})
    mgr.wait(["crash", "ok"])
    assert mgr.finish_reason("crash") is FinishReason.INVALID_GRAMMAR and "engine bug" in mgr.error("crash")
    assert mgr.finish_reason("ok") is None and mgr.fill_bitmask([("ok", [])]).num_rows == 1
