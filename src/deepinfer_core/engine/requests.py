"""Per-request input checks and the engine's per-sequence arrays (found by the scheduler's seq id)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from deepinfer_core.protocols import Tokenizer
from deepinfer_core.sampling_params import SamplingParams, short_repr


class RequestError(ValueError):
    """One request's input is invalid; the message names the field. Only that request fails."""


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _text_ids(text: str, tokenizer: Tokenizer, field: str) -> tuple[str, tuple[int, ...]]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: not text any tokenizer can encode
        raise RequestError(
            f"{field}: not valid Unicode text (character {e.object[e.start]!r} at index {e.start} "
            "is a lone surrogate); pass valid text or token ids"
        ) from None
    ids = tuple(tokenizer.encode(text))
    if not ids:
        raise RequestError(f"{field}: must not be empty")
    return text, ids


def _token_ids(prompt: object, vocab: int, field: str) -> tuple[int, ...]:
    if hasattr(prompt, "detach") and hasattr(prompt, "tolist"):  # a torch tensor, without importing torch
        prompt = prompt.detach().cpu().numpy()
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise RequestError(f"{field}: a token-id array must be 1-D, got shape {prompt.shape}")
        if prompt.dtype.kind not in "iu":
            raise RequestError(f"{field}: a token-id array must have an integer dtype, got {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple):
        raise RequestError(f"{field}: must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise RequestError(f"{field}: must not be empty")
    out = []
    for i, t in enumerate(prompt):
        if not _is_int(t):
            raise RequestError(f"{field}[{i}]={_short(t)}: must be an int")
        if not 0 <= int(t) < vocab:
            raise RequestError(f"{field}[{i}]={int(t)}: must be in [0, vocab_size={vocab})")
        out.append(int(t))
    return tuple(out)


def normalize_prompt(prompt: object, tokenizer: Tokenizer) -> tuple[str | None, tuple[int, ...]]:
    """(text or None, token ids) of one prompt; RequestError naming the field.

    A prompt is a ``str``, a list / tuple / 1-D integer numpy array (or torch tensor) of token ids, or a
    vLLM-style dict ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``. ``bytes`` are refused (they are
    neither text nor token ids: decode them first), as are other dicts and types.
    """
    if isinstance(prompt, str):
        return _text_ids(prompt, tokenizer, "prompt")
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise RequestError(
            f"prompt: {type(prompt).__name__} is not accepted; decode it to str, or pass token ids"
        )
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return _text_ids(prompt["prompt"], tokenizer, "prompt")
        if keys == {"prompt_token_ids"}:
            return None, _token_ids(prompt["prompt_token_ids"], tokenizer.vocab_size, "prompt_token_ids")
        raise RequestError(
            'prompt: a dict prompt must be {"prompt": str} or {"prompt_token_ids": [int, ...]}, '
            f"got keys {sorted(map(str, keys))}"
        )
    if isinstance(prompt, Sequence | np.ndarray) or hasattr(prompt, "detach"):
        return None, _token_ids(prompt, tokenizer.vocab_size, "prompt_token_ids")
    raise RequestError(f"prompt: must be a str or a sequence of token ids, got {type(prompt).__name__}")


def normalize_params(params: object, vocab_size: int) -> SamplingParams:
    """A SamplingParams from a SamplingParams or a dict of its fields; RequestError naming the field."""
    if params is None:
        params = SamplingParams()
    elif isinstance(params, Mapping):
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            raise RequestError(f"sampling_params: field names must be str, got {_short(bad)}")
        try:
            params = SamplingParams(**params)
        except TypeError as e:  # an unknown field name
            raise RequestError(f"sampling_params: {e}") from None
        except ValueError as e:
            raise RequestError(str(e)) from None
    if not isinstance(params, SamplingParams):
        raise RequestError(
            f"sampling_params: must be a SamplingParams or a dict, got {type(params).__name__}"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError(f"SamplingParams.stop_token_ids: {bad} must be < vocab_size={vocab_size}")
    return params


def _short(v: object) -> str:
    return short_repr(v, 80)


@attrs.define(slots=True)
class EngineRequest:
    """The engine's record of one request while it is live."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seq: int = -1  # the scheduler's sequence id once queued there
    structured: bool = False
    # set when the engine ends a request itself (grammar end under ignore_eos, a failed row): the
    # scheduler then reports ABORT / FAILED and this says what really happened
    reason: str | None = None
    error: str | None = None
    arrival: float = attrs.field(factory=time.monotonic)  # metrics["arrival_time"]
    drafts_verified: int = 0  # speculative decoding, this request's drafts
    drafts_accepted: int = 0


class SeqTable:
    """Per-sequence values as numpy arrays, so a step gathers them for all its rows without a loop.

    Rows are found by the scheduler's seq id through ``ix`` (a ``searchsorted`` over the live ids, which
    the scheduler hands out in increasing order); ``remove`` frees a row and the table compacts itself,
    so its size follows the live requests, not every request ever submitted (a long-running server).
    Row 0 is a sentinel: a removed or unknown seq id maps to it, and it is always ``dead``, so a row that
    a plan still names after its request ended is dropped like any other dead row.
    """

    _FIELDS = (
        "last_token",
        "n_out",
        "min_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "dead",
        "structured",
    )

    def __init__(self, capacity: int = 64) -> None:
        self.last_token = np.zeros(0, np.int64)  # the token sampled last (fills -1 placeholders)
        self.n_out = np.zeros(0, np.int64)  # tokens sampled so far (in flight included)
        self.min_tokens = np.zeros(0, np.int64)
        self.temperature = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int64)
        self.top_p = np.zeros(0, np.float32)
        self.seed = np.zeros(0, np.int64)
        self.dead = np.zeros(0, bool)  # ended or being ended: its rows are dropped from the batch
        self.structured = np.zeros(0, bool)
        self._keys = np.full(1, -1, np.int64)  # seq id per row, increasing; row 0 is the sentinel
        self._gone = np.zeros(1, bool)
        self._n = 1  # rows in use (sentinel included)
        self._live = 0
        self._resize(max(2, capacity))
        self.dead[0] = True

    def __len__(self) -> int:
        """Live (added, not removed) sequences."""
        return self._live

    @property
    def capacity(self) -> int:
        return int(self._keys.shape[0])

    def _resize(self, n: int) -> None:
        for f in (*self._FIELDS, "_keys", "_gone"):
            old = getattr(self, f)
            new = np.zeros(n, old.dtype)
            m = min(n, self._n, old.shape[0])
            new[:m] = old[:m]
            setattr(self, f, new)

    def _compact(self) -> None:
        keep = np.flatnonzero(~self._gone[: self._n])  # row 0 is never gone
        for f in (*self._FIELDS, "_keys", "_gone"):
            a = getattr(self, f)
            a[: keep.size] = a[keep]
        self._n = int(keep.size)
        cap = self.capacity
        if self._n * 4 < cap and cap > 64:  # shrink once mostly empty, keeping room to grow
            self._resize(max(64, 2 * self._n))

    def ix(self, seq: np.ndarray | int | np.integer) -> np.ndarray:
        """Row index of each seq id (0, the dead sentinel, for ids not in the table)."""
        keys = self._keys[1 : self._n]
        q = np.asarray(seq, np.int64)
        i = np.searchsorted(keys, q).clip(max=max(keys.size - 1, 0))
        hit = (keys[i] == q) if keys.size else np.zeros(q.shape, bool)
        return np.where(hit & ~self._gone[1 : self._n][i] if keys.size else hit, i + 1, 0)

    def row(self, seq: int) -> int:
        return int(self.ix(np.int64(seq)))

    def add(self, seq: int, params: SamplingParams, seed: int, structured: bool) -> None:
        if self._n > 1 and seq <= self._keys[self._n - 1]:
            raise ValueError(f"seq {seq}: seq ids must be added in increasing order")
        if self._n == self.capacity:
            self._compact()
            if self._n * 2 > self.capacity:
                self._resize(2 * self.capacity)
        r = self._n
        self._n += 1
        self._live += 1
        self._keys[r], self._gone[r] = seq, False
        self.last_token[r] = -1
        self.n_out[r] = 0
        self.min_tokens[r] = params.min_tokens
        self.temperature[r] = params.temperature
        self.top_k[r] = min(params.top_k, np.iinfo(np.int64).max)
        self.top_p[r] = params.top_p
        self.seed[r] = seed
        self.dead[r] = False
        self.structured[r] = structured

    def remove(self, seq: int) -> None:
        """Forget a sequence (its request was reported); later lookups of it give the dead sentinel."""
        r = self.row(seq)
        if r:
            self._gone[r] = True
            self.dead[r] = True
            self._live -= 1


def derived_seed(engine_seed: int, serial: int) -> int:
    """Seed of a request that gave none: a function of the engine seed and its arrival number."""
    return (engine_seed * 0x9E3779B1 + serial) % 2**63


def as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]
