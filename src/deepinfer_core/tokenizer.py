"""Tokenizers behind the :class:`~deepinfer_core.protocols.Tokenizer` seam.

``ByteTokenizer`` is the built-in tokenizer of the tiny model (no download): ids 0-2 are <bos>, <eos>,
<pad> (pad id 2 is also the Engram pad, as in DeepSeek's vocab), ids 3..258 are the 256 bytes, and the
rest of the vocabulary up to ``vocab_size`` are reserved control tokens (one is the DSpark noise token).
``HFTokenizer`` wraps any HuggingFace ``tokenizers`` tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    """UTF-8 bytes as tokens, with control tokens matched by id only (text can never produce them)."""

    __slots__ = ("_special", "_vocab_size")

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < BYTE_OFFSET + 256 + 1:
            raise ValueError(f"vocab_size={vocab_size}: must be >= {BYTE_OFFSET + 256 + 1} (3 specials, 256 bytes, noise)")
        self._vocab_size = vocab_size
        self._special = frozenset([BOS_ID, EOS_ID, PAD_ID, *range(BYTE_OFFSET + 256, vocab_size)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def noise_token_id(self) -> int:
        """The DSpark drafter's noise token (first reserved id after the bytes)."""
        return BYTE_OFFSET + 256

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        return [bytes([i - BYTE_OFFSET]) if BYTE_OFFSET <= i < BYTE_OFFSET + 256 else b"" for i in range(self._vocab_size)]


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer.json behind the library's protocol."""

    def __init__(self, path_or_tokenizer: str | Path | object, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tok  # optional dependency

        tok = path_or_tokenizer if isinstance(path_or_tokenizer, _Tok) else _Tok.from_file(str(path_or_tokenizer))
        # Control tokens typed as text must encode as plain text, never as the control id.
        tok.encode_special_tokens = True
        self._tok = tok
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
        added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self._special = frozenset(i for i, t in added.items() if t.special)
        eos_candidates = [eos_token] if eos_token else ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<｜end▁of▁sentence｜>"]
        eos = next((tok.token_to_id(t) for t in eos_candidates if t and tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ValueError(f"eos_token: none of {eos_candidates} is in the vocabulary; pass eos_token=")
        self._eos = int(eos)
        self._bytes: list[bytes] | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self) -> list[bytes]:
        if self._bytes is None:
            self._bytes = [b"" if i in self._special else _token_to_bytes(self._tok, i) for i in range(self._vocab_size)]
        return self._bytes


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's printable mapping of bytes used by byte-level BPE vocabularies.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_level_decoder()


def _token_to_bytes(tok: object, i: int) -> bytes:
    piece = tok.id_to_token(i)  # type: ignore[attr-defined]
    if piece is None:
        return b""
    if all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # sentencepiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode("utf-8")
