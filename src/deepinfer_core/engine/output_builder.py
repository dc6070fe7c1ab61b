"""The engine's output side: every ``RequestOutput`` the engine returns is built here.

``OutputBuilder`` is owned by ``LLMEngine`` and has two jobs:

- **Final outputs**: a request the scheduler reported finished becomes its cumulative final output
  (``finished``, from what ``RequestTable.retire`` collected), one that ended outside the scheduler (bad
  input, a grammar that did not compile, an abort before it was queued) one with ``error`` / the reason
  (``failed``, queued in ``ready`` for the next step; outputs handed back by a caller they did not belong
  to wait there too), a request failed by ``LLMEngine.reset`` one from ``reset_output``.
- **Streaming**: the engine tells it that a request arrived (``add``; ``group`` for n > 1), that a
  scheduler update applied some plan's tokens (``note``, from ``LLMEngine._update`` while the requests
  are still in the table) and, through ``collect`` at the end of each step, which requests ended (their
  final outputs). ``collect`` returns one output per request that produced tokens or ended in the step,
  shaped by the request's ``output_kind``:

- **Tokens**: the scheduler's own count of output tokens (``output_len``) is the truth; the tokens of
  the noted rows are used when they account for it exactly, otherwise the tokens are read back from the
  scheduler (a preemption or a dropped row cannot make a stream lose or repeat a token). A request that
  hit a stop string streams no token past the one that completed it (its final ``token_ids`` end there).
- **Text**: an incremental UTF-8 decoder over each token's bytes (``Tokenizer.token_bytes``), so a
  character split across tokens is emitted once complete, never as U+FFFD halves. With stop strings the
  last ``len(longest stop) - 1`` bytes are held back until the request ends: a stop string that starts
  there would cut them from the final text. The final output's delta is the rest of the engine's final
  text, so a stream's deltas always concatenate to exactly ``RequestOutput.text``.
- **n > 1** (``SamplingParams.n``): the engine runs the samples as child requests; their outputs are
  grouped back into one ``RequestOutput`` per step of the parent (``samples``, see outputs.py).

FINAL_ONLY requests with n == 1 are not tracked at all (no per-step cost): their final output passes
through unchanged, which is how ``LLM.generate`` runs.
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from deepinfer_core.engine.outputs import ABORT, ERROR, LENGTH, STOP, CompletionOutput, RequestOutput
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.protocols import Tokenizer
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams
from deepinfer_core.scheduler import FinishedRequest, FinishReason, Plan

log = logging.getLogger(__name__)

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# (output_len, stop-string token cap or None) of a live request, None when it is not live
LiveInfo = Callable[[str], "tuple[int, int | None] | None"]
ReadBack = Callable[[str], Sequence[int]]  # a live request's output tokens, from the scheduler
RidOf = Callable[[int], "str | None"]  # a live sequence's request id
_REASONS = {
    FinishReason.STOP: STOP,
    FinishReason.LENGTH: LENGTH,
    FinishReason.ABORT: ABORT,
    FinishReason.FAILED: ERROR,
}


@attrs.define
class Retired:
    """What a request left behind when the engine forgot it (``RequestTable.retire``)."""

    req: EngineRequest
    stops: StopStrings | None
    metrics: dict[str, Any]
    cached_tokens: int
    replayed_tokens: int


class IncrementalText:
    """Token bytes in, complete UTF-8 text out (a character split across tokens is emitted whole);
    ``hold`` bytes at the end are kept back until ``flush`` (stop strings, see the module docstring)."""

    __slots__ = ("_dec", "_hold", "_pending", "_tb")

    def __init__(self, token_bytes: Sequence[bytes], hold: int = 0) -> None:
        self._tb = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = hold
        self._pending = bytearray()

    def feed(self, ids: Sequence[int]) -> str:
        tb, n = self._tb, len(self._tb)
        for t in ids:
            if 0 <= t < n:
                self._pending += tb[t]
        if not self._hold:
            data, self._pending = bytes(self._pending), bytearray()
        else:
            cut = max(0, len(self._pending) - self._hold)
            data = bytes(self._pending[:cut])
            del self._pending[:cut]
        return self._dec.decode(data)

    def flush(self) -> str:
        data, self._pending = bytes(self._pending), bytearray()
        return self._dec.decode(data, final=True)


@attrs.define(slots=True)
class _Track:
    """One streamed request (or one sample of an n > 1 request)."""

    rid: str
    prompt: str | None
    prompt_ids: tuple[int, ...]
    kind: RequestOutputKind
    text_dec: IncrementalText
    arrival: float
    group: _Group | None = None
    index: int = 0
    ids: list[int] = attrs.field(factory=list)  # streamed so far
    text: str = ""
    new_ids: list[int] = attrs.field(factory=list)  # since the previous output
    delta: str = ""
    first_t: float | None = None
    last_t: float | None = None
    final: RequestOutput | None = None
    touched: bool = False
    reported: bool = False  # its final completion went out (DELTA groups report an ended sample once)

    def metrics(self) -> dict[str, Any]:
        return {
            "arrival_time": self.arrival,
            "first_token_time": self.first_t,
            "last_token_time": self.last_t,
            "num_generated_tokens": len(self.ids),
        }

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        f = self.final
        cum = kind != DELTA
        return CompletionOutput(
            index=self.index,
            text=self.text if cum else self.delta,
            token_ids=tuple(self.ids if cum else self.new_ids),
            finish_reason=None if f is None else f.finish_reason,
            stop_reason=None if f is None else f.stop_reason,
            error=None if f is None else f.error,
        )


@attrs.define(slots=True)
class _Group:
    """An n > 1 request: its samples' tracks, grouped back into one output."""

    rid: str
    prompt: str | None
    prompt_ids: tuple[int, ...]
    kind: RequestOutputKind
    arrival: float
    tracks: list[_Track] = attrs.field(factory=list)
    touched: bool = False

    @property
    def finished(self) -> bool:
        return all(t.final is not None for t in self.tracks)


class OutputBuilder:
    """The engine's ``RequestOutput`` s: final ones, the queue of ready ones, and the per-request
    streaming state (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.ready: list[RequestOutput] = []  # failed before reaching the scheduler, or handed back
        self._tok_bytes: list[bytes] | None = None
        self._tracks: dict[str, _Track] = {}  # streamed requests and every sample of a group
        self._groups: dict[str, _Group] = {}  # n > 1 parents
        self._notes: dict[str, list[int]] = {}  # request id -> tokens of rows applied this step
        self._order: list[_Track | _Group] = []  # touched this step, in order

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (the tokenizer's, read once): the stop strings' and the text streams'."""
        if self._tok_bytes is None:
            self._tok_bytes = list(self.tokenizer.token_bytes())
        return self._tok_bytes

    # ------------------------------------------------------------------ final outputs
    def take_ready(self) -> list[RequestOutput]:
        out, self.ready = self.ready, []
        return out

    def has_ready(self, request_id: str) -> bool:
        return any(o.request_id == request_id for o in self.ready)

    def failed(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        error: str | None,
        reason: str = ERROR,
    ) -> None:
        """A request that ended outside the scheduler (bad input, a grammar that did not compile, an abort
        while compiling or held): its output is returned by the next ``step``."""
        if error is not None:
            log.warning("request %r failed: %s", request_id, error)
        self.ready.append(
            RequestOutput(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                finish_reason=reason,
                error=error,
            )
        )

    def reset_output(self, req: EngineRequest, error: str) -> RequestOutput:
        """A live (or held) request failed by ``LLMEngine.reset``."""
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            finish_reason=ERROR,
            error=error,
        )

    def finished(self, fr: FinishedRequest, gone: Retired) -> RequestOutput:
        """The final output of a request the scheduler reported: the engine's own reason
        (``EngineRequest.reason``, set when the engine ended it) wins over the scheduler's; a stop string
        cuts the text. ``collect`` marks its stream final with it."""
        req, stops = gone.req, gone.stops
        hit = stops.hit if stops is not None else None
        reason = req.reason if req.reason is not None else _REASONS.get(fr.finish_reason, ERROR)
        error = req.error
        if fr.finish_reason is FinishReason.FAILED and error is None:
            error = "the sampler returned no valid token for this request"
        if error is not None:
            log.warning("request %r failed: %s", req.request_id, error)
        ids = fr.output_token_ids
        metrics = {
            **gone.metrics,
            "arrival_time": req.arrival,
            "last_token_time": self.clock(),
            "num_generated_tokens": len(ids),
        }
        text = None
        if hit is not None and stops is not None:  # the text ends at the stop string (vLLM's rule)
            ids, text = ids[: hit.tokens], stops.text()
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=self.tokenizer.decode(ids) if text is None else text,
            token_ids=ids,
            finish_reason=reason,
            error=error,
            num_preemptions=fr.num_preemptions,
            cached_tokens=gone.cached_tokens,
            replayed_tokens=gone.replayed_tokens,
            stop_reason=hit.stop if hit is not None else None,
            metrics=metrics,
        )

    # ------------------------------------------------------------------ requests
    def add(
        self,
        rid: str,
        prompt: str | None,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        kind: RequestOutputKind | None = None,
        *,
        parent: str | None = None,
        index: int = 0,
    ) -> None:
        """A request (or sample ``index`` of ``parent``, added with ``group`` first) arrived."""
        kind = params.output_kind if kind is None else kind
        g = self._groups.get(parent) if parent is not None else None
        if g is None and kind == FINAL:
            return  # nothing to stream: the final output passes through
        hold = max((len(s.encode("utf-8")) for s in params.stop), default=1) - 1
        t = _Track(
            rid,
            prompt,
            prompt_ids,
            kind if g is None else g.kind,
            IncrementalText(self.token_bytes(), hold),
            self.clock() if g is None else g.arrival,
            group=g,
            index=index,
        )
        self._tracks[rid] = t
        if g is not None:
            g.tracks.append(t)

    def group(
        self,
        rid: str,
        prompt: str | None,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        kind: RequestOutputKind | None = None,
    ) -> None:
        """An n > 1 request ``rid``: its samples are added next with ``parent=rid``."""
        self._groups[rid] = _Group(
            rid, prompt, prompt_ids, params.output_kind if kind is None else kind, self.clock()
        )

    def is_group(self, rid: str) -> bool:
        return rid in self._groups

    def children(self, rid: str) -> list[str]:
        g = self._groups.get(rid)
        return [] if g is None else [t.rid for t in g.tracks]

    def clear(self) -> None:
        """Forget every stream (``LLMEngine.reset``, after its outputs were collected)."""
        self._tracks.clear()
        self._groups.clear()
        self._notes.clear()
        self._order.clear()

    @property
    def num_tracked(self) -> int:
        return len(self._tracks) + len(self._groups)

    # ------------------------------------------------------------------ the step
    def note(self, plan: Plan, tokens: np.ndarray, counts: np.ndarray | None, rid_of: RidOf) -> None:
        """A scheduler update applied ``tokens`` (one per plan row, or with ``counts`` flat tokens and a
        count per row) to ``plan``: remember each streamed request's tokens (checked against the
        scheduler's count in ``collect``)."""
        if not self._tracks:
            return
        if counts is not None:  # speculation: flat tokens, a count per row
            ends = np.cumsum(counts)
            rows = np.flatnonzero(counts > 0)
            per_row = {int(r): tokens[ends[r] - counts[r] : ends[r]].tolist() for r in rows.tolist()}
        else:
            rows = np.flatnonzero(plan.sample > 0)
            per_row = {int(r): [int(tokens[r])] for r in rows.tolist()}
        seqs = plan.seq_ids
        for r, toks in per_row.items():
            rid = rid_of(int(seqs[r]))
            if rid is not None and rid in self._tracks:
                self._notes.setdefault(rid, []).extend(toks)

    def collect(
        self, finals: list[RequestOutput], live: LiveInfo, read_back: ReadBack
    ) -> list[RequestOutput]:
        """This step's outputs: progress of the noted live requests, then the ended ones (``finals``:
        the engine's cumulative final outputs, which untracked requests return unchanged)."""
        now = self.clock()
        notes, self._notes = self._notes, {}
        for rid, toks in notes.items():
            t = self._tracks.get(rid)
            info = live(rid) if t is not None and t.final is None else None
            if t is None or info is None:
                continue  # ended (its final output covers it) or gone (reset)
            n_out, cap = info
            want = n_out if cap is None else min(n_out, cap)
            new = want - len(t.ids)
            if new <= 0:
                continue
            got = toks[-new:] if len(toks) >= new else list(read_back(rid))[len(t.ids) : want]
            # a stop string matched (cap): the text ends at the match, which the final output knows
            self._advance(t, got, t.text_dec.feed(got) if cap is None else "", now)
        out: list[RequestOutput] = []
        for f in finals:
            t = self._tracks.get(f.request_id) if f.finished else None
            if t is None:  # untracked, or an output handed back (LLMEngine.hand_back): as it is
                out.append(f)
                continue
            del self._tracks[f.request_id]
            self._end(t, f, now)
        order, self._order = self._order, []
        for x in order:
            x.touched = False
            o = self._emit(x)
            if o is not None:
                out.append(o)
        return out

    def _advance(self, t: _Track, ids: list[int], delta: str, now: float) -> None:
        if ids:
            if t.first_t is None:
                t.first_t = now
            t.last_t = now
        t.ids += ids
        t.new_ids += ids
        t.text += delta
        t.delta += delta
        self._touch(t)

    def _touch(self, t: _Track) -> None:
        x: _Track | _Group = t.group if t.group is not None else t
        if not x.touched:
            x.touched = True
            self._order.append(x)

    def _end(self, t: _Track, f: RequestOutput, now: float) -> None:
        """The request ended: the rest of its tokens and text come from the engine's final output."""
        ids = list(f.token_ids)
        if len(ids) >= len(t.ids) and ids[: len(t.ids)] == t.ids:
            new = ids[len(t.ids) :]
        else:  # the final output keeps fewer tokens (a reset, a stop cut): nothing more to stream
            if len(ids) < len(t.ids) and f.error is None:
                log.error("request %r: final token_ids are not an extension of the streamed ones", t.rid)
            new = []
        t.text_dec.flush()
        if f.text.startswith(t.text):
            delta = f.text[len(t.text) :]
        else:  # cannot happen for the engine's own texts (tested); never lose the final text
            log.error("request %r: streamed text is not a prefix of the final text", t.rid)
            delta = f.text
        self._advance(t, new, delta, now)
        t.final = f
        if t.group is not None:
            self._tracks.pop(t.rid, None)

    def _emit(self, x: _Track | _Group) -> RequestOutput | None:
        if isinstance(x, _Group):
            return self._emit_group(x)
        f = x.final
        if x.kind == FINAL and f is None:
            return None
        delta = x.kind == DELTA
        ids = tuple(x.new_ids if delta else x.ids)
        text = x.delta if delta else x.text
        x.new_ids, x.delta = [], ""
        m = x.metrics()
        if f is None:
            return RequestOutput(
                request_id=x.rid,
                prompt=x.prompt,
                prompt_token_ids=x.prompt_ids,
                text=text,
                token_ids=ids,
                finish_reason=None,
                metrics=m,
                finished=False,
                output_kind=x.kind,
            )
        return attrs.evolve(f, text=text, token_ids=ids, metrics={**f.metrics, **m}, output_kind=x.kind)

    def _emit_group(self, g: _Group) -> RequestOutput | None:
        done = g.finished
        if g.kind == FINAL and not done:
            return None
        pick = g.tracks
        if g.kind == DELTA:  # an ended sample is reported once
            pick = [t for t in pick if t.new_ids or t.delta or not t.reported]
        samples = tuple(t.completion(g.kind) for t in pick)
        for t in pick:
            t.new_ids, t.delta = [], ""
            t.reported = t.final is not None
        if done:
            del self._groups[g.rid]
            for t in g.tracks:
                self._tracks.pop(t.rid, None)
        first = samples[0] if samples else CompletionOutput(index=0, text="", token_ids=())
        ts = g.tracks
        firsts = [t.first_t for t in ts if t.first_t is not None]
        lasts = [t.last_t for t in ts if t.last_t is not None]
        finals = [t.final for t in ts if t.final is not None]
        m: dict[str, Any] = {
            "arrival_time": g.arrival,
            "first_token_time": min(firsts, default=None),
            "last_token_time": max(lasts, default=None),
            "num_generated_tokens": sum(len(t.ids) for t in ts),
        }
        for f in finals:
            for k in ("drafts_verified", "drafts_accepted"):
                if k in f.metrics:
                    m[k] = m.get(k, 0) + f.metrics[k]
        errors = [f.error for f in finals if f.error is not None]
        return RequestOutput(
            request_id=g.rid,
            prompt=g.prompt,
            prompt_token_ids=g.prompt_ids,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason if done else None,
            error=(errors[0] if errors and done else None),
            num_preemptions=sum(f.num_preemptions for f in finals),
            cached_tokens=sum(f.cached_tokens for f in finals),
            replayed_tokens=sum(f.replayed_tokens for f in finals),
            stop_reason=first.stop_reason,
            metrics=m,
            finished=done,
            output_kind=g.kind,
            samples=samples,
        )
