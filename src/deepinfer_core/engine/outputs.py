"""What the engine hands back per request: text, token ids, why it stopped, or why it failed."""

from __future__ import annotations

from typing import Any

import attrs

# Finish reasons (strings, as vLLM reports them); the grammar ones come from deepinfer_core.structured.
STOP = "stop"  # EOS (unless ignore_eos), a stop_token_ids member, or the grammar accepted its end
LENGTH = "length"  # max_tokens outputs, or max_model_len tokens in all
ABORT = "abort"  # LLMEngine.abort
ERROR = "error"  # the request could not be served; ``error`` says why (the rest of the batch is unaffected)
VIOLATION = "grammar_violation"  # structured.FinishReason.VIOLATION: the finished document failed its check


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One finished request. ``error`` is set (and ``finish_reason`` is ``"error"`` or a grammar reason)
    when the request failed alone: bad input, an invalid grammar, a grammar dead end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ERROR
    error: str | None = None
    num_preemptions: int = 0
    # prefix caching (docs/swa.md), summed over the request's (re)starts: prompt tokens whose block KV
    # came from the prefix cache, and tokens recomputed to rebuild the sliding-window state after a hit
    # (encoder replay of cached tokens + the decoder tail replayed with truncated windows)
    cached_tokens: int = 0
    replayed_tokens: int = 0
    # vLLM's stop_reason: the stop string that ended the request (None otherwise)
    stop_reason: str | None = None
    # per-request measurements; structured requests: grammar_engine (which grammar engine served it),
    # grammar_refused, grammar_check (see StructuredOutputManager.metrics)
    metrics: dict[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        """True when the request was served (stopped, hit its length, or was aborted by the caller)."""
        return self.error is None
