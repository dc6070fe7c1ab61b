"""Tokenizer adaptation: control tokens never match grammar text; EOS only where the grammar may end."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.structured import GrammarSpec, grammar_vocab
from deepinfer_core.structured.synthetic_vocab import EOS

from ._decode import allowed_ids


def _mask(backend, matcher) -> set[int]:
    bm = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bm, 0)
    return set(allowed_ids(bm[0], backend.vocab_size).tolist())


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_control_tokens_never_allowed_by_text(name: str, backend_for, byte_tok) -> None:
    backend = backend_for(name, "byte")
    control = set(byte_tok.special_token_ids) - {byte_tok.eos_token_id}
    m = backend.matcher(backend.compile(GrammarSpec("regex", r"[\x00-\x7f]{0,3}")))
    for text in ("", "a", "a\x00", "a\x00~"):
        m.reset()
        assert all(m.accept_token(t) for t in byte_tok.encode(text))
        allowed = _mask(backend, m)
        assert not allowed & control
        # EOS exactly where the regex may end: always here (length 0-3), never past it.
        assert byte_tok.eos_token_id in allowed
        assert all(not m.accept_token(c) for c in control)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_special_token_text_is_spelled_not_matched(name: str, backend_for, bpe_tok) -> None:
    backend = backend_for(name, "bpe")
    eos = bpe_tok.eos_token_id
    assert bpe_tok.token_bytes()[eos] == b""  # specials carry no text
    m = backend.matcher(backend.compile(GrammarSpec("regex", r"<\|endoftext\|>!")))
    assert eos not in _mask(backend, m)  # the text "<|endoftext|>" must not be produced by the control id
    for t in bpe_tok.encode(EOS + "!"):
        assert t != eos and m.accept_token(t)
    assert eos in _mask(backend, m) and m.accept_token(eos) and m.is_terminated()


def test_grammar_vocab_pads_and_validates(byte_tok) -> None:
    v = grammar_vocab(byte_tok, vocab_size=520)
    assert len(v.token_bytes) == v.vocab_size == 520 and v.bitmask_words == 17
    assert set(range(512, 520)) <= v.special_ids and v.token_bytes[515] == b""
    with pytest.raises(ValueError, match="vocab_size=500: must be >="):
        grammar_vocab(byte_tok, vocab_size=500)
