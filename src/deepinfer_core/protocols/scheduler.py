"""Seams of the step planner (``deepinfer_core.scheduler``)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Scheduler(Protocol):
    """Per-step planner: requests in, a plan ``{request_id: num_new_tokens}`` out, results back.

    Contract of one step: ``plan = schedule()``; run the model on it; ``finished = update(plan, result)``.
    In asynchronous mode ``schedule()`` may be called again before the previous plan's ``update``.
    """

    def add_request(self, request: Any) -> None:
        """Queue a request. Invalid requests raise ``ValueError`` naming the field; the queue is unchanged."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request now, whatever its state. Returns False if it is unknown or already ended."""
        ...

    def schedule(self) -> Any:
        """Plan the next step: tokens per request, preempted and finished ids, block tables."""
        ...

    def update(self, plan: Any, result: Any) -> list[Any]:
        """Apply a step's sampled tokens to the requests of ``plan``; return the requests that ended."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        ...


@runtime_checkable
class StepVote(Protocol):
    """How the ranks of one DP group agree on the next step type (a NORMAL engine never mixes them)."""

    def decide(self, want_prefill: bool, want_any_prefill: bool) -> tuple[bool, bool]:
        """Given this rank's wishes, return the group's (all ranks want prefill, any rank wants prefill)."""
        ...
