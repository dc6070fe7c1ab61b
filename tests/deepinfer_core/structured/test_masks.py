"""The two backends agree token for token on regexes written with explicit ASCII classes, and differ
exactly as documented (docs/structured.md, "Known differences") elsewhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepinfer_core.structured import GrammarSpec

from ._decode import allowed_ids

ASCII_REGEXES = [
    r"[0-9]{1,4}",
    r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"[a-z]{1,8}@[a-z]{2,8}\.(com|org)",
    r"[A-Z][a-z]+( [A-Z][a-z]+){0,2}",
    r"(ab|abc|b)*c?",
    r"[^a-z\n]{2,5}",
    r"\{\"[a-z]{1,4}\": ?(true|false|[0-9]{1,3})\}",
    r"(GET|POST|PUT) /[a-z0-9/]{0,12} HTTP/1\.[01]",
    r"[ -~]{0,6}!",
]


def _mask(m, words: int) -> torch.Tensor:
    bm = torch.zeros((1, words), dtype=torch.int32)
    m.fill_next_token_bitmask(bm, 0)
    return bm[0]


@pytest.mark.parametrize("vocab", ["byte", "bpe"])
def test_backends_identical_masks_on_ascii_regexes(vocab: str, backend_for) -> None:
    """Byte vocab: identical masks in every state. BPE vocab: identical wherever the grammar does not
    force the next bytes; where it does (e.g. the literal '{"' of a regex), llguidance admits only the
    canonical tokenisation of the forced text, a subset of xgrammar's mask (a documented difference)."""
    bx, bl = backend_for("xgrammar", vocab), backend_for("llguidance", vocab)
    words = (bx.vocab_size + 31) // 32
    rng = np.random.default_rng(11)
    equal = forced = 0
    for rx in ASCII_REGEXES:
        spec = GrammarSpec("regex", rx)
        cx, cl = bx.compile(spec), bl.compile(spec)
        for _ in range(6):
            mx, ml = bx.matcher(cx), bl.matcher(cl)
            while not mx.is_terminated():
                a, b = _mask(mx, words), _mask(ml, words)
                ax, al = allowed_ids(a, bx.vocab_size), allowed_ids(b, bx.vocab_size)
                if vocab == "bpe" and ml._m.compute_ff_bytes():
                    forced += 1
                    assert len(al) > 0 and set(al) <= set(ax), (rx, np.setdiff1d(al, ax))
                else:
                    equal += 1
                    # Bits past vocab_size are padding (xgrammar sets them, llguidance clears them; the
                    # manager clears them), so compare the tokens.
                    assert np.array_equal(ax, al), (rx, np.setxor1d(ax, al)[:10])
                t = int(rng.choice(al))
                assert mx.accept_token(t) and ml.accept_token(t)
                assert mx.is_terminated() == ml.is_terminated()
    assert equal > 100
    assert vocab == "byte" or forced > 0


def _first_mask(backend, spec: GrammarSpec) -> set[int]:
    m = backend.matcher(backend.compile(spec))
    return set(allowed_ids(_mask(m, (backend.vocab_size + 31) // 32), backend.vocab_size).tolist())


def _byte_ids(tok, lo: int, hi: int) -> set[int]:
    return {t for t in range(tok.vocab_size) if tok.token_bytes()[t] and lo <= tok.token_bytes()[t][0] <= hi}


def test_known_difference_unicode_classes_over_byte_tokens(backend_for, byte_tok) -> None:
    bx, bl = backend_for("xgrammar", "byte"), backend_for("llguidance", "byte")
    ascii_digits = {
        t
        for t in range(byte_tok.vocab_size)
        if byte_tok.token_bytes()[t] in {str(d).encode() for d in range(10)}
    }
    # \d: xgrammar means [0-9]; llguidance (Rust regex) means Unicode Nd, so it also allows the lead
    # bytes of non-ASCII digits (e.g. Arabic-Indic U+0660 starts with 0xD9).
    sx, sl = _first_mask(bx, GrammarSpec("regex", r"\d")), _first_mask(bl, GrammarSpec("regex", r"\d"))
    assert sx == ascii_digits
    assert ascii_digits < sl and (sl - sx) <= _byte_ids(byte_tok, 0xC2, 0xF4)
    assert byte_tok.encode("٠")[0] in sl
    # \w likewise: ASCII word characters for xgrammar, Unicode letters too for llguidance.
    wx, wl = _first_mask(bx, GrammarSpec("regex", r"\w")), _first_mask(bl, GrammarSpec("regex", r"\w"))
    assert wx < wl and (wl - wx) <= _byte_ids(byte_tok, 0xC2, 0xF4)
    # '.': xgrammar admits a newline, llguidance (Rust regex default) does not.
    nl = byte_tok.encode("\n")[0]
    assert nl in _first_mask(bx, GrammarSpec("regex", ".")) and nl not in _first_mask(
        bl, GrammarSpec("regex", ".")
    )


def _accepts(backend, spec: GrammarSpec, text: bytes, tok) -> bool:
    m = backend.matcher(backend.compile(spec))
    return all(m.accept_token(b + 3) for b in text) and m.accept_token(tok.eos_token_id)


def test_known_difference_json_strings_and_extra_properties(backend_for, byte_tok) -> None:
    bx, bl = backend_for("xgrammar", "byte"), backend_for("llguidance", "byte")
    s = GrammarSpec(
        "json_schema", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    )
    bounded = GrammarSpec(
        "json_schema",
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]},
    )
    # A raw control character inside a string is invalid JSON. Both refuse it in a plain string, but
    # xgrammar's length-bounded strings (maxLength) admit it; llguidance refuses it there too.
    raw = b'{"a":"x\x01y"}'
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    assert not _accepts(bx, s, raw, byte_tok) and not _accepts(bl, s, raw, byte_tok)
    assert _accepts(bx, bounded, raw, byte_tok) and not _accepts(bl, bounded, raw, byte_tok)
    # Likewise a UTF-8-encoded surrogate (invalid UTF-8) in a bounded string.
    surrogate = b'{"a":"\xed\xa0\x80"}'
    assert _accepts(bx, bounded, surrogate, byte_tok) and not _accepts(bl, bounded, surrogate, byte_tok)
    # Properties the schema does not list: xgrammar compiles in strict mode (no extra properties);
    # llguidance follows JSON Schema (additionalProperties defaults to true).
    extra = b'{"a":"x","b":1}'
    assert not _accepts(bx, s, extra, byte_tok) and _accepts(bl, s, extra, byte_tok)
    # Both agree on the plain document.
    assert _accepts(bx, s, b'{"a":"x"}', byte_tok) and _accepts(bl, s, b'{"a":"x"}', byte_tok)
