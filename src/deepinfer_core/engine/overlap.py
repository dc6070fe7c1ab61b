"""The engine's asynchronous overlap: step N+1 is launched before the host reads step N's tokens.

With ``async_scheduling`` the scheduler already plans step N+1 before step N's tokens are applied. The
overlap (``EngineConfig.async_overlap``, on by default) also keeps the device busy meanwhile, as vLLM v1's
async scheduling does: step N's sampled tokens stay a device tensor (``DeviceTokens``: a non-blocking copy
into pinned memory with an event behind it), step N+1's placeholder inputs are written from it on the device
(``TokenFeed``), and only after step N+1 is queued does the host wait for step N's event, run the
token-side bookkeeping (last token, stop strings) and ``Scheduler.update`` it. One call of ``step``:

    schedule(N+1) -> build + launch N+1 (inputs fed from N on the device) -> wait N -> land N -> update(N)

A step runs synchronously (the previous step lands first, its tokens fill the placeholders on the host, as
in the plain async mode) when it needs a host token value before it can be launched: a structured request
has a row in it (its grammar mask depends on the previous token), or the executor cannot take device
tokens (Engram tables on the host or sharded: the row ids are hashed from host tokens; logged once at
start). Stats: ``StepStats.overlap_steps`` / ``host_wait_steps``. Rows launched for a request that ended
when the previous step landed (a stop, EOS, length, an abort, a failed row) run but their tokens are
dropped here (the request is dead or gone by then), so nothing is reported twice or lost; the scheduler
ignores rows of ended requests, as it does in the plain async mode. docs/engine.md ("Asynchronous overlap").
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from deepinfer_core.device_tokens import DeviceTokens, TokenFeed
from deepinfer_core.scheduler import Plan

log = logging.getLogger("deepinfer_core.engine.engine")


@attrs.define
class PendingStep:
    """A launched step whose tokens are still on the device: ``tokens`` row j is plan row ``rows[j]``
    (sequence ``seqs[j]``); the plan's other rows sample nothing (or were dropped)."""

    rows: np.ndarray  # int64 plan rows that sampled
    seqs: np.ndarray  # int64 their seq ids
    tokens: DeviceTokens
    num_rows: int

    def feed_rows(self, hole_seqs: np.ndarray) -> np.ndarray:
        """Row of ``tokens`` for each sequence in ``hole_seqs`` (-1 where this step sampled none for it)."""
        if self.seqs.size == 0:
            return np.full(hole_seqs.shape, -1, np.int64)
        order = np.argsort(self.seqs, kind="stable")
        srt = self.seqs[order]
        i = np.searchsorted(srt, hole_seqs).clip(max=srt.size - 1)
        return np.where(srt[i] == hole_seqs, order[i], -1)


class Overlap:
    """``_fill_holes`` (placeholders from the previous step, on the host or the device) and ``_land``."""

    # attributes of the engine this mixin reads (set by LLMEngine.__init__)
    _seqs: Any
    _by_seq: dict
    _stops: dict
    executor: Any
    stats: Any
    _grammar: Any
    _feed_ok: dict
    _feed_stops: Any  # RowSampler's
    _fail_plan: Any  # LLMEngine's

    def _takes_feed(self) -> bool:
        """Whether the executor's ``execute`` takes ``feed``: a wrapper installed over it later (the
        distributed engines' lock-step executors) that does not keeps the plain async order (logged once)."""
        fn = self.executor.execute
        key = getattr(fn, "__func__", fn)
        ok = self._feed_ok.get(key)
        if ok is None:
            params: Mapping[str, inspect.Parameter]
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                params = {}
            ok = self._feed_ok[key] = "feed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
            if not ok:
                log.info("engine: async overlap off: the executor's execute (%s) takes no device token feed",
                         getattr(key, "__qualname__", key))
        return ok

    def _needs_host_tokens(self, plan: Plan) -> bool:
        """A row of a structured request: its grammar mask needs the previous token on the host."""
        s = self._seqs
        return self._grammar is not None and bool(s.structured[s.ix(plan.seq_ids)].any())

    def _land_step(self, plan: Plan, sampled: Any) -> Any:
        """The in-flight step's tokens on the host (engine/overlap.py); a failure to get them (a device
        error surfacing at the wait) fails that step's batch alone, as a failed step does."""
        try:
            return self._land(plan, sampled)
        except Exception as e:
            log.exception("engine: step %d failed when its tokens were read; its batch's requests fail", plan.step_id)
            return self._fail_plan(plan, f"engine step failed: {type(e).__name__}: {e}")

    def _fill_holes(self, tokens: np.ndarray, seq_ids: np.ndarray, ix: np.ndarray, ntok: np.ndarray,
                    prev: PendingStep | None) -> tuple[np.ndarray, np.ndarray]:
        """Fill the plan's placeholders (token < 0) in place: from each sequence's last token known on the
        host, except those the in-flight step ``prev`` sampled, which get a valid placeholder (0) here and
        their value on the device. Returns (flat token positions fed from ``prev``, their ``prev`` rows)."""
        hole = np.flatnonzero(tokens < 0)
        none = np.zeros(0, np.int64)
        if hole.size == 0:
            return none, none
        row = np.repeat(np.arange(ntok.shape[0]), ntok)[hole]
        src = prev.feed_rows(seq_ids[row]) if prev is not None else np.full(hole.shape, -1, np.int64)
        fed = src >= 0
        tokens[hole] = np.where(fed, 0, self._seqs.last_token[ix[row]])
        return hole[fed].astype(np.int64), src[fed].astype(np.int64)

    @staticmethod
    def _batch_feed(fed_pos: np.ndarray, fed_src: np.ndarray, tok_keep: np.ndarray,
                    prev: PendingStep | None) -> TokenFeed | None:
        """The feed of one batch: the fed plan tokens that the batch keeps, at their batch positions."""
        if prev is None or fed_pos.size == 0:
            return None
        k = tok_keep[fed_pos]
        at = np.cumsum(tok_keep) - 1  # plan token -> batch token
        return TokenFeed(at[fed_pos[k]].astype(np.int64), fed_src[k], prev.tokens)

    def _land(self, plan: Plan, pend: PendingStep | Any) -> Any:
        """Wait for ``pend``'s tokens (its event only) and apply the host side of sampling to the rows whose
        request is still live; returns the tokens to ``update`` the plan with (0 for dropped rows)."""
        if not isinstance(pend, PendingStep):
            return pend  # a step that ran synchronously (or failed): its tokens are already host values
        host = pend.tokens.host()
        self.executor.resolve_fed()  # before the next step can restart a slot (ModelExecutor.resolve_fed)
        s = self._seqs
        out = np.zeros(pend.num_rows, np.int32)
        if pend.rows.size == 0:
            return out
        ix = s.ix(pend.seqs)  # looked up now: the table may have compacted since the launch
        live = ~s.dead[ix]  # a request ended since the launch (stop, EOS, abort, failure): token dropped
        tok = host
        rows, lix, ltok = pend.rows[live], ix[live], tok[live]
        out[rows] = ltok
        s.last_token[lix] = ltok
        if self._stops:
            for q, r, t in zip(pend.seqs[live].tolist(), lix.tolist(), ltok.tolist()):
                if t >= 0:
                    self._feed_stops(self._by_seq[q], r, [t])
        return out
