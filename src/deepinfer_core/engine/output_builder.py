"""Streamed outputs: the engine's step results turned into per-request ``RequestOutput`` s.

``OutputBuilder`` is owned by ``LLMEngine``. The engine tells it three things: a request arrived
(``add``), a scheduler update applied some plan's tokens (``note``), a request ended (its final, cumulative
``RequestOutput`` from the engine, in ``collect``). At the end of a step ``collect`` returns one output per
request that produced tokens or ended in the step, shaped by the request's ``output_kind``:

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

from deepinfer_core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# (output_len, stop-string token cap or None) of a live request, None when it is not live
LiveInfo = Callable[[str], "tuple[int, int | None] | None"]
ReadBack = Callable[[str], Sequence[int]]  # a live request's output tokens, from the scheduler


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
    """Per-request streaming state of one engine (see the module docstring)."""

    def __init__(
        self, token_bytes: Callable[[], Sequence[bytes]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._token_bytes = token_bytes
        self.clock = clock
        self._tracks: dict[str, _Track] = {}  # streamed requests and every sample of a group
        self._groups: dict[str, _Group] = {}  # n > 1 parents
        self._notes: dict[str, list[int]] = {}  # request id -> tokens of rows applied this step
        self._order: list[_Track | _Group] = []  # touched this step, in order

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
            IncrementalText(self._token_bytes(), hold),
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
        self._tracks.clear()
        self._groups.clear()
        self._notes.clear()
        self._order.clear()

    @property
    def num_tracked(self) -> int:
        return len(self._tracks) + len(self._groups)

    # ------------------------------------------------------------------ the step
    def note(
        self,
        plan: Any,
        sampled: np.ndarray | tuple[np.ndarray, np.ndarray],
        rid_of: Callable[[int], str | None],
    ) -> None:
        """A scheduler update applied ``sampled`` to ``plan``: remember each streamed request's tokens
        (checked against the scheduler's count in ``collect``)."""
        if not self._tracks:
            return
        if isinstance(sampled, tuple):  # speculation: flat tokens, a count per row
            flat, counts = sampled
            ends = np.cumsum(counts)
            rows = np.flatnonzero(counts > 0)
            per_row = {int(r): flat[ends[r] - counts[r] : ends[r]].tolist() for r in rows.tolist()}
        else:
            rows = np.flatnonzero(plan.sample > 0)
            per_row = {int(r): [int(sampled[r])] for r in rows.tolist()}
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
            t = self._tracks.pop(f.request_id, None)
            if t is None:
                out.append(f)
                continue
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
