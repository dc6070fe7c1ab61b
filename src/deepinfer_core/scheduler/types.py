"""Plain data of the step planner: configuration, requests, plans and finished requests."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import attrs
import numpy as np

from deepinfer_core.sampling_params import SamplingParams

MAX_STEP_TOKENS = 32768  # DeepInfer's hard cap on tokens in one step (deployment Q&A)


class EngineType(enum.IntEnum):
    """What an engine runs (DeepInfer's EngineType)."""

    NORMAL = 0  # prefill and decode (never mixed in one step)
    PROMPT = 1  # prefill only: a request leaves after its prompt is computed and one token sampled
    COMPLETION = 2  # decode only: requests arrive with their prompt KV (loaded into blocks we reserve)


class StepType(enum.IntEnum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS (unless ignore_eos) or a stop token id, once min_tokens outputs exist
    LENGTH = 2  # max_tokens outputs (or max_model_len tokens in all)
    ABORT = 3  # abort() by id
    HANDOFF = 4  # PROMPT engine: prompt computed, first token sampled, KV handed to a decode engine
    FAILED = 5  # the request could not be served (e.g. the executor returned an invalid token for it)


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"SchedulerConfig.{field}: {msg}")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Knobs of one rank's scheduler. Validated here; the C++ core checks them again.

    ``time_budget_ns`` bounds a prefill step's predicted time (``None``: only the token cap binds);
    it must allow one token of the longest request (``cost(1, max_model_len - 1)``).
    ``prefill_attempt_interval`` / ``prefill_any_attempt_interval``: decode steps (since the last
    prefill step) after which the group switches to prefill when all / any ranks have prefill work.
    """

    engine_type: EngineType = EngineType.NORMAL
    max_num_seqs: int = 256
    max_num_batched_tokens: int = MAX_STEP_TOKENS
    max_model_len: int = 8192
    eos_token_id: int | None = None
    time_budget_ns: float | None = None
    prefill_attempt_interval: int = 2
    prefill_any_attempt_interval: int = 16
    async_mode: bool = False
    watermark_blocks: int = 0

    def __attrs_post_init__(self) -> None:
        _check(isinstance(self.engine_type, EngineType), "engine_type", f"{self.engine_type!r} must be an EngineType")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"{self.max_num_seqs} must be >= 1")
        _check(
            1 <= self.max_num_batched_tokens <= MAX_STEP_TOKENS,
            "max_num_batched_tokens",
            f"{self.max_num_batched_tokens} must be in [1, {MAX_STEP_TOKENS}]",
        )
        _check(self.max_model_len >= 2, "max_model_len", f"{self.max_model_len} must be >= 2")
        _check(self.eos_token_id is None or self.eos_token_id >= 0, "eos_token_id", "must be None or >= 0")
        _check(
            self.time_budget_ns is None or (self.time_budget_ns > 0 and not math.isnan(self.time_budget_ns)),
            "time_budget_ns",
            f"{self.time_budget_ns} must be None or > 0",
        )
        _check(self.prefill_attempt_interval >= 0, "prefill_attempt_interval", "must be >= 0")
        _check(
            self.prefill_any_attempt_interval >= self.prefill_attempt_interval,
            "prefill_any_attempt_interval",
            f"{self.prefill_any_attempt_interval} must be >= prefill_attempt_interval={self.prefill_attempt_interval}",
        )
        _check(self.watermark_blocks >= 0, "watermark_blocks", "must be >= 0")


def _prompt(v: object) -> tuple[int, ...]:
    a = np.asarray(v)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"Request.prompt_token_ids: must be integer token ids, got dtype {a.dtype}")
    return tuple(int(t) for t in a.reshape(-1).tolist())


@attrs.frozen
class Request:
    """One generation request: string id, prompt token ids, sampling and stopping parameters.

    For a COMPLETION engine the prompt's KV is present for all tokens but the last, which is the first
    token the decode engine feeds (in a P/D split: the token the PROMPT engine sampled).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_prompt)
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)


@attrs.frozen
class FinishedRequest:
    """A request that ended (reported exactly once, by the ``update`` that follows its end)."""

    request_id: str
    finish_reason: FinishReason
    output_token_ids: tuple[int, ...]
    num_preemptions: int
    handoff_block_ids: np.ndarray | None = None  # PROMPT engine: blocks holding its KV at hand-off


@attrs.frozen(slots=True, eq=False)
class Plan:
    """One step's plan. Row ``i`` computes ``num_tokens[i]`` tokens of sequence ``seq_ids[i]`` starting
    at position ``start[i]``; its input tokens are ``token_ids[offsets[i]:offsets[i+1]]`` where ``-1``
    is a placeholder for the token the previous step sampled for that sequence (asynchronous mode).
    Rows with ``sample[i]`` produce one token (a verify row, ``num_drafts[i] = k > 0``: 1..1 + k tokens;
    its last k input tokens are ``-1`` placeholders for the caller's drafts). ``block_tables`` is [rows, max blocks], padded with 0.
    """

    step_id: int
    step_type: StepType
    seq_ids: np.ndarray  # int64 [n]
    num_tokens: np.ndarray  # int32 [n]
    start: np.ndarray  # int32 [n]
    sample: np.ndarray  # int32 [n], 1 where the row samples a token
    num_drafts: np.ndarray  # int32 [n], drafts a verify row checks (its last num_drafts input tokens)
    token_ids: np.ndarray  # int32 [sum(num_tokens)]
    block_tables: np.ndarray  # int32 [n, w]
    preempted: tuple[str, ...]
    kv_load_seq_ids: np.ndarray  # int64: COMPLETION admissions whose KV must be loaded
    kv_load_num_tokens: np.ndarray  # int32: how many tokens of KV each needs
    predicted_ns: float
    names: Mapping[int, str] = attrs.field(repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def context_lens(self) -> np.ndarray:
        """KV length of each row after the step (start + num_tokens)."""
        return self.start + self.num_tokens

    @property
    def request_ids(self) -> list[str]:
        return [self.names[s] for s in self.seq_ids.tolist()]

    @property
    def num_scheduled(self) -> dict[str, int]:
        """vLLM-style view: ``{request_id: num_new_tokens}``."""
        return dict(zip(self.request_ids, self.num_tokens.tolist()))

    def positions(self) -> np.ndarray:
        """Flat position of every input token, vectorised (no per-row Python loop)."""
        total = self.total_tokens
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(self.num_tokens[:-1], dtype=np.int64)))
        return np.arange(total, dtype=np.int64) + np.repeat(self.start.astype(np.int64) - offsets, self.num_tokens)
