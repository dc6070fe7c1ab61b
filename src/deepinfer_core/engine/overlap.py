"""The engine's asynchronous overlap: step N+1 is launched before the host reads step N's tokens.

With ``async_scheduling`` the scheduler already plans step N+1 before step N's tokens are applied. The
overlap (``EngineConfig.async_overlap``, on by default) also keeps the device busy meanwhile, as vLLM v1's
async scheduling does: step N's sampled tokens stay a device tensor (``DeviceTokens``: a non-blocking copy
into pinned memory with an event behind it), step N+1's placeholder inputs are written from it on the device
(``TokenFeed``), and only after step N+1 is queued does the host wait for step N's event, run the
token-side bookkeeping (last token, stop strings) and ``Scheduler.update`` it. One call of ``step``
(``OverlapOrder`` in engine/step_order.py):

    schedule(N+1) -> build + launch N+1 (inputs fed from N on the device) -> wait N -> land N -> update(N)

A step with a structured row overlaps too: its forward is launched behind step N, then step N lands
(``StepOrder.land_early``: the grammars take step N's tokens on the host while the device runs the
forward), then the step's grammar masks are filled and applied and it samples on the device; its own
grammars take its tokens when it lands. A step runs synchronously (the previous step lands first, its
tokens fill the placeholders on the host, as in the plain async mode) only when the executor cannot take
device tokens (Engram tables on the host or sharded: the row ids are hashed from host tokens; logged once
at start). Stats: ``StepStats.overlap_steps`` / ``host_wait_steps``. Rows launched for a request that ended
when the previous step landed (a stop, EOS, length, an abort, a failed row) run but their tokens are
dropped when they land (``StepRunner.land``: the request is dead or gone by then), so nothing is reported twice or lost; the scheduler
ignores rows of ended requests, as it does in the plain async mode. docs/engine.md ("Asynchronous overlap").
"""

from __future__ import annotations

import logging

import attrs
import numpy as np

from deepinfer_core.device_tokens import DeviceTokens, TokenFeed
from deepinfer_core.scheduler import FinishedRequest, Plan, Scheduler

log = logging.getLogger(__name__)


@attrs.define
class StepTokens:
    """One step's tokens on the host, as ``Scheduler.update`` takes them: one per plan row (0 for rows that
    sample nothing or were dropped), or with speculation flat tokens and a count per row (a verify row
    yields its accepted drafts and the executor's next token)."""

    tokens: np.ndarray  # int32
    counts: np.ndarray | None = None  # int32 per plan row, with drafts

    def update(self, scheduler: Scheduler, plan: Plan) -> list[FinishedRequest]:
        if self.counts is None:
            return scheduler.update(plan, self.tokens)
        return scheduler.update(plan, self.tokens, self.counts)


@attrs.define
class PendingStep:
    """A launched step whose tokens are still on the device: ``tokens`` row j is plan row ``rows[j]``
    (sequence ``seqs[j]``); the plan's other rows sample nothing (or were dropped)."""

    rows: np.ndarray  # int64 plan rows that sampled
    seqs: np.ndarray  # int64 their seq ids
    tokens: DeviceTokens
    num_rows: int
    # bool per row of ``tokens``: the sampler ended its request on this token (a grammar dead end or a
    # grammar failure: token -1, ``EndHow.BY_TOKEN``), so it lands although the request is dead by then
    ended_by_token: np.ndarray = attrs.field(
        default=attrs.Factory(lambda self: np.zeros(self.rows.shape, bool), takes_self=True)
    )

    def feed_rows(self, hole_seqs: np.ndarray) -> np.ndarray:
        """Row of ``tokens`` for each sequence in ``hole_seqs`` (-1 where this step sampled none for it)."""
        if self.seqs.size == 0:
            return np.full(hole_seqs.shape, -1, np.int64)
        order = np.argsort(self.seqs, kind="stable")
        srt = self.seqs[order]
        i = np.searchsorted(srt, hole_seqs).clip(max=srt.size - 1)
        return np.where(srt[i] == hole_seqs, order[i], -1)


@attrs.define
class Launched:
    """A step that ran: its plan and its tokens, on the host (``tokens``) or still on the device
    (``pending``, with the overlap); ``StepRunner.land`` turns the second into the first."""

    plan: Plan
    tokens: StepTokens | None = None
    pending: PendingStep | None = None


def fill_holes(
    tokens: np.ndarray,
    seq_ids: np.ndarray,
    ix: np.ndarray,
    ntok: np.ndarray,
    last_token: np.ndarray,
    prev: PendingStep | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Fill the plan's placeholders (token < 0) in place: from each sequence's last token known on the
    host (``last_token``, per ``ix``), except those the in-flight step ``prev`` sampled, which get a valid
    placeholder (0) here and their value on the device. Returns (flat token positions fed from ``prev``,
    their ``prev`` rows)."""
    hole = np.flatnonzero(tokens < 0)
    none = np.zeros(0, np.int64)
    if hole.size == 0:
        return none, none
    row = np.repeat(np.arange(ntok.shape[0]), ntok)[hole]
    src = prev.feed_rows(seq_ids[row]) if prev is not None else np.full(hole.shape, -1, np.int64)
    fed = src >= 0
    tokens[hole] = np.where(fed, 0, last_token[ix[row]])
    return hole[fed].astype(np.int64), src[fed].astype(np.int64)


def batch_feed(
    fed_pos: np.ndarray, fed_src: np.ndarray, tok_keep: np.ndarray, prev: PendingStep | None
) -> TokenFeed | None:
    """The feed of one batch: the fed plan tokens that the batch keeps, at their batch positions."""
    if prev is None or fed_pos.size == 0:
        return None
    k = tok_keep[fed_pos]
    at = np.cumsum(tok_keep) - 1  # plan token -> batch token
    return TokenFeed(at[fed_pos[k]].astype(np.int64), fed_src[k], prev.tokens)
