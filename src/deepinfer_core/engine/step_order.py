"""When a step's tokens are applied relative to the next step's launch: the engine's step order, chosen
once at construction (``make_step_order``).

- ``SyncOrder`` (``async_scheduling=False``, and always with drafts): each step's tokens are applied right
  after it ran.
- ``AsyncOrder`` (``async_scheduling``, overlap off): step N+1 is planned before step N's tokens are
  applied; they are applied before N+1 is built (its placeholders are filled from them on the host).
- ``OverlapOrder`` (``async_overlap``, the default): step N+1 is also launched before step N's tokens are
  read, its placeholders fed from them on the device (engine/overlap.py); a step with a structured row
  launches its forward the same way and lands step N before it samples (``land_early``: the grammar
  masks need step N's tokens on the host; the device is busy with step N+1's forward meanwhile). Only an
  executor that takes no device feed waits for step N's tokens first, as ``AsyncOrder``.

The engine's step calls, in order: ``land_before(plan)`` (steps whose tokens it must apply before ``plan``
is built), ``feed(plan)`` (the in-flight step to feed from and whether to leave this step's tokens on the
device), ``StepRunner.run`` (which may call ``land_early`` between its forward and its sampling) and
``land_after(step)`` (steps whose tokens it applies now). Every step handed back is landed
(``StepRunner.land``: tokens on the host).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from deepinfer_core.engine.overlap import Launched, PendingStep
from deepinfer_core.engine.run import StepRunner
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stats import StepStats
from deepinfer_core.protocols import ModelExecutor
from deepinfer_core.scheduler import Plan

log = logging.getLogger(__name__)


class StepOrder(Protocol):
    """The order of launching a step and applying its tokens (see the module docstring)."""

    name: str
    stats: StepStats

    def land_before(self, plan: Plan) -> list[Launched]:
        """Landed steps whose tokens are applied before ``plan`` is built."""
        ...

    def feed(self, plan: Plan) -> tuple[PendingStep | None, bool]:
        """(the in-flight step whose device tokens feed ``plan``'s placeholders, whether ``plan``'s own
        tokens stay on the device)."""
        ...

    def land_early(self) -> None:
        """Land the in-flight step the current one was launched behind, now (before the current step
        samples: its grammar masks need those tokens); ``land_after`` hands it back. A no-op when none."""
        ...

    def land_after(self, step: Launched) -> list[Launched]:
        """``step`` just ran: the landed steps whose tokens are applied now, in order."""
        ...


class SyncOrder:
    """Each step's tokens are applied right after it runs."""

    name = "sync"

    def __init__(self, runner: StepRunner, stats: StepStats) -> None:
        self.runner = runner
        self.stats = stats

    def land_before(self, plan: Plan) -> list[Launched]:
        return []

    def feed(self, plan: Plan) -> tuple[PendingStep | None, bool]:
        return None, False

    def land_early(self) -> None:
        return None

    def land_after(self, step: Launched) -> list[Launched]:
        return [self.runner.land(step)]


class AsyncOrder:
    """One step ahead: a step's tokens are applied after the next step is planned, before it is built."""

    name = "async"

    def __init__(self, runner: StepRunner, stats: StepStats) -> None:
        self.runner = runner
        self.stats = stats
        self.inflight: Launched | None = None

    def land_before(self, plan: Plan) -> list[Launched]:
        prev, self.inflight = self.inflight, None
        return [] if prev is None else [self.runner.land(prev)]

    def feed(self, plan: Plan) -> tuple[PendingStep | None, bool]:
        return None, False

    def land_early(self) -> None:
        return None

    def land_after(self, step: Launched) -> list[Launched]:
        self.inflight = step
        return []


class OverlapOrder:
    """One step ahead, launched before the previous step's tokens are read (engine/overlap.py)."""

    name = "overlap"

    def __init__(self, runner: StepRunner, stats: StepStats) -> None:
        self.runner = runner
        self.stats = stats
        self.inflight: Launched | None = None
        self._prev: Launched | None = None  # the in-flight step the current one is launched behind
        self._early: Launched | None = None  # ``_prev`` landed by ``land_early`` during the current step
        self._overlap = False  # the current step launches before ``_prev`` lands

    def land_before(self, plan: Plan) -> list[Launched]:
        r = self.runner
        # this step launches before the in-flight one lands unless the executor cannot take device tokens
        # (a structured row launches too: the runner lands the in-flight step before it samples)
        self._overlap = plan.num_rows > 0 and r.takes_feed()
        prev, self.inflight, self._prev, self._early = self.inflight, None, None, None
        if prev is None:
            return []
        if self._overlap and prev.pending is not None:
            self._prev = prev
            return []
        if plan.num_rows and prev.pending is not None:
            self.stats.host_wait_steps += 1
        return [r.land(prev)]

    def feed(self, plan: Plan) -> tuple[PendingStep | None, bool]:
        return (self._prev.pending if self._prev is not None else None), self._overlap

    def land_early(self) -> None:
        if self._prev is None or self._early is not None:
            return
        self._early = self._land_prev()

    def land_after(self, step: Launched) -> list[Launched]:
        self.inflight = step
        if self._prev is None:
            return []
        if step.pending is not None:
            self.stats.overlap_steps += 1
        # this step is queued behind the previous one: now read that one's tokens (unless the step did)
        done = self._early if self._early is not None else self._land_prev()
        self._prev, self._early = None, None
        return [done]

    def _land_prev(self) -> Launched:
        assert self._prev is not None
        t0 = time.perf_counter()
        done = self.runner.land(self._prev)
        self.stats.land_wait_s += time.perf_counter() - t0
        return done


def choose_mode(
    async_scheduling: bool, async_overlap: bool, drafts: DraftBook | None, executor: ModelExecutor
) -> str:
    """sync (no async scheduling: always with drafts), async, or overlap (engine/overlap.py): on with
    async scheduling unless the executor must read every step's tokens on the host before the next."""
    if drafts is not None:
        log.info(
            "engine: speculative decoding, up to %d drafts per request (%s), synchronous scheduling",
            drafts.max_drafts,
            type(drafts.policy).__name__,
        )
    # a verify row's next position depends on how many drafts are accepted, so with drafts the
    # engine plans each step after the previous one's tokens are applied (see docs/engine.md)
    if not async_scheduling or drafts is not None:
        return "sync"
    if async_overlap and not executor.token_feed_ok:
        log.info(
            "engine: async overlap off: the executor hashes Engram n-grams from host tokens (tables "
            "placed %r); every step waits for the previous step's tokens",
            executor.engram_placement,
        )
        return "async"
    return "overlap" if async_overlap else "async"


def make_step_order(mode: str, runner: StepRunner, stats: StepStats) -> StepOrder:
    """The order for ``mode`` ("sync", "async" or "overlap")."""
    if mode == "sync":
        return SyncOrder(runner, stats)
    if mode == "async":
        return AsyncOrder(runner, stats)
    if mode == "overlap":
        return OverlapOrder(runner, stats)
    raise ValueError(f"step order: {mode!r}: must be 'sync', 'async' or 'overlap'")
