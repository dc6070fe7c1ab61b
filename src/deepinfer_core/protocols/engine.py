"""Seam of the engine (``deepinfer_core.engine``): requests in, streamed request outputs out, step by step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    """A step-driven generation engine (``engine.LLMEngine``); offline APIs and servers drive it.

    Contract: ``add_request`` never raises for a bad request (it fails alone: its output, with an error
    naming the field, comes out of a later ``step``); ``step`` runs one schedule -> execute -> sample ->
    update round and returns an output for every request that produced tokens or ended in it (as the
    request's ``output_kind`` asks; a request's last output, ``finished`` True, exactly once);
    ``has_unfinished`` is true until every added request's last output has been returned.
    """

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None) -> None:
        """Queue a request (text or token ids, SamplingParams or a dict of its fields)."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a live request; False if it is unknown or already finished."""
        ...

    def step(self) -> list[Any]:
        """One engine step; the ``RequestOutput`` s of the requests that progressed or ended in it."""
        ...

    def has_unfinished(self) -> bool:
        """True while any added request has not been returned by ``step``."""
        ...
