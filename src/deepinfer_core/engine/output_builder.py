"""The engine's output side: a finished (or failed) request becomes its ``RequestOutput``.

``OutputBuilder`` keeps the outputs that are ready before the scheduler reports anything (requests that
failed before reaching it, outputs handed back by a caller they did not belong to) and builds the
output of a request the scheduler reported finished, from what ``RequestTable.retire`` collected.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from deepinfer_core.engine.outputs import ABORT, ERROR, LENGTH, STOP, RequestOutput
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.protocols import Tokenizer
from deepinfer_core.scheduler import FinishedRequest, FinishReason

log = logging.getLogger(__name__)

_REASONS = {
    FinishReason.STOP: STOP,
    FinishReason.LENGTH: LENGTH,
    FinishReason.ABORT: ABORT,
    FinishReason.FAILED: ERROR,
}


@attrs.define
class Retired:
    """What a request left behind when the engine forgot it (``RequestTable.retire``)."""

    req: EngineRequest
    stops: StopStrings | None
    metrics: dict[str, Any]
    cached_tokens: int
    replayed_tokens: int


class OutputBuilder:
    """``RequestOutput`` s: finished requests', and the queue of outputs the next ``step`` returns."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ready: list[RequestOutput] = []  # failed before reaching the scheduler, or handed back

    def take_ready(self) -> list[RequestOutput]:
        out, self.ready = self.ready, []
        return out

    def has_ready(self, request_id: str) -> bool:
        return any(o.request_id == request_id for o in self.ready)

    def failed(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        error: str | None,
        reason: str = ERROR,
    ) -> None:
        """A request that ended outside the scheduler (bad input, a grammar that did not compile, an abort
        while compiling): its output is returned by the next ``step``."""
        if error is not None:
            log.warning("request %r failed: %s", request_id, error)
        self.ready.append(
            RequestOutput(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                finish_reason=reason,
                error=error,
            )
        )

    def reset_output(self, req: EngineRequest, error: str) -> RequestOutput:
        """A live request failed by ``LLMEngine.reset``."""
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            finish_reason=ERROR,
            error=error,
        )

    def finished(self, fr: FinishedRequest, gone: Retired) -> RequestOutput:
        """The output of a request the scheduler reported: the engine's own reason (``EngineRequest.reason``,
        set when the engine ended it) wins over the scheduler's; a stop string cuts the text."""
        req, stops = gone.req, gone.stops
        hit = stops.hit if stops is not None else None
        reason = req.reason if req.reason is not None else _REASONS.get(fr.finish_reason, ERROR)
        error = req.error
        if fr.finish_reason is FinishReason.FAILED and error is None:
            error = "the sampler returned no valid token for this request"
        if error is not None:
            log.warning("request %r failed: %s", req.request_id, error)
        ids = fr.output_token_ids
        text = None
        if hit is not None and stops is not None:  # the text ends at the stop string (vLLM's rule)
            ids, text = ids[: hit.tokens], stops.text()
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=self.tokenizer.decode(ids) if text is None else text,
            token_ids=ids,
            finish_reason=reason,
            error=error,
            num_preemptions=fr.num_preemptions,
            cached_tokens=gone.cached_tokens,
            replayed_tokens=gone.replayed_tokens,
            stop_reason=hit.stop if hit is not None else None,
            metrics=gone.metrics,
        )
