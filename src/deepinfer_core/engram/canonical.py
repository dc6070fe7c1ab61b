"""Canonical token map: raw token ids -> canonical ids, applied before hashing.

Engram hashes n-grams of *canonical* ids so that surface variants of one word (``Apple``, `` apple``,
``APPLE``) share table rows. DeepSeek's public reference builds the map by decoding every token and
normalising its text; tokens whose normalised text coincide get one canonical id, numbered in order of
first appearance. Here the normalisation is NFKC, lower case and whitespace folding (runs of spaces,
tabs and newlines become one space; surrounding whitespace is stripped unless the token is whitespace
only, which stays a single space). Optionally accents are stripped too (NFD + drop combining marks), as
the public demo does; the V4.1 table is not published, so this is a config choice, off by default.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

import numpy as np
import torch

from deepinfer_core.protocols.tokenizer import Tokenizer

_WS = re.compile(r"[ \t\r\n]+")


def normalize_token_text(text: str, strip_accents: bool = False) -> str:
    """The canonical key of one token's text (see module docstring)."""
    s = unicodedata.normalize("NFKC", text)
    if strip_accents:
        s = "".join(c for c in unicodedata.normalize("NFD", s) if not unicodedata.combining(c))
    s = _WS.sub(" ", s.lower())
    if s != " ":
        s = s.strip()
    return s if s else text


class CanonicalTokenMap:
    """A lookup table ``raw id -> canonical id`` (int64) with ``num_canonical`` distinct outputs."""

    __slots__ = ("_lookup", "_num_canonical", "_tensors")

    def __init__(self, lookup: np.ndarray | Sequence[int]) -> None:
        arr = np.asarray(lookup, dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"lookup: must be a non-empty 1-D id array, got shape {arr.shape}")
        if arr.min() < 0:
            raise ValueError("lookup: canonical ids must be >= 0")
        self._lookup = arr
        self._num_canonical = int(arr.max()) + 1
        self._tensors: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def identity(cls, vocab_size: int) -> CanonicalTokenMap:
        """Every id is its own canonical id (the default)."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size={vocab_size}: must be positive")
        return cls(np.arange(vocab_size, dtype=np.int64))

    @classmethod
    def from_token_texts(
        cls, texts: Sequence[str | bytes | None], strip_accents: bool = False
    ) -> CanonicalTokenMap:
        """Build from each id's text. ``bytes`` that are not valid UTF-8 (partial characters of byte-level
        tokenizers) and ``None`` (control tokens) are kept distinct: they key on themselves, never merge
        with a text token."""
        key_to_id: dict[object, int] = {}
        lookup = np.empty(len(texts), dtype=np.int64)
        for tid, t in enumerate(texts):
            key: object
            if t is None:
                key = ("special", tid)
            elif isinstance(t, bytes):
                try:
                    key = normalize_token_text(t.decode("utf-8"), strip_accents)
                except UnicodeDecodeError:
                    key = ("bytes", t)
            else:
                key = normalize_token_text(t, strip_accents)
            lookup[tid] = key_to_id.setdefault(key, len(key_to_id))
        return cls(lookup)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, strip_accents: bool = False) -> CanonicalTokenMap:
        """Build from any :class:`~deepinfer_core.protocols.Tokenizer` (its ``token_bytes``); special
        tokens each keep their own canonical id."""
        special = tokenizer.special_token_ids
        raw = tokenizer.token_bytes()
        texts: list[str | bytes | None] = [None if i in special or not b else b for i, b in enumerate(raw)]
        return cls.from_token_texts(texts, strip_accents)

    @property
    def vocab_size(self) -> int:
        """Raw ids accepted: [0, vocab_size)."""
        return int(self._lookup.size)

    @property
    def num_canonical(self) -> int:
        """Distinct canonical ids: [0, num_canonical)."""
        return self._num_canonical

    @property
    def lookup(self) -> np.ndarray:
        """The table itself (read-only view)."""
        v = self._lookup.view()
        v.flags.writeable = False
        return v

    def is_identity(self) -> bool:
        return bool(np.array_equal(self._lookup, np.arange(self._lookup.size)))

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The table as an int64 tensor on ``device`` (cached per device)."""
        dev = torch.device(device)
        t = self._tensors.get(dev)
        if t is None:
            t = torch.from_numpy(self._lookup.copy()).to(dev)
            self._tensors[dev] = t
        return t

    def __call__(self, token_ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """Canonical ids of ``token_ids`` (any shape, any int dtype); ids outside [0, vocab_size) raise.
        ``validate=False`` skips the range check (it syncs a GPU), for callers that checked already."""
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids: must be an integer tensor, got {token_ids.dtype}")
        if validate and token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token_ids: id {bad} is outside [0, vocab_size={self.vocab_size})")
        return self.tensor(token_ids.device)[token_ids.long()]
