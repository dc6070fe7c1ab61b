"""Round 2 of structured outputs (issue #20): property order, the auto backend's fallback, engine options,
the byte filter against an independent UTF-8 oracle, and post-hoc JSON-schema checks.

Oracles: Python's own UTF-8 decoder (incremental, strict) for the byte filter; ``json.loads`` order and
``jsonschema`` for documents; each engine's own matcher for the masks the filter intersects.
"""

from __future__ import annotations

import codecs
import json
import random

import numpy as np
import pytest
import torch

from deepinfer_core.structured import FinishReason, GrammarSpec, StructuredOutputManager, make_backend
from deepinfer_core.structured.validate import check_document

pytest.importorskip("jsonschema")


def allowed(row: torch.Tensor, V: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:V])


def decode(
    mgr: StructuredOutputManager, rid: str, rng: np.random.Generator, max_tokens: int = 400
) -> list[int]:
    mgr.wait([rid])
    toks: list[int] = []
    while mgr.finish_reason(rid) is None and len(toks) < max_tokens:
        bm = mgr.fill_bitmask([(rid, [])])
        if bm.dead_end[0]:
            break
        t = int(rng.choice(allowed(bm.bitmask[0], mgr.vocab_size)))
        mgr.advance(rid, [t])
        toks.append(t)
    return toks


def text_of(tok, toks: list[int]) -> bytes:
    tb = tok.token_bytes()
    return b"".join(tb[t] for t in toks)


@pytest.fixture(scope="module")
def auto(byte_tok):
    return make_backend("auto", byte_tok)


# ----------------------------------------------------------------------------- property order
@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "auto"])
def test_property_order_is_the_schemas(name: str, byte_tok, backend_for, auto) -> None:
    backend = auto if name == "auto" else backend_for(name, "byte")
    seed = random.randrange(2**31)
    rng, r = np.random.default_rng(seed), random.Random(seed)
    mgr = StructuredOutputManager(backend)
    for i in range(4):
        keys = r.sample(["zeta", "answer", "reasoning", "alpha", "mid", "b2", "a1"], 5)  # not sorted
        schema = {
            "type": "object",
            "properties": {k: {"type": "integer", "minimum": 0, "maximum": 99} for k in keys},
            "required": keys,
            "additionalProperties": False,
        }
        mgr.add_request(str(i), {"json_schema": json.dumps(schema)})
        toks = decode(mgr, str(i), rng)
        assert mgr.finish_reason(str(i)) is FinishReason.STOP, (seed, mgr.error(str(i)))
        doc = json.loads(text_of(byte_tok, toks[:-1]))
        assert list(doc) == keys, (seed, keys, doc)


# ----------------------------------------------------------------------------- auto: fallback and metrics
def test_auto_falls_back_per_request_and_reports_the_engine(auto) -> None:
    mgr = StructuredOutputManager(auto)
    one_of = {
        "oneOf": [{"type": "integer"}, {"type": "number", "maximum": 5}]
    }  # llguidance refuses (overlapping)
    plain = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    mgr.add_request("fallback", {"json_schema": one_of})
    mgr.add_request("first", {"json_schema": plain})
    mgr.add_request("asked", {"json_schema": plain, "engine": "xgrammar"})
    mgr.add_request("coerced", {"json_schema": one_of, "options": {"llguidance": {"coerce_one_of": True}}})
    mgr.add_request("nobody", {"json_schema": {"type": "no-such-type"}})
    mgr.wait(["fallback", "first", "asked", "coerced", "nobody"])
    m = {r: mgr.metrics(r) for r in ("fallback", "first", "asked", "coerced")}
    assert (
        m["fallback"]["grammar_engine"] == "xgrammar"
        and "oneOf" in m["fallback"]["grammar_refused"]["llguidance"]
    )
    assert m["first"] == {"grammar_engine": "llguidance"}
    assert m["asked"] == {"grammar_engine": "xgrammar"}
    assert m["coerced"] == {"grammar_engine": "llguidance"}  # the engine option made llguidance accept it
    assert mgr.finish_reason("nobody") is FinishReason.INVALID_GRAMMAR
    assert "xgrammar" in mgr.error("nobody") and "llguidance" in mgr.error("nobody")
    # A batch mixing both engines (the general path) gives each request its own engine's rows, the same
    # as batches served by one engine (each engine's own C++ call).
    ids = ["fallback", "first", "asked", "coerced"]
    rng = np.random.default_rng(random.randrange(2**31))
    for _ in range(6):
        mixed = mgr.fill_bitmask([(r, []) for r in ids]).bitmask.clone()
        for j, r in enumerate(ids):
            alone = mgr.fill_bitmask([(r, [])]).bitmask[0]
            assert torch.equal(mixed[j], alone), r
        for j, r in enumerate(ids):
            if mgr.finish_reason(r) is None:
                mgr.advance(r, [int(rng.choice(allowed(mixed[j], mgr.vocab_size)))])
        ids = [r for r in ids if mgr.finish_reason(r) is None]
        if not ids:
            break


def test_fixed_backend_refuses_another_engine(backend_for) -> None:
    mgr = StructuredOutputManager(backend_for("xgrammar", "byte"))
    with pytest.raises(ValueError, match=r"so_args\.engine"):
        mgr.add_request("x", {"json_schema": {"type": "integer"}, "engine": "llguidance"})


@pytest.mark.parametrize(
    ("so_args", "match"),
    [
        ({"json_schema": {}, "options": {"vllm": {}}}, r"so_args.options: 'vllm' is not an engine"),
        (
            {"json_schema": {}, "options": {"llguidance": {"coerce": True}}},
            r"so_args.options.llguidance: 'coerce' is not",
        ),
        (
            {"json_schema": {}, "options": {"xgrammar": {"any_whitespace": 1}}},
            r"options.xgrammar.any_whitespace: 1 must be a bool",
        ),
        (
            {"json_schema": {}, "options": {"xgrammar": {"max_whitespace_cnt": 0}}},
            r"max_whitespace_cnt: 0 must be >= 1",
        ),
        ({"regex": "a", "options": {"xgrammar": {"any_whitespace": True}}}, r"json_schema constraints only"),
        ({"json_schema": {}, "engine": "outlines"}, r"so_args.engine: 'outlines'"),
        ({"json_schema": {}, "backend": "x"}, r"so_args: must have exactly one key"),
    ],
)
def test_options_are_validated(so_args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GrammarSpec.from_so_args(so_args)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_whitespace_option_changes_the_language(name: str, byte_tok, backend_for) -> None:
    opt = {"xgrammar": {"any_whitespace": True}, "llguidance": {"whitespace_flexible": True}}[name]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    mgr = StructuredOutputManager(backend_for(name, "byte"))
    mgr.add_request("compact", {"json_schema": schema})
    mgr.add_request("spaced", {"json_schema": schema, "options": {name: opt}})
    mgr.wait(["compact", "spaced"])
    space = byte_tok.encode(" ")[0]
    for r in ("compact", "spaced"):
        mgr.advance(r, byte_tok.encode("{"))
    rows = mgr.fill_bitmask([("compact", []), ("spaced", [])]).bitmask
    assert space not in allowed(rows[0], mgr.vocab_size) and space in allowed(rows[1], mgr.vocab_size)


# ----------------------------------------------------------------------------- the byte filter
def utf8_oracle(prefix: bytes, token_bytes: list[bytes], json_controls: bool) -> np.ndarray:
    """Tokens whose bytes keep ``prefix`` a valid UTF-8 prefix (control tokens only on a character
    boundary; for JSON no byte below 0x20), by Python's strict incremental decoder."""

    def ok(data: bytes, final: bool) -> bool:
        # a valid prefix has a valid completion (the incremental decoder alone accepts ED A0, the
        # start of a surrogate): only the second byte of a character is restricted beyond 80..BF
        tails = (
            [b""]
            if final
            else [b""] + [bytes([c]) + b"\x80" * n for n in range(3) for c in (0x80, 0x90, 0xA0)]
        )
        for tail in tails:
            try:
                codecs.getincrementaldecoder("utf-8")("strict").decode(data + tail, final=True)
                return True
            except UnicodeDecodeError:
                pass
        return False

    boundary = ok(prefix, True)
    out = np.zeros(len(token_bytes), bool)
    for t, b in enumerate(token_bytes):
        if not b:
            out[t] = boundary
        elif not (json_controls and any(c < 0x20 for c in b)):
            out[t] = ok(prefix + b, False)
    return out


ADVERSARIAL = [  # (backend, spec, is JSON): grammars that admit bytes which are not UTF-8
    ("llguidance", GrammarSpec("ebnf", "start: <[3-258]>{1,24}"), False),  # any byte tokens, by id
    (
        "xgrammar",
        GrammarSpec("json_schema", {"type": "string", "maxLength": 12}),
        True,
    ),  # surrogates, controls
]


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize(("name", "spec", "is_json"), ADVERSARIAL)
def test_byte_filter_rows_equal_engine_rows_and_oracle(
    name, spec, is_json, fast_path, byte_tok, backend_for
) -> None:
    """Every row (drafts included) is the engine's own row AND the oracle's, and drafts the filter
    rejects are cut; every document finishing ``stop`` decodes strictly."""
    backend = backend_for(name, "byte")
    V, tb = backend.vocab_size, list(backend.vocab.token_bytes)
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    mgr = StructuredOutputManager(backend, fast_path=fast_path)
    ref_buf = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
    for i in range(6):
        rid = f"r{i}"
        mgr.add_request(rid, spec)
        mgr.wait([rid])
        ref = backend.matcher(backend.compile(spec))
        committed: list[int] = []
        while mgr.finish_reason(rid) is None and len(committed) < 60:
            # random drafts, half of them raw bytes the filter may refuse (continuations, ED A0, controls)
            drafts = [
                int(rng.choice([rng.integers(3, 259), rng.integers(3 + 0x80, 3 + 0xC0)])) for _ in range(3)
            ]
            bm = mgr.fill_bitmask([(rid, drafts)])
            k = int(bm.num_drafts[0])
            prefix, steps = text_of(byte_tok, committed), 0
            for j in range(k + 1):
                ref.fill_next_token_bitmask(ref_buf, 0)
                want = set(allowed(ref_buf[0], V)) & set(np.flatnonzero(utf8_oracle(prefix, tb, is_json)))
                assert set(allowed(bm.bitmask[j], V)) == want, (seed, committed, drafts, j)
                if j < k:
                    assert ref.accept_token(drafts[j])
                    prefix += tb[drafts[j]]
                    steps += 1
            if k < len(drafts) and drafts[k] in want:
                # a cut draft the row allows leads to a state nothing can continue (a dead row)
                assert ref.accept_token(drafts[k]) and not ref.is_terminated()
                steps += 1
                ref.fill_next_token_bitmask(ref_buf, 0)
                after = set(allowed(ref_buf[0], V)) & set(
                    np.flatnonzero(utf8_oracle(prefix + tb[drafts[k]], tb, is_json))
                )
                assert not after, (seed, committed, drafts)
            ref.rollback(steps)
            if bm.dead_end[0]:
                break
            t = int(rng.choice(allowed(bm.bitmask[0], V)))
            mgr.advance(rid, [t])
            assert ref.accept_token(t)
            committed.append(t)
        if mgr.finish_reason(rid) is FinishReason.STOP:
            text_of(byte_tok, committed).decode("utf-8")  # strict


def test_byte_filter_off_lets_engines_through(byte_tok, backend_for) -> None:
    """The premise: without the filter the any-byte grammar does emit invalid UTF-8."""
    backend = backend_for("llguidance", "byte")
    mgr = StructuredOutputManager(backend, utf8=False)
    rng = np.random.default_rng(random.randrange(2**31))
    bad = 0
    for i in range(8):
        mgr.add_request(i, ADVERSARIAL[0][1])
        toks = decode(mgr, i, rng)
        try:
            text_of(byte_tok, toks).decode("utf-8")
        except UnicodeDecodeError:
            bad += 1
    assert bad > 0


# ----------------------------------------------------------------------------- post-hoc checks
def test_violation_is_not_success(byte_tok, backend_for) -> None:
    # xgrammar does not enforce uniqueItems: the grammar accepts ["a","a"], the check does not
    schema = {
        "type": "array",
        "items": {"enum": ["a", "b"]},
        "uniqueItems": True,
        "minItems": 2,
        "maxItems": 2,
    }
    mgr = StructuredOutputManager(backend_for("xgrammar", "byte"))
    for rid, doc in (("dup", '["a","a"]'), ("ok", '["a","b"]')):
        mgr.add_request(rid, {"json_schema": schema})
        mgr.wait([rid])
        n = mgr.advance(rid, [*byte_tok.encode(doc), byte_tok.eos_token_id])
        assert n == len(doc) + 1
    assert mgr.finish_reason("ok") is FinishReason.STOP and mgr.metrics("ok")["grammar_check"] == "passed"
    assert mgr.finish_reason("dup") is FinishReason.VIOLATION
    assert "non-unique" in mgr.error("dup") and mgr.metrics("dup")["grammar_check"] == "failed"


@pytest.mark.parametrize(
    ("data", "ok"),
    [
        (b'{"a":1}', True),
        (b'{"a":1,"a":2}', False),
        (b'{"a":NaN}', False),
        (b'"\xed\xa0\x80"', False),
        (b'"a\x01"', False),
        (b'{"a":"x"}', False),
    ],
)
def test_check_document_is_strict(data: bytes, ok: bool) -> None:
    from deepinfer_core.structured.validate import make_validator

    v, why = make_validator('{"type":"object","properties":{"a":{"type":"integer"}}}')
    assert why is None and check_document(data, v).ok is ok


def test_auto_relaxes_llguidance_when_every_engine_refuses(auto, byte_tok) -> None:
    # an unknown format (llguidance refuses) and an integer bound past int64 (xgrammar refuses)
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "format": "mongoId", "maxLength": 6},
            "b": {"type": "integer", "minimum": 0, "maximum": 10**20},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    mgr = StructuredOutputManager(auto)
    rng = np.random.default_rng(random.randrange(2**31))
    for i in range(3):
        mgr.add_request(i, {"json_schema": schema})
        toks = decode(mgr, i, rng)
        m = mgr.metrics(i)
        assert m["grammar_engine"] == "llguidance" and m["grammar_relaxed"] == ["coerce_one_of", "lenient"]
        assert set(m["grammar_refused"]) == {"llguidance", "xgrammar"}
        if mgr.finish_reason(i) is FinishReason.STOP:
            assert check_document(text_of(byte_tok, toks[:-1]), None).ok


def test_auto_fast_paths_equal_the_general_path(auto) -> None:
    """Both engines' C++ calls under auto (single-engine batches) and the mixed general path give the
    rows, cuts and dead ends of a fast_path=False manager, drafts (junk included) and the filter on."""
    from .test_end_to_end import SCHEMA

    one_of = {"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 5}]}  # xgrammar serves it
    specs = [
        GrammarSpec("json_schema", SCHEMA),
        GrammarSpec("json_schema", one_of),
        GrammarSpec("regex", "[a-c\u00e9]{1,9}"),
        GrammarSpec("json_schema", {"type": "string", "maxLength": 8}, engine="xgrammar"),
    ]
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    fast, slow = (
        StructuredOutputManager(auto, compile_workers=1),
        StructuredOutputManager(auto, compile_workers=1, fast_path=False),
    )
    rids = list(range(2 * len(specs)))
    for r in rids:
        fast.add_request(r, specs[r % len(specs)])
        slow.add_request(r, specs[r % len(specs)])
    fast.wait(rids)
    slow.wait(rids)
    V = auto.vocab_size
    for step in range(16):
        live = [r for r in rids if fast.finish_reason(r) is None]
        assert live == [r for r in rids if slow.finish_reason(r) is None], seed
        if not live:
            break
        eng = {r: fast.metrics(r)["grammar_engine"] for r in live}
        groups = [live] + [[r for r in live if eng[r] == e] for e in ("llguidance", "xgrammar")]
        for group in (g for g in groups if g):
            batch = [
                (r, [int(rng.integers(0, V)) for _ in range(int(rng.integers(0, 4)))] if step % 2 else [])
                for r in group
            ]
            a = fast.fill_bitmask(batch)
            a_bits, a_k, a_dead = a.bitmask.clone(), a.num_drafts.copy(), a.dead_end.copy()
            b = slow.fill_bitmask(batch)
            assert torch.equal(a_bits, b.bitmask) and a_k.tolist() == b.num_drafts.tolist(), seed
            assert a_dead.tolist() == b.dead_end.tolist(), seed
        bm = slow.fill_bitmask([(r, []) for r in live])
        for j, r in enumerate(live):
            if not bm.dead_end[j]:
                t = int(rng.choice(allowed(bm.bitmask[j], V)))
                assert fast.advance(r, [t]) == slow.advance(r, [t])
    assert fast._fast_fill.fast_calls > 0 and fast._fast_fill2 is not None and fast._fast_fill2.fast_calls > 0
