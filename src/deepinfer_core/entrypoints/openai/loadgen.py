"""A load generator for the OpenAI server: many concurrent streaming chat requests, some cancelled.

``run_chats(base_url, bodies, cancel_after)`` sends every body to ``/v1/chat/completions`` with
``stream: true`` and ``return_token_ids: true`` at once (httpx, one connection each) and records, per
request, the token ids in arrival order, the time to the first token and the gaps between tokens (a
chunk of k tokens after a gap g counts k gaps of g / k). A request in ``cancel_after`` is abandoned (the
connection closed) after that many token-carrying chunks. ``benchmarks/serve.py`` and the load test use it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs


@attrs.define
class StreamResult:
    index: int
    token_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    ttft: float | None = None
    gaps: list[float] = attrs.field(factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    error: str | None = None
    chunks: int = 0


async def _one(client: Any, url: str, i: int, body: Mapping[str, Any], cancel: int | None) -> StreamResult:
    res = StreamResult(i)
    t0 = time.monotonic()
    last = None
    payload = {**body, "stream": True, "return_token_ids": True}
    async with client.stream("POST", url, json=payload) as r:
        if r.status_code != 200:
            res.error = (await r.aread()).decode(errors="replace")
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj["error"].get("message")
                break
            for ch in obj.get("choices", []):
                ids = ch.get("token_ids") or []
                res.text += (ch.get("delta") or {}).get("content") or ""
                if ch.get("finish_reason") is not None:
                    res.finish_reason = ch["finish_reason"]
                if ids:
                    now = time.monotonic()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.gaps += [(now - last) / len(ids)] * len(ids)
                    last = now
                    res.token_ids += ids
                    res.chunks += 1
            if cancel is not None and res.chunks >= cancel and res.finish_reason is None:
                res.cancelled = True
                break  # leaving the block closes the connection: the server aborts the request
    return res


async def run_chats_async(
    base_url: str,
    bodies: Sequence[Mapping[str, Any]],
    cancel_after: Mapping[int, int] | None = None,
    timeout: float = 600.0,
) -> list[StreamResult]:
    import httpx

    cancel_after = cancel_after or {}
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        url = base_url.rstrip("/") + "/v1/chat/completions"
        return list(
            await asyncio.gather(
                *[_one(client, url, i, b, cancel_after.get(i)) for i, b in enumerate(bodies)]
            )
        )


def run_chats(
    base_url: str,
    bodies: Sequence[Mapping[str, Any]],
    cancel_after: Mapping[int, int] | None = None,
    timeout: float = 600.0,
) -> list[StreamResult]:
    return asyncio.run(run_chats_async(base_url, bodies, cancel_after, timeout))


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
