"""The engine's live requests: by request id and by the scheduler's seq id, their per-sequence arrays, and
the one way a request ends from the engine's side (``RequestTable.end``).

A request is live from ``add`` until the scheduler reports it finished (``retire``) or it fails before
reaching the scheduler. The engine ends a request itself (an abort, a failed row or batch, a stop string,
a grammar that ended or failed) through ``end``; how the end takes effect depends on where in the step it
is decided (``EndHow``). Every end marks the sequence ``dead`` at once, so a row already planned one step
ahead is dropped from the next batch and no token of it is reported twice.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import numpy as np

from deepinfer_core.engine.grammar import Grammars
from deepinfer_core.engine.output_builder import OutputBuilder, Retired
from deepinfer_core.engine.outputs import ABORT, ERROR
from deepinfer_core.engine.prefix import PrefixCaching
from deepinfer_core.engine.requests import EngineRequest, SeqTable, derived_seed
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.kv import StatePool
from deepinfer_core.scheduler import FinishedRequest, Request, Scheduler

log = logging.getLogger(__name__)


class EndHow(enum.Enum):
    """When an end decided by the engine reaches the scheduler. ``AFTER_UPDATE`` and ``BY_TOKEN`` are for
    ends decided from a token of the step about to be applied (while it is sampled, verified or landed):
    that step's ``Scheduler.update`` is what carries them out."""

    NOW = enum.auto()  # aborted in the scheduler now; its next ``update`` reports it
    AFTER_UPDATE = enum.auto()  # this step's tokens are applied first (they count), then it is aborted
    BY_TOKEN = enum.auto()  # the scheduler ends it itself on this step's token (-1: FAILED; EOS: stop)


class RequestTable:
    """Requests by id (``reqs``) and by seq id (``by_seq``), the per-sequence arrays (``seqs``), the
    constrained requests still compiling, and each request's stop strings."""

    def __init__(
        self,
        scheduler: Scheduler,
        state_pool: StatePool,
        drafts: DraftBook | None,
        prefix: PrefixCaching | None,
        grammars: Grammars,
        outputs: OutputBuilder,
        seed: int,
    ) -> None:
        self.scheduler = scheduler
        self.state_pool = state_pool
        self.drafts = drafts
        self.prefix = prefix
        self.grammars = grammars
        self.outputs = outputs
        self.seed = seed
        self.reqs: dict[str, EngineRequest] = {}
        self.by_seq: dict[int, EngineRequest] = {}
        self.seqs = SeqTable()
        self.compiling: list[str] = []  # constrained requests whose grammar is still compiling
        self.stops: dict[str, StopStrings] = {}  # requests with stop strings (engine/stops.py)
        self._to_abort: list[str] = []  # ended AFTER_UPDATE: aborted once this step's tokens are applied
        self._serial = 0  # arrival number (a request without a seed gets one derived from it)

    def __len__(self) -> int:
        return len(self.reqs)

    # ------------------------------------------------------------------ in
    def add(self, req: EngineRequest) -> None:
        """A request whose input is valid: compile its grammar (queued once ready) or queue it now."""
        rid, sp = req.request_id, req.params
        self.reqs[rid] = req
        if sp.stop:
            self.stops[rid] = StopStrings(
                sp.stop,
                self.outputs.token_bytes(),
                include=sp.include_stop_str_in_output,
                min_tokens=sp.min_tokens,
            )
        if sp.so_args is None:
            self._queue(req)
            return
        error = self._compile(req)
        if error is not None:
            self.end(req, ERROR, error)
            return
        req.structured = True
        self.compiling.append(rid)  # queued once its grammar has compiled

    def _compile(self, req: EngineRequest) -> str | None:
        """Start compiling the request's grammar; the error (naming the field) if it cannot be."""
        so_args = req.params.so_args
        assert so_args is not None
        try:
            self.grammars.get().add_request(req.request_id, so_args)
        except ImportError as e:
            # a MissingExtraError already names the extra to install (deepinfer_core.extras)
            hint = (
                ""
                if "deepinfer-components[" in str(e)
                else ' (install the structured extra: pip install "deepinfer-components[structured]")'
            )
            return f"SamplingParams.so_args: {e}{hint}"
        except RecursionError:
            return "SamplingParams.so_args: nested too deeply to compile"
        except Exception as e:  # the library's own message, as the request's error
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            return f"SamplingParams.so_args: {msg}"
        return None

    def _queue(self, req: EngineRequest) -> None:
        """Hand a request to the scheduler (which checks lengths and pool fit)."""
        try:
            self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.params))
        except (ValueError, TypeError, OverflowError) as e:
            self.end(req, ERROR, str(e).replace(f"request {req.request_id!r}: ", ""))
            return
        req.seq = self.scheduler.seq_id(req.request_id)
        sp = req.params
        seed = sp.seed if sp.seed is not None else derived_seed(self.seed, self._serial)
        self._serial += 1
        self.seqs.add(req.seq, sp, seed, req.structured)
        self.by_seq[req.seq] = req

    def admit_compiled(self) -> None:
        """Queue constrained requests whose grammar is ready; fail those whose grammar did not compile."""
        if not self.compiling:
            return
        g = self.grammars.get()
        # nothing else to run: wait a little for a compile instead of spinning
        ready = g.ready(self.compiling) if self.scheduler.has_unfinished() else g.wait(self.compiling, 0.05)
        for rid in map(str, ready):  # the engine's request ids are str
            self.compiling.remove(rid)
            req = self.reqs[rid]
            if g.finish_reason(rid) is not None:
                self.end(
                    req, str(g.finish_reason(rid)), f"SamplingParams.so_args: invalid grammar: {g.error(rid)}"
                )
            else:
                self._queue(req)

    # ------------------------------------------------------------------ out
    def end(
        self,
        req: EngineRequest,
        reason: str | None = None,
        error: str | None = None,
        how: EndHow = EndHow.NOW,
    ) -> bool:
        """End a live request from the engine's side: the one place that does. ``reason`` / ``error`` (when
        ``reason`` is given) are what its output reports, whatever the scheduler says. A request that never
        reached the scheduler is reported by the next ``step`` (an abort unless ``reason`` says otherwise).
        Otherwise its later rows are dropped now and, per ``how``, the scheduler aborts it now (its state
        slot and drafts are returned first, before the scheduler can give its seat to a waiting request),
        after this step's tokens are applied, or ends it itself on this step's token."""
        if reason is not None:
            req.reason, req.error = reason, error
        if req.seq < 0:
            self._drop(req)
            return True
        self.seqs.dead[self.seqs.row(req.seq)] = True  # a row already planned one step ahead is dropped
        if how is EndHow.NOW:
            self._release(req.seq)
            return self.scheduler.abort(req.request_id)
        if how is EndHow.AFTER_UPDATE:
            self._to_abort.append(req.request_id)
        return True

    def end_deferred(self) -> None:
        """After ``Scheduler.update``: abort the requests ended ``AFTER_UPDATE`` (e.g. a grammar that accepted
        its end under ignore_eos) now that the token that ended them is applied."""
        for rid in self._to_abort:
            req = self.reqs.get(rid)
            if req is not None:
                self._release(req.seq)
                self.scheduler.abort(rid)
        self._to_abort.clear()

    def _drop(self, req: EngineRequest) -> None:
        """Forget a request that never reached the scheduler; its output comes from the next step."""
        rid = req.request_id
        if rid in self.compiling:
            self.compiling.remove(rid)
        del self.reqs[rid]
        self.stops.pop(rid, None)
        if req.structured and self.grammars.manager is not None:
            self.grammars.manager.remove_request(rid)
        self.outputs.failed(
            rid, req.prompt, req.prompt_token_ids, req.error, req.reason if req.reason is not None else ABORT
        )

    def _release(self, seq: int) -> None:
        """No more rows of ``seq`` will run: mark it dead and return its state slot and drafts."""
        self.seqs.dead[self.seqs.row(seq)] = True
        if self.state_pool.contains(seq):
            self.state_pool.release(seq)
        if self.drafts is not None:
            self.drafts.drop(seq)
        if self.prefix is not None:
            self.prefix.drop(seq)

    def retire(self, fr: FinishedRequest) -> Retired:
        """Forget a request the scheduler reported finished; what its output needs."""
        req = self.reqs.pop(fr.request_id)
        seq = req.seq
        self._release(seq)
        self.seqs.remove(seq)
        del self.by_seq[seq]
        metrics: dict[str, Any] = {}
        g = self.grammars.manager
        if req.structured and g is not None:
            try:
                metrics = g.metrics(req.request_id)  # e.g. which grammar engine served it
            except Exception:  # never lose the output over its metrics
                log.exception("request %r: grammar metrics unavailable", req.request_id)
            g.remove_request(req.request_id)
        if self.drafts is not None:  # speculative decoding: this request's own drafts
            metrics.update(drafts_verified=req.drafts_verified, drafts_accepted=req.drafts_accepted)
        cached, replayed = self.prefix.take_metrics(seq) if self.prefix is not None else (0, 0)
        return Retired(req, self.stops.pop(req.request_id, None), metrics, cached, replayed)

    def fail_all(self, error: str) -> list[EngineRequest]:
        """Every live request, forgotten (``LLMEngine.reset`` reports them failed with ``error``)."""
        gone = list(self.reqs.values())
        g = self.grammars.manager
        for req in gone:
            req.reason, req.error = ERROR, error
            if req.structured and g is not None:
                g.remove_request(req.request_id)
        self.reqs.clear()
        return gone

    # ------------------------------------------------------------------ lookups
    def known_tokens(self, seq: int) -> np.ndarray:
        """A live sequence's tokens as the scheduler knows them: prompt + outputs applied so far."""
        req = self.by_seq[seq]
        out = self.scheduler.output_token_ids(req.request_id)
        return np.asarray([*req.prompt_token_ids, *out], dtype=np.int64)

    def rid_of_seq(self, seq: int) -> str | None:
        req = self.by_seq.get(seq)
        return None if req is None else req.request_id

    def live_info(self, rid: str) -> tuple[int, int | None] | None:
        """(output tokens in the scheduler, stop-string token cap) of a live, queued request; None when
        it is not (the ``OutputBuilder``'s truth for what a stream may show)."""
        req = self.reqs.get(rid)
        if req is None or req.seq < 0:
            return None
        try:
            # tokens whose values the scheduler holds: output_len also counts the in-flight step's (async
            # scheduling), which the builder would otherwise read back in full every step
            n = self.scheduler.known_output_len(rid)
        except (KeyError, ValueError):  # ended in the scheduler, reported at the next update
            return None
        stops = self.stops.get(rid)
        return n, (stops.hit.tokens if stops is not None and stops.hit is not None else None)
