"""Fixtures of the structured-output tests: both tokenizers, both backends, and a random-logit decoder."""

from __future__ import annotations

import pytest

from deepinfer_core.structured import make_backend
from deepinfer_core.structured.synthetic_vocab import EOS, train_bpe
from deepinfer_core.tokenizer import ByteTokenizer, HFTokenizer

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

BACKEND_NAMES = ("xgrammar", "llguidance")


@pytest.fixture(scope="session")
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def bpe_tok() -> HFTokenizer:
    # ~0.4 s to train; big enough for multi-character tokens that straddle grammar boundaries.
    return HFTokenizer(train_bpe(1000, seed=7), eos_token=EOS)


_BACKENDS: dict[tuple[str, str], object] = {}


@pytest.fixture(scope="session")
def backend_for(byte_tok: ByteTokenizer, bpe_tok: HFTokenizer):
    """``backend_for(name, vocab)`` with vocab in {"byte", "bpe"}; built once per session."""

    def get(name: str, vocab: str) -> object:
        key = (name, vocab)
        if key not in _BACKENDS:
            _BACKENDS[key] = make_backend(name, byte_tok if vocab == "byte" else bpe_tok)
        return _BACKENDS[key]

    return get


@pytest.fixture(scope="session")
def tok_for(byte_tok: ByteTokenizer, bpe_tok: HFTokenizer):
    return lambda vocab: byte_tok if vocab == "byte" else bpe_tok
