"""What the engine hands back per request: text, token ids, why it stopped, or why it failed.

Outputs stream (docs/engine.md, "Streaming"): ``LLMEngine.step`` returns a ``RequestOutput`` for every
request that produced tokens in the step, and for every request that ended in it. What an output holds is
the request's ``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): the whole output so far
(``CUMULATIVE``), only what is new since the previous output (``DELTA``), or one output when the request
ends (``FINAL_ONLY``). ``finished`` is True on the last output of a request, and only there.
"""

from __future__ import annotations

from typing import Any

import attrs

from deepinfer_core.sampling_params import RequestOutputKind

# Finish reasons (strings, as vLLM reports them); the grammar ones come from deepinfer_core.structured.
STOP = "stop"  # EOS (unless ignore_eos), a stop_token_ids member, or the grammar accepted its end
LENGTH = "length"  # max_tokens outputs, or max_model_len tokens in all
ABORT = "abort"  # LLMEngine.abort
ERROR = "error"  # the request could not be served; ``error`` says why (the rest of the batch is unaffected)
VIOLATION = "grammar_violation"  # structured.FinishReason.VIOLATION: the finished document failed its check

__all__ = [
    "ABORT",
    "ERROR",
    "LENGTH",
    "STOP",
    "VIOLATION",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
]


@attrs.frozen(kw_only=True)
class CompletionOutput:
    """One of the ``n`` samples of a request (``RequestOutput.outputs``); ``text`` / ``token_ids`` follow
    the request's output kind, as the flat fields of ``RequestOutput`` do."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One request's output: streamed (``finished`` False: ``finish_reason`` is None) or its last one.

    ``error`` is set (and ``finish_reason`` is ``"error"`` or a grammar reason) when the request failed
    alone: bad input, an invalid grammar, a grammar dead end. With ``SamplingParams.n`` > 1, ``samples``
    holds the n completions (in ``DELTA`` mode only those that changed in the step) and the flat fields
    (``text``, ``token_ids``, ``finish_reason``, ...) are those of ``samples[0]``; ``outputs`` gives the
    completions in both cases (vLLM's ``RequestOutput.outputs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = ERROR
    error: str | None = None
    num_preemptions: int = 0
    # prefix caching (docs/swa.md), summed over the request's (re)starts: prompt tokens whose block KV
    # came from the prefix cache, and tokens recomputed to rebuild the sliding-window state after a hit
    # (encoder replay of cached tokens + the decoder tail replayed with truncated windows)
    cached_tokens: int = 0
    replayed_tokens: int = 0
    # vLLM's stop_reason: the stop string that ended the request (None otherwise)
    stop_reason: str | None = None
    # per-request measurements: arrival_time, first_token_time, last_token_time (time.monotonic()),
    # num_generated_tokens; speculative decoding: drafts_verified, drafts_accepted; structured requests:
    # grammar_engine (which grammar engine served it), grammar_refused, grammar_check
    # (StructuredOutputManager.metrics)
    metrics: dict[str, Any] = attrs.field(factory=dict)
    finished: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    samples: tuple[CompletionOutput, ...] = ()  # n > 1: the n completions (see the class docstring)

    @property
    def ok(self) -> bool:
        """True when the request was served (stopped, hit its length, or was aborted by the caller)."""
        return self.error is None

    @property
    def outputs(self) -> tuple[CompletionOutput, ...]:
        """The completions: ``samples`` with n > 1, else the one made of the flat fields."""
        if self.samples:
            return self.samples
        return (
            CompletionOutput(
                index=0,
                text=self.text,
                token_ids=self.token_ids,
                finish_reason=self.finish_reason if self.finished else None,
                stop_reason=self.stop_reason,
                error=self.error,
            ),
        )
