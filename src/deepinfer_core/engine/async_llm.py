"""``AsyncLLM``: the engine behind asyncio, ``async for out in llm.generate(prompt, params)``.

One engine loop thread owns ``LLMEngine.step`` (the engine's threading contract, docs/engine.md): it
drains an inbox of adds and aborts before each step, steps while anything is live, and sleeps on an event
otherwise. asyncio code never takes the engine's lock, so an event loop is never blocked by a step.

- **Streams.** Each ``generate`` call owns a ``_Stream`` living on its event loop. After a step the engine
  thread hands each loop its outputs in one ``loop.call_soon_threadsafe`` call.
- **Backpressure without stalls.** The engine thread never waits for a consumer. A consumer that lags
  finds its outputs merged into one pending output: DELTA outputs are concatenated (text, token ids,
  per sample), a CUMULATIVE or final output replaces the older one (it contains it). Nothing is
  dropped, and memory stays bounded by the request's own output.
- **Cancellation.** A consumer that stops iterating (task cancelled, ``aclose``, a client that
  disconnected, ``break``) aborts its request: the engine returns its KV blocks and state slot at once.
- **Errors.** A request that fails ends its own stream with a ``RequestOutput`` whose ``error`` says why
  (``finished`` True); other streams carry on. Should the loop thread itself fail, every stream raises
  ``EngineDeadError`` and later calls raise it too.
- ``abort(request_id)``; ``shutdown()`` aborts everything, steps the engine until every block and slot is
  back, and stops the thread (streams still open end with ``EngineDeadError``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import RequestOutputKind

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (``shutdown``, or a failure outside any request); nothing more is served."""


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output standing for ``old`` then ``new`` of the same request (a consumer that lagged)."""
    if new.output_kind != RequestOutputKind.DELTA:
        return new  # cumulative (or final-only): the newer one contains the older
    samples = new.samples
    if old.samples or new.samples:
        by: dict[int, CompletionOutput] = {s.index: s for s in old.samples}
        for s in new.samples:
            o = by.get(s.index)
            by[s.index] = (
                s if o is None else attrs.evolve(s, text=o.text + s.text, token_ids=o.token_ids + s.token_ids)
            )
        samples = tuple(by[i] for i in sorted(by))
        first = samples[0]
        return attrs.evolve(new, text=first.text, token_ids=first.token_ids, samples=samples)
    return attrs.evolve(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids)


class _Stream:
    """One request's outputs on its consumer's event loop (methods run on that loop)."""

    __slots__ = ("error", "finished", "loop", "pending", "rid", "waiter")

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self.loop = loop
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.waiter: asyncio.Future[None] | None = None

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else merge_outputs(self.pending, out)
        self._wake()

    def fail(self, e: BaseException) -> None:
        self.error = e
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            await self.waiter
        out, self.pending = self.pending, None
        return out


class AsyncLLM:
    """The engine behind asyncio (module docstring).

    ``AsyncLLM(model="tiny", **EngineConfig fields)`` builds an ``LLMEngine`` (``num_threads`` as
    ``LLMEngine``); ``AsyncLLM.from_engine(engine)`` serves a prebuilt one (this object then owns its
    ``step``: nothing else may call it)."""

    def __init__(
        self, model: str = "tiny", *, num_threads: int | None = 1, envs: Envs | None = None, **kwargs: Any
    ) -> None:
        self._setup(LLMEngine(EngineConfig(model=model, **kwargs), envs=envs, num_threads=num_threads))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup(engine)
        return self

    def _setup(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()  # guards _streams and the dead / stopping flags
        self._wake = threading.Event()
        self._dead: BaseException | None = None
        self._stopping = False
        self.steps = 0
        self.step_time_s = 0.0  # wall time inside engine.step (the server's overhead is measured against it)
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the front end (any event loop)
    async def generate(
        self,
        prompt: str | Sequence[int] | Any,
        params: Any = None,
        *,
        request_id: str | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (its ``output_kind``; the last has ``finished``).
        A bad request yields one output with ``error`` naming the field. Leaving the loop early (break,
        cancellation, ``aclose``) aborts the request and frees what it held."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id: must be a non-empty str, got {rid!r}")
        stream = _Stream(rid, asyncio.get_running_loop())
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError("the engine is shut down") from self._dead
            if rid in self._streams:
                raise ValueError(f"request_id={rid!r}: already live")
            self._streams[rid] = stream
        self._post(("add", rid, prompt, params, output_kind))
        try:
            while True:
                out = await stream.get()
                if out.finished:
                    stream.finished = True
                yield out
                if stream.finished:
                    return
        finally:
            with self._lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if not stream.finished and stream.error is None:
                self._post(("abort", rid))  # the consumer went away: free the request

    def abort(self, request_id: str) -> None:
        """End a live request (its stream ends with finish_reason "abort"); unknown ids are ignored."""
        self._post(("abort", request_id))

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, step until the engine has returned every block and slot, stop the loop.
        Idempotent; streams still open end with ``EngineDeadError``."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("AsyncLLM.shutdown: the engine loop did not stop within %.0f s", timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def _post(self, item: tuple[Any, ...]) -> None:
        self._inbox.append(item)
        self._wake.set()

    # ------------------------------------------------------------------ the engine loop thread
    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                self._wake.clear()
                self._drain()
                if self._stopping:
                    self._finish_shutdown()
                    return
                if not eng.has_unfinished():
                    self._wake.wait(1.0)
                    continue
                t0 = time.perf_counter()
                outs = eng.step()
                self.step_time_s += time.perf_counter() - t0
                self.steps += 1
                self._dispatch(outs)
        except BaseException as e:  # a bug outside any request: every stream learns it, nothing hangs
            log.exception("AsyncLLM: the engine loop failed")
            self._die(EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}"))
            try:
                eng.reset("the engine loop failed")
            except Exception:
                log.exception("AsyncLLM: reset after the loop failure failed")

    def _drain(self) -> None:
        eng = self.engine
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "abort":
                eng.abort(item[1])
                continue
            _, rid, prompt, params, kind = item
            with self._lock:
                stream = self._streams.get(rid)
            if stream is None:
                continue  # its consumer left before the request reached the engine
            try:
                eng.add_request(rid, prompt, params, output_kind=kind)
            except Exception as e:  # the caller's bookkeeping error (add_request raises for nothing else)
                stream.loop.call_soon_threadsafe(stream.fail, e)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        if not outs:
            return
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for o in outs:
                s = self._streams.get(o.request_id)
                if s is not None:  # else: its consumer left (the abort is on its way or done)
                    per_loop.setdefault(s.loop, []).append((s, o))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its consumers are gone
                for s, _ in items:
                    self._post(("abort", s.rid))

    def _finish_shutdown(self) -> None:
        eng = self.engine
        eng.abort_all()
        for _ in range(10_000):
            if not eng.has_unfinished():
                break
            self._dispatch(eng.step())
        self._die(EngineDeadError("the engine is shut down"))

    def _die(self, e: EngineDeadError) -> None:
        with self._lock:
            self._dead = e
            streams = list(self._streams.values())
        for s in streams:
            with contextlib.suppress(RuntimeError):
                s.loop.call_soon_threadsafe(s.fail, e)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for s, o in items:
        s.put(o)
