"""The OpenAI endpoints' logic over ``AsyncLLM`` (no web framework here: api_server.py wires it).

``OpenAIServing.completions`` / ``.chat`` take the parsed JSON body and return either a response dict
(non-streaming) or an async iterator of Server-Sent-Event strings (``stream: true``). Each prompt is one
``AsyncLLM.generate`` call (its ``n`` samples grouped by the engine), run as DELTA outputs. Leaving an
iterator early (the client went away) aborts the engine requests; a request the engine failed is a 500
(400 when the engine found its input invalid, e.g. a grammar that does not compile) for that request only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs

from deepinfer_core.engine.async_llm import AsyncLLM, EngineDeadError
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from deepinfer_core.entrypoints.openai.protocol import (
    APIError,
    GenRequest,
    check_lengths,
    parse_chat,
    parse_completion,
)

log = logging.getLogger(__name__)

# engine errors that are the request's own fault (its input), by the field the engine's message starts with
_CLIENT_FIELDS = {"SamplingParams.so_args": "response_format", "SamplingParams.": None, "prompt": "prompt"}


@attrs.define
class _Choice:
    """One completion (a prompt's sample) being accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = attrs.field(factory=list)
    finish_reason: str | None = None
    sent_role: bool = False
    in_calls: bool = False  # chat: the tool-call markers began; later text is held for the final parse
    sent_text: str = ""


def _flag(body: Any, key: str) -> bool:
    v = body.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise APIError(f"{key}: must be a bool", key)
    return bool(v)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def engine_error(o: RequestOutput) -> APIError:
    """The error response for a request the engine failed."""
    msg = o.error or "the request failed"
    if o.finish_reason == "grammar_invalid":
        return APIError(msg, "response_format")
    for prefix, param in _CLIENT_FIELDS.items():
        if msg.startswith(prefix):
            return APIError(msg, param)
    return APIError(f"the engine failed this request: {msg}", None, status=500, type="internal_server_error")


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_name: str, metrics: ServerMetrics | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.tokenizer = llm.engine.tokenizer
        self.max_model_len = llm.engine.config.max_model_len

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: Any) -> dict[str, Any] | AsyncIterator[str]:
        req = parse_completion(body, self.model_name, self.tokenizer)
        req.return_token_ids = _flag(body, "return_token_ids")
        check_lengths(req, self.max_model_len, "prompt")
        return self._stream(req, "completions") if req.stream else await self._full(req, "completions")

    async def chat(self, body: Any) -> dict[str, Any] | AsyncIterator[str]:
        req = parse_chat(body, self.model_name, self.tokenizer)
        req.return_token_ids = _flag(body, "return_token_ids")
        check_lengths(req, self.max_model_len, "messages")
        return self._stream(req, "chat") if req.stream else await self._full(req, "chat")

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "deepinfer",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    # ------------------------------------------------------------------ running
    async def _outputs(self, req: GenRequest, rid: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt's generate call, as they come."""
        if len(req.prompts) == 1:
            async for o in self.llm.generate(req.prompts[0], req.params, request_id=f"{rid}-0"):
                yield 0, o
            return
        q: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for o in self.llm.generate(req.prompts[i], req.params, request_id=f"{rid}-{i}"):
                    q.put_nowait((i, o))
            except BaseException as e:
                q.put_nowait(e)
                return
            q.put_nowait(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(req.prompts))]
        try:
            left = len(tasks)
            while left:
                item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()  # a consumer that left: every prompt's request is aborted

    def _choices(self, req: GenRequest) -> dict[int, _Choice]:
        n = req.params.n
        return {i * n + s: _Choice(i * n + s) for i in range(len(req.prompts)) for s in range(n)}

    def _absorb(
        self, req: GenRequest, i: int, o: RequestOutput, choices: dict[int, _Choice]
    ) -> list[tuple[_Choice, str, bool, tuple[int, ...]]]:
        """Add a DELTA output to its choices; (choice, new text, ended now) of each that changed."""
        if o.finished and o.error is not None:
            raise engine_error(o)
        out = []
        for s in o.outputs:
            c = choices[i * req.params.n + s.index]
            c.text += s.text
            c.token_ids += s.token_ids
            ended = s.finish_reason is not None and c.finish_reason is None
            if ended:
                c.finish_reason = s.finish_reason
            out.append((c, s.text, ended, s.token_ids))
        return out

    async def _full(self, req: GenRequest, endpoint: str) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        timer = RequestTimer(self.metrics)
        choices = self._choices(req)
        cached = 0
        try:
            async for i, o in self._outputs(req, rid):
                timer.tokens(sum(len(s.token_ids) for s in o.outputs))
                self._absorb(req, i, o, choices)
                if o.finished:
                    cached += o.cached_tokens
        except APIError:
            self.metrics.finish(endpoint, "error")
            raise
        except EngineDeadError as e:
            self.metrics.finish(endpoint, "error")
            raise APIError(f"the engine is not running: {e}", None, 503, "service_unavailable") from None
        except BaseException:
            self.metrics.finish(endpoint, "cancelled")
            raise
        timer.done()
        usage = self._usage(req, choices)
        self.metrics.finish(endpoint, "ok", usage["prompt_tokens"], usage["completion_tokens"], cached)
        created = int(time.time())
        if endpoint == "completions":
            return {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": c.index,
                        "text": self._echo(req, c) + c.text,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        **({"token_ids": c.token_ids} if req.return_token_ids else {}),
                    }
                    for c in choices.values()
                ],
                "usage": usage,
            }
        return {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [self._chat_choice(req, c) for c in choices.values()],
            "usage": usage,
        }

    def _echo(self, req: GenRequest, c: _Choice) -> str:
        if not req.echo:
            return ""
        i = c.index // req.params.n
        t = req.prompt_texts[i]
        return t if t is not None else self.tokenizer.decode(req.prompts[i])

    def _usage(self, req: GenRequest, choices: dict[int, _Choice]) -> dict[str, int]:
        p = sum(len(ids) for ids in req.prompts)
        g = sum(len(c.token_ids) for c in choices.values())
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    # ------------------------------------------------------------------ chat messages and tool calls
    def _calls(self, req: GenRequest, c: _Choice) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished chat choice, read by control-token id (parse_assistant)."""
        tm = req.tools
        if tm is None or not tm.parse or not hasattr(self.tokenizer, "parse_assistant"):
            return c.text, []
        parsed = self.tokenizer.parse_assistant(req.prefix_ids + c.token_ids)
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": k["name"], "arguments": k["arguments"]},
            }
            for k in parsed["tool_calls"]
        ]
        return (parsed["content"] or None) if calls else parsed["content"], calls

    def _chat_choice(self, req: GenRequest, c: _Choice) -> dict[str, Any]:
        content, calls = self._calls(req, c)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out = {"index": c.index, "message": msg, "logprobs": None, "finish_reason": reason}
        if req.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    # ------------------------------------------------------------------ streaming
    async def _stream(self, req: GenRequest, endpoint: str) -> AsyncIterator[str]:
        rid = uuid.uuid4().hex
        chat = endpoint == "chat"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }
        timer = RequestTimer(self.metrics)
        choices = self._choices(req)
        cached = 0
        outcome = "cancelled"
        calls_begin = self._control("<｜tool▁calls▁begin｜>")
        try:
            if chat:
                for c in choices.values():
                    yield _sse({**head, "choices": [self._first_delta(req, c)]})
            async for i, o in self._outputs(req, rid):
                timer.tokens(sum(len(s.token_ids) for s in o.outputs))
                if o.finished:
                    cached += o.cached_tokens
                for c, text, ended, ids in self._absorb(req, i, o, choices):
                    if chat:
                        chunks = self._chat_deltas(req, c, text, ended, calls_begin)
                        if req.return_token_ids and ids:  # every token reaches the client, text or not
                            if not chunks:
                                chunks = [
                                    {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None}
                                ]
                            chunks[0]["token_ids"] = list(ids)
                        for chunk in chunks:
                            yield _sse({**head, "choices": [chunk]})
                    else:
                        if not c.sent_text and req.echo:
                            text = self._echo(req, c) + text
                            c.sent_text = "echoed"
                        if text or ended or (req.return_token_ids and ids):
                            extra = {"token_ids": list(ids)} if req.return_token_ids else {}
                            yield _sse(
                                {
                                    **head,
                                    "choices": [
                                        {
                                            "index": c.index,
                                            "text": text,
                                            "logprobs": None,
                                            "finish_reason": c.finish_reason if ended else None,
                                            **extra,
                                        }
                                    ],
                                }
                            )
            timer.done()
            usage = self._usage(req, choices)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage})
            outcome = "ok"
            self.metrics.finish(endpoint, "ok", usage["prompt_tokens"], usage["completion_tokens"], cached)
            yield "data: [DONE]\n\n"
        except APIError as e:  # headers are sent: the error is an event (the openai client raises it)
            outcome = "error"
            self.metrics.finish(endpoint, "error")
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            outcome = "error"
            self.metrics.finish(endpoint, "error")
            yield _sse(APIError(f"the engine is not running: {e}", None, 503, "service_unavailable").body())
        finally:
            if outcome == "cancelled":
                self.metrics.finish(endpoint, "cancelled")

    def _control(self, name: str) -> int | None:
        ids = getattr(self.tokenizer, "control_ids", None)
        return None if ids is None else ids.get(name)

    def _first_delta(self, req: GenRequest, c: _Choice) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        if req.tools is not None and req.tools.forced is not None:
            delta = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "index": 0,
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": req.tools.forced["name"], "arguments": ""},
                    }
                ],
            }
        return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _chat_deltas(
        self, req: GenRequest, c: _Choice, text: str, ended: bool, calls_begin: int | None
    ) -> list[dict[str, Any]]:
        """Chunks for one choice's new text: content, or (forced tool call) the arguments; in auto mode the
        text after a tool-calls marker is held and the calls are sent, parsed by id, when the choice ends."""
        tm = req.tools
        forced = tm is not None and tm.forced is not None
        out: list[dict[str, Any]] = []
        if forced:
            if text:
                out.append(
                    {
                        "index": c.index,
                        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": text}}]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        else:
            parse = tm is not None and tm.parse and calls_begin is not None
            if parse and not c.in_calls and calls_begin in c.token_ids:
                c.in_calls = True
            if text and not c.in_calls:
                c.sent_text += text
                out.append(
                    {"index": c.index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                )
        if ended:
            reason = c.finish_reason
            if forced:
                reason = "tool_calls" if reason == "stop" else reason
            elif c.in_calls:
                content, calls = self._calls(req, c)
                rest = (content or "")[len(c.sent_text) :] if (content or "").startswith(c.sent_text) else ""
                delta: dict[str, Any] = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                if rest:
                    delta["content"] = rest
                out.append({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
                reason = "tool_calls" if calls and reason == "stop" else reason
            out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out
