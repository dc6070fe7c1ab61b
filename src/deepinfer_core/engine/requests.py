"""Per-request input checks and the engine's per-sequence arrays (indexed by the scheduler's seq id)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from deepinfer_core.protocols import Tokenizer
from deepinfer_core.sampling_params import SamplingParams


class RequestError(ValueError):
    """One request's input is invalid; the message names the field. Only that request fails."""


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def normalize_prompt(prompt: object, tokenizer: Tokenizer) -> tuple[str | None, tuple[int, ...]]:
    """(text or None, token ids) of a prompt given as text or as token ids; RequestError naming the field."""
    if isinstance(prompt, str):
        ids = tuple(tokenizer.encode(prompt))
        if not ids:
            raise RequestError("prompt: must not be empty")
        return prompt, ids
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise RequestError(f"prompt: must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise RequestError("prompt_token_ids: must not be empty")
    v = tokenizer.vocab_size
    for i, t in enumerate(prompt):
        if not _is_int(t):
            raise RequestError(f"prompt_token_ids[{i}]={t!r}: must be an int")
        if not 0 <= int(t) < v:
            raise RequestError(f"prompt_token_ids[{i}]={int(t)}: must be in [0, vocab_size={v})")
    return None, tuple(int(t) for t in prompt)


def normalize_params(params: object, vocab_size: int) -> SamplingParams:
    """A SamplingParams from a SamplingParams or a dict of its fields; RequestError naming the field."""
    if params is None:
        params = SamplingParams()
    elif isinstance(params, Mapping):
        try:
            params = SamplingParams(**params)
        except TypeError as e:  # an unknown field name
            raise RequestError(f"sampling_params: {e}") from None
        except ValueError as e:
            raise RequestError(str(e)) from None
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling_params: must be a SamplingParams or a dict, got {type(params).__name__}")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError(f"SamplingParams.stop_token_ids: {bad} must be < vocab_size={vocab_size}")
    return params


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


class SeqTable:
    """Per-sequence values as numpy arrays indexed by seq id, so a step gathers them without a loop."""

    def __init__(self, capacity: int = 64) -> None:
        self._n = 0
        self.last_token = np.zeros(0, np.int64)  # the token sampled last (fills -1 placeholders)
        self.n_out = np.zeros(0, np.int64)  # tokens sampled so far (in flight included)
        self.min_tokens = np.zeros(0, np.int64)
        self.temperature = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int64)
        self.top_p = np.zeros(0, np.float32)
        self.seed = np.zeros(0, np.int64)
        self.dead = np.zeros(0, bool)  # ended or being ended: its rows are dropped from the batch
        self.structured = np.zeros(0, bool)
        self._grow(capacity)

    _FIELDS = ("last_token", "n_out", "min_tokens", "temperature", "top_k", "top_p", "seed", "dead", "structured")

    def _grow(self, n: int) -> None:
        for f in self._FIELDS:
            old = getattr(self, f)
            new = np.zeros(n, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, f, new)
        self._n = n

    def add(self, seq: int, params: SamplingParams, seed: int, structured: bool) -> None:
        if seq >= self._n:
            self._grow(max(2 * self._n, seq + 1))
        self.last_token[seq] = -1
        self.n_out[seq] = 0
        self.min_tokens[seq] = params.min_tokens
        self.temperature[seq] = params.temperature
        self.top_k[seq] = params.top_k
        self.top_p[seq] = params.top_p
        self.seed[seq] = seed
        self.dead[seq] = False
        self.structured[seq] = structured


def derived_seed(engine_seed: int, serial: int) -> int:
    """Seed of a request that gave none: a function of the engine seed and its arrival number."""
    return (engine_seed * 0x9E3779B1 + serial) % 2**63


def as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]
