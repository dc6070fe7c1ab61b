"""Seams of the step planner (``deepinfer_core.scheduler``)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Scheduler(Protocol):
    """Per-step planner: requests in, a plan ``{request_id: num_new_tokens}`` out, results back.

    Contract of one step: ``plan = schedule()``; run the model on it; ``ended = update(plan, result)``.
    In asynchronous mode ``schedule()`` may be called again before the previous plan's ``update``
    (one step ahead); updates always follow schedule order.
    """

    def add_request(self, request: Any) -> None:
        """Queue a request. Invalid requests raise ``ValueError`` naming the field; the queue is unchanged."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request now, whatever its state. Returns False if it is unknown or already ended."""
        ...

    def step_wish(self) -> tuple[bool, bool]:
        """This rank's preference for the DP vote: (has prefill work it can start now, has decode work)."""
        ...

    def schedule(self, group: tuple[bool, bool, bool] | None = None) -> Any:
        """Plan the next step: tokens per request, preempted ids, block tables.

        ``group`` is what the DP group decided from every rank's ``step_wish``: (all ranks have
        prefill work, any rank has prefill work, any rank has decode work); ``None`` votes alone.
        Speculative decoding is an optional extension of this call: the built-in scheduler also takes
        ``draft_seq_ids`` / ``draft_counts`` (or ``num_draft_tokens={request_id: k}``) and plans verify
        rows of ``1 + k`` tokens, whose ``update`` takes 1..1 + k tokens (docs/scheduler.md).
        """
        ...

    def update(self, plan: Any, result: Any) -> list[Any]:
        """Apply a step's sampled tokens to the requests of ``plan``; return every request that ended
        since the previous ``update`` (finished, aborted or failed), each exactly once."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running, or a plan or an ended request awaits ``update``."""
        ...


@runtime_checkable
class StepVote(Protocol):
    """How the ranks of one DP group agree on the next step type (a NORMAL engine never mixes them)."""

    def decide(self, has_prefill: bool, has_decode: bool) -> tuple[bool, bool, bool]:
        """Given this rank's wishes, return the group's (all ranks have prefill work, any rank has
        prefill work, any rank has decode work). Every rank of the group must call it each step."""
        ...
