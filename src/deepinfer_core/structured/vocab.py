"""Adapting the library's :class:`~deepinfer_core.protocols.Tokenizer` to each grammar engine.

Both engines need the bytes every token id stands for. Control tokens (``special_token_ids``, and any id
whose bytes are empty) must never match grammar text, so that typed text cannot produce them:
xgrammar treats a token with empty bytes as special; llguidance treats a token whose bytes start with
0xFF (never valid UTF-8) as special, so we name them ``b"\\xff[<id>]"``. The end-of-sequence id is the
grammar's stop token for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from deepinfer_core.extras import require
from deepinfer_core.protocols import Tokenizer


@attrs.frozen(slots=True)
class GrammarVocab:
    """The plain data both backends are built from."""

    token_bytes: tuple[bytes, ...]  # per id; b"" for control tokens
    special_ids: frozenset[int]
    eos_token_id: int
    vocab_size: int  # mask width in tokens == len(token_bytes) (padded when the model pads its vocabulary)

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int | None = None) -> GrammarVocab:
    """Collect token bytes and control ids from ``tokenizer``; ``vocab_size`` pads to the logits width."""
    raw = list(tokenizer.token_bytes())
    n = len(raw)
    if n != tokenizer.vocab_size:
        raise ValueError(f"tokenizer: token_bytes() has {n} entries but vocab_size is {tokenizer.vocab_size}")
    width = n if vocab_size is None else int(vocab_size)
    if width < n:
        raise ValueError(f"vocab_size={width}: must be >= the tokenizer's {n} tokens (the logits width)")
    eos = int(tokenizer.eos_token_id)
    if not 0 <= eos < n:
        raise ValueError(f"tokenizer.eos_token_id={eos}: must be in [0, {n})")
    # Ids past the tokenizer (a model padding its vocabulary) become control tokens: never allowed by
    # text, and llguidance sizes its masks by the token list, so the list itself is padded.
    raw += [b""] * (width - n)
    special = set(tokenizer.special_token_ids) | {i for i, b in enumerate(raw) if not b}
    special.add(eos)
    toks = tuple(b"" if i in special else bytes(b) for i, b in enumerate(raw))
    return GrammarVocab(token_bytes=toks, special_ids=frozenset(special), eos_token_id=eos, vocab_size=width)


def xgrammar_tokenizer_info(vocab: GrammarVocab) -> object:
    """An ``xgrammar.TokenizerInfo`` over raw token bytes (no vocab decoding needed)."""
    xgr = require("xgrammar", "the xgrammar grammar backend")

    return xgr.TokenizerInfo(
        list(vocab.token_bytes),
        xgr.VocabType.RAW,
        vocab_size=vocab.vocab_size,
        stop_token_ids=[vocab.eos_token_id],
        add_prefix_space=False,
    )


class _LLGuidanceTokenizerSource:
    """The duck-typed object ``llguidance.TokenizerWrapper`` reads (tokens, ids, and an encode call)."""

    def __init__(self, vocab: GrammarVocab, tokenizer: Tokenizer) -> None:
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens: Sequence[bytes] = [
            b"\xff[" + str(i).encode() + b"]" if i in vocab.special_ids else b
            for i, b in enumerate(vocab.token_bytes)
        ]
        self.special_token_ids = sorted(vocab.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance only asks for the tokenisation of valid UTF-8 text (it falls back to greedy
        # tokenisation for a partial tail); our protocol encodes str.
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._tokenizer.encode(text)


def llguidance_tokenizer(vocab: GrammarVocab, tokenizer: Tokenizer) -> object:
    """An ``llguidance.LLTokenizer`` with the same ids, specials and eos as ``vocab``."""
    llg = require("llguidance", "the llguidance grammar backend")

    # TokenizerWrapper probes the encoder with bytes; ours takes either.
    wrapper = llg.TokenizerWrapper(_LLGuidanceTokenizerSource(vocab, tokenizer))
    return llg.LLTokenizer(wrapper, n_vocab=vocab.vocab_size, eos_token=vocab.eos_token_id)
