"""``deepinfer serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn, the ``serve`` extra).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives Server-Sent
Events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). FastAPI and uvicorn are
imported when an app is built, so ``deepinfer_core.entrypoints.openai`` imports without them.

A client that disconnects frees its request: a stream's iterator is closed by the ASGI server (which
aborts the engine request), and a non-streaming request is cancelled once ``is_disconnected`` says so.
An exception in a handler is a 500 for that request only; the engine loop runs on its own thread.
"""

# no "from __future__ import annotations": FastAPI reads the handlers' annotations (Request) at runtime

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from deepinfer_core.engine.async_llm import AsyncLLM
from deepinfer_core.entrypoints.openai.metrics import ServerMetrics
from deepinfer_core.entrypoints.openai.protocol import APIError
from deepinfer_core.entrypoints.openai.serving import OpenAIServing
from deepinfer_core.extras import require

log = logging.getLogger(__name__)


def build_app(llm: AsyncLLM, served_model_name: str, *, shutdown_engine: bool = True) -> Any:
    """The FastAPI app serving ``llm`` as ``served_model_name``; it shuts the engine down with the app
    (unless ``shutdown_engine`` is False)."""
    require("fastapi", "the OpenAI server (deepinfer serve)")
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    serving = OpenAIServing(llm, served_model_name, ServerMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.serving = serving

    def error(e: APIError) -> Any:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        return error(APIError(str(exc), None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Any:  # a bug in a handler: this request only
        log.exception("server: request failed")
        return error(
            APIError(f"internal error: {type(exc).__name__}: {exc}", None, 500, "internal_server_error")
        )

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", None) from None

    async def run(request: Request, fn: Any) -> Any:
        try:
            body = await body_of(request)
            work = asyncio.ensure_future(fn(body))
            while not work.done():  # a non-streaming client that leaves cancels its request
                done, _ = await asyncio.wait({work}, timeout=0.25)
                if not done and await request.is_disconnected():
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await work
                    return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
            res = work.result()
        except APIError as e:
            return error(e)
        if isinstance(res, dict):
            return JSONResponse(res)
        return StreamingResponse(
            res,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await run(request, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await run(request, serving.chat)

    @app.get("/v1/models")
    async def models() -> Any:
        return JSONResponse(serving.models())

    @app.get("/health")
    async def health() -> Any:
        ok = llm.is_running
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(
            serving.metrics.render(llm.engine, llm), media_type="text/plain; version=0.0.4"
        )

    return app


def serve(
    model: str = "tiny",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    num_threads: int | None = 1,
    **engine_kwargs: Any,
) -> None:
    """Build the engine and serve it until interrupted (uvicorn)."""
    require("uvicorn", "the OpenAI server (deepinfer serve)")
    import uvicorn

    llm = AsyncLLM(model, num_threads=num_threads, **engine_kwargs)
    app = build_app(llm, served_model_name or model)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


# ---------------------------------------------------------------------------------------- the CLI
def add_serve_parser(sub: Any) -> None:
    """``deepinfer serve`` (cli.py adds it to its subcommands)."""
    s = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--model", default="tiny", help="built-in model name or a checkpoint directory (default: tiny)"
    )
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed derive theirs)")
    s.add_argument("--num-blocks", type=int, default=1024)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=32)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-batched-tokens", type=int, default=4096)
    s.add_argument("--backend", default="reference", choices=["reference", "cuda"])
    s.add_argument(
        "--batch-invariant", action="store_true", help="each request's tokens independent of its batch"
    )
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=_serve_cmd, parser=s)


def _serve_cmd(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO))
    serve(
        args.model,
        args.host,
        args.port,
        args.served_model_name,
        args.log_level,
        args.threads,
        seed=args.seed,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        backend=args.backend,
        batch_invariant=True if args.batch_invariant else None,
    )
    return 0
