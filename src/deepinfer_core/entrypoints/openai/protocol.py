"""OpenAI request bodies -> what the engine runs: validated by hand (no pydantic), so the package imports
without the server extra and every bad field is a 400 naming it, in OpenAI's error shape.

``parse_completion`` / ``parse_chat`` return a ``GenRequest``: the prompts as token ids, one
``SamplingParams`` (its ``n`` samples per prompt), the streaming options and, for chat, the tool-call mode.
Parameters the engine cannot honour (logprobs, penalties, logit_bias, suffix) are refused with a 400
rather than ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from deepinfer_core.sampling_params import SamplingParams


class APIError(Exception):
    """An error response: ``status`` with OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.define
class ToolMode:
    """Chat tools: ``forced`` names the function a call is forced to (its arguments constrained by its
    ``parameters`` schema); otherwise calls are whatever the model emits, parsed by control-token id."""

    tools: list[dict[str, Any]]  # the functions, as encode_chat renders them
    forced: dict[str, Any] | None = None  # {"name", "parameters"}
    parse: bool = True  # tool_choice "none": the output is content only


@attrs.define
class GenRequest:
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    tools: ToolMode | None = None
    prefix_ids: list[int] = attrs.field(factory=list)  # forced tool call: markers + name, after the prompt
    return_token_ids: bool = False  # extension (as vLLM's): each choice also carries its token ids


# SamplingParams fields -> the request field a user wrote (for the 400's "param")
_PARAM_OF = {"so_args": "response_format", "stop": "stop", "stop_token_ids": "stop_token_ids"}
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "suffix": (None, ""),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


def _get(body: Mapping[str, Any], key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(f"{key}: {v!r} is a bool; expected {_names(types)}", key)
    if not isinstance(v, types):
        raise APIError(f"{key}: expected {_names(types)}, got {type(v).__name__}", key)
    return v


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _common(body: Any, served: str) -> dict[str, Any]:
    """The sampling fields shared by both endpoints, checked; the SamplingParams keyword arguments."""
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object", None)
    model = _get(body, "model", str)
    if model is None:
        raise APIError("model: required", "model")
    if model != served:
        raise APIError(
            f"model: the model {model!r} does not exist (this server serves {served!r})",
            "model",
            status=404,
            code="model_not_found",
        )
    for key, allowed in _UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            raise APIError(f"{key}: not supported by this server (it must be omitted or null)", key)
    kw: dict[str, Any] = {}
    num = (int, float)
    for key, field, types in (
        ("temperature", "temperature", num),
        ("top_p", "top_p", num),
        ("top_k", "top_k", int),
        ("seed", "seed", int),
        ("n", "n", int),
        ("min_tokens", "min_tokens", int),
        ("ignore_eos", "ignore_eos", bool),
        ("best_of", "best_of", int),
        ("include_stop_str_in_output", "include_stop_str_in_output", bool),
    ):
        v = _get(body, key, types)
        if v is not None:
            kw[field] = v
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise APIError("stop: must be a string or a list of at most 16 strings", "stop")
        kw["stop"] = [s for s in stop if s] or None
        if kw["stop"] is None:
            del kw["stop"]
    ids = body.get("stop_token_ids")
    if ids is not None:
        kw["stop_token_ids"] = ids
    so = _structured(body)
    if so is not None:
        kw["so_args"] = so
    so_opts = body.get("stream_options")
    if so_opts is not None and (not isinstance(so_opts, Mapping) or not body.get("stream")):
        raise APIError("stream_options: only allowed with stream=true, as an object", "stream_options")
    return {"model": model, **kw}


def _structured(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """response_format (json_schema, json_object, text) and the regex / choice extensions -> so_args."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
            raise APIError("response_format: must be an object with a 'type'", "response_format")
        t = rf["type"]
        if t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, Mapping) or not isinstance(js.get("schema", {}), Mapping | bool):
                raise APIError(
                    "response_format.json_schema: must be an object with a 'schema' object", "response_format"
                )
            found.append(("response_format", {"json_schema": dict(js.get("schema", {}))}))
        elif t == "json_object":
            found.append(("response_format", {"json_schema": {"type": "object"}}))
        elif t != "text":
            raise APIError(
                f"response_format.type: {t!r} must be one of 'text', 'json_object', 'json_schema'",
                "response_format",
            )
    for key, kind in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("choice", "choice"),
        ("guided_choice", "choice"),
        ("guided_json", "json_schema"),
        ("guided_grammar", "ebnf"),
    ):
        v = body.get(key)
        if v is None:
            continue
        if kind == "choice" and not (isinstance(v, list) and v and all(isinstance(c, str) for c in v)):
            raise APIError(f"{key}: must be a non-empty list of strings", key)
        if kind in ("regex", "ebnf") and not isinstance(v, str):
            raise APIError(f"{key}: must be a string", key)
        if kind == "json_schema":
            v = json.loads(v) if isinstance(v, str) else v
        found.append((key, {kind: v}))
    if len(found) > 1:
        raise APIError(
            f"{found[1][0]}: only one output constraint per request (also given: {found[0][0]})", found[1][0]
        )
    return found[0][1] if found else None


def sampling_params(kw: dict[str, Any], max_tokens: Any, field: str) -> SamplingParams:
    kw = dict(kw)
    kw.pop("model", None)
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    if "temperature" in kw and kw["temperature"] == 0:  # greedy; a seed is irrelevant then
        kw["temperature"] = 0.0
    try:
        return SamplingParams(**kw, output_kind="delta")
    except ValueError as e:
        msg = str(e)
        name = msg.split(":", 1)[0].removeprefix("SamplingParams.").split("[", 1)[0]
        param = field if name == "max_tokens" else _PARAM_OF.get(name, name)
        raise APIError(
            msg.replace("SamplingParams.max_tokens", field).replace("SamplingParams.", ""), param
        ) from None
    except TypeError as e:
        raise APIError(str(e), None) from None


def _token_list(v: Any) -> bool:
    return (
        isinstance(v, list) and len(v) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    )


def parse_completion(body: Any, served: str, tokenizer: Any) -> GenRequest:
    kw = _common(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif _token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(
            "prompt: must be a string, a list of strings, a list of token ids or a list of such lists",
            "prompt",
        )
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise APIError(f"prompt[{i}]: must not be empty", "prompt")
            ids.append(list(tokenizer.encode(p)))
            texts.append(p)
        else:
            bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise APIError(
                    f"prompt[{i}]: token id {bad[0]} is outside [0, {tokenizer.vocab_size})", "prompt"
                )
            ids.append(list(p))
            texts.append(None)
    max_tokens = _get(body, "max_tokens", int, 16)  # OpenAI's default for completions
    sp = sampling_params(kw, max_tokens, "max_tokens")
    return GenRequest(
        kw["model"],
        ids,
        texts,
        sp,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=_include_usage(body),
        echo=bool(_get(body, "echo", bool, False)),
    )


def _include_usage(body: Mapping[str, Any]) -> bool:
    so = body.get("stream_options") or {}
    v = so.get("include_usage", False)
    if not isinstance(v, bool):
        raise APIError("stream_options.include_usage: must be a bool", "stream_options")
    return v


def parse_chat(body: Any, served: str, tokenizer: Any) -> GenRequest:
    kw = _common(body, served)
    if not hasattr(tokenizer, "encode_chat"):
        raise APIError(
            "messages: this model's tokenizer has no chat encoding; use /v1/completions", "messages"
        )
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("messages: must be a non-empty list of message objects", "messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    tools = _tools(body)
    if tools is not None and tools.forced is not None and "so_args" in kw:
        raise APIError("response_format: cannot be combined with a forced tool_choice", "response_format")
    from deepinfer_core.tokenizer import ChatError

    try:
        ids = tokenizer.encode_chat(messages, tools=tools.tools if tools else None)
    except ChatError as e:
        raise APIError(str(e), "messages") from None
    prefix: list[int] = []
    if (
        tools is not None and tools.forced is not None
    ):  # the call's markers and name by id, then its arguments
        c = tokenizer.control_ids
        from deepinfer_core.tokenizer import CALL_BEGIN, CALLS_BEGIN, TOOL_SEP

        prefix = [c[CALLS_BEGIN], c[CALL_BEGIN], *tokenizer.encode(tools.forced["name"]), c[TOOL_SEP]]
        kw["so_args"] = {"json_schema": tools.forced.get("parameters") or {"type": "object"}}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise APIError(f"{field}: expected int, got {type(max_tokens).__name__}", field)
    sp = sampling_params(kw, max_tokens, field)
    return GenRequest(
        kw["model"],
        [ids + prefix],
        [None],
        sp,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=_include_usage(body),
        tools=tools,
        prefix_ids=prefix,
    )


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise APIError(f"messages[{i}]: must be an object", "messages")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise APIError(
            f"messages[{i}].role: {role!r} must be one of system, developer, user, assistant, tool",
            "messages",
        )
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(f"messages[{i}].content[{j}]: only text parts are supported", "messages")
            parts.append(p["text"])
        content = "".join(parts)
    if content is None and not (role == "assistant"):
        raise APIError(f"messages[{i}].content: required for role {role!r}", "messages")
    if content is not None and not isinstance(content, str):
        raise APIError(f"messages[{i}].content: must be a string or a list of text parts", "messages")
    out: dict[str, Any] = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise APIError(
                f"messages[{i}].tool_calls: only an assistant message has a tool_calls list", "messages"
            )
        conv = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                raise APIError(f"messages[{i}].tool_calls[{j}].function: needs a 'name' string", "messages")
            args = f.get("arguments", "")
            conv.append({"name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)})
        out["tool_calls"] = conv
    return out


def _tools(body: Mapping[str, Any]) -> ToolMode | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError("tool_choice: needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError('tools: must be a non-empty list of {"type": "function", "function": {...}}', "tools")
    funcs = []
    for j, t in enumerate(tools):
        f = t.get("function") if isinstance(t, Mapping) and t.get("type") == "function" else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(
                f'tools[{j}]: must be {{"type": "function", "function": {{"name": ...}}}}', "tools"
            )
        if f.get("parameters") is not None and not isinstance(f["parameters"], Mapping):
            raise APIError(f"tools[{j}].function.parameters: must be a JSON schema object", "tools")
        funcs.append(dict(f))
    by_name = {f["name"]: f for f in funcs}
    if choice in (None, "auto"):
        return ToolMode(funcs)
    if choice == "none":
        return ToolMode(funcs, parse=False)
    if choice == "required":
        if len(funcs) != 1:
            raise APIError(
                "tool_choice: 'required' is supported with exactly one tool; name the function instead",
                "tool_choice",
            )
        return ToolMode(funcs, forced=funcs[0])
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if not isinstance(name, str) or name not in by_name:
        raise APIError(
            f"tool_choice: must be 'none', 'auto', 'required' or a function of tools, got {choice!r}",
            "tool_choice",
        )
    return ToolMode(funcs, forced=by_name[name])


def check_lengths(req: GenRequest, max_model_len: int, field: str) -> None:
    """Prompts are never truncated: too long a prompt, or prompt + max_tokens past the context, is a 400."""
    for ids in req.prompts:
        if len(ids) >= max_model_len:
            raise APIError(
                f"{field}: {len(ids)} prompt tokens; this model's context is {max_model_len} tokens", field
            )
        mt = req.params.max_tokens
        if mt is not None and len(ids) + mt > max_model_len:
            raise APIError(
                f"max_tokens: {mt} + {len(ids)} prompt tokens exceeds the context of {max_model_len} tokens",
                "max_tokens",
            )
