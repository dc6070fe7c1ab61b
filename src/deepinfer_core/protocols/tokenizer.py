"""Seam of tokenizers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, plus the raw bytes of every token (what grammar engines need)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the logits width may be larger; extra ids are never produced)."""
        ...

    @property
    def eos_token_id(self) -> int:
        """End-of-sequence id."""
        ...

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens: matched by id only, never produced by encoding text, excluded from grammars."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens are produced from text)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced, special tokens are dropped."""
        ...

    def token_bytes(self) -> list[bytes]:
        """For each id, the bytes it stands for (b'' for special tokens)."""
        ...
