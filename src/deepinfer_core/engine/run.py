"""The engine's model side of a step: a plan's rows -> ``ForwardBatch`` -> ``ModelExecutor.execute`` ->
sampled tokens (and, with DSpark, the verified rows' accepted drafts).

``StepRunner`` is owned by the engine: ``run`` turns one plan into a ``Launched`` step (its tokens on the
host, or with the asynchronous overlap still on the device) and ``land`` brings a launched step's tokens to
the host. Masking and sampling are the ``TokenSampler``'s (engine/sample.py); a request that fails inside
the step is ended through ``RequestTable.end``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from deepinfer_core.device_tokens import DeviceTokens, TokenFeed, h2d
from deepinfer_core.engine.outputs import ERROR
from deepinfer_core.engine.overlap import Launched, PendingStep, StepTokens, batch_feed, fill_holes
from deepinfer_core.engine.prefix import PrefixCaching, StepRows
from deepinfer_core.engine.request_table import RequestTable
from deepinfer_core.engine.sample import TokenSampler
from deepinfer_core.engine.spec_rows import SpecRows
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stats import StepStats
from deepinfer_core.kv import StatePool
from deepinfer_core.model import BatchError, ForwardBatch, ForwardOutput
from deepinfer_core.model.invariant import default_rows
from deepinfer_core.protocols import InvariantRows, ModelExecutor
from deepinfer_core.scheduler import Plan, StepType

log = logging.getLogger(__name__)


@attrs.define
class _Work:
    """One plan's arrays while the runner builds, executes and samples it."""

    plan: Plan
    ix: np.ndarray  # each row's place in the per-sequence arrays (SeqTable.ix)
    ntok: np.ndarray  # int64 tokens per row
    tokens: np.ndarray  # int64 flat tokens, placeholders and drafts filled in
    spec_row: np.ndarray  # rows whose token comes from the executor (greedy verify / draft)
    fed_pos: np.ndarray  # flat token positions fed on the device from the in-flight step
    fed_src: np.ndarray  # their rows in ``prev``'s tokens
    prev: PendingStep | None
    pre: StepRows | None = None  # prefix caching: what the main batch runs of each row


@attrs.define
class _Executed:
    """The executor's answer for the rows it ran."""

    rows: np.ndarray  # plan rows in the batch (request i of the batch is row rows[i])
    keep_row: np.ndarray  # bool per plan row: in the batch
    batch: ForwardBatch
    logits: torch.Tensor
    spec: dict[str, np.ndarray]  # DSpark outputs (empty without drafts)


class StepRunner:
    """Batch build, execution, sampling and draft collection for one plan (``run``), and landing (``land``)."""

    def __init__(
        self,
        executor: ModelExecutor,
        state_pool: StatePool,
        prefix: PrefixCaching | None,
        drafts: DraftBook | None,
        table: RequestTable,
        sampler: TokenSampler,
        stats: StepStats,
        *,
        batch_invariant: bool,
        apply_mask: Callable[..., Any],
    ) -> None:
        self.executor = executor
        self.state_pool = state_pool
        self.prefix = prefix
        self.drafts = drafts
        self.table = table
        self.sampler = sampler
        self.stats = stats
        self.batch_invariant = batch_invariant
        if batch_invariant:
            enable_invariant_rows(executor)
        self.apply_mask = apply_mask
        self._snapshots: dict[int, torch.Tensor] = {}  # the last execute's encoder-ring snapshots, by request
        # the speculative side of a step (verify seeds and grammar masks, verified rows collected)
        self.spec = SpecRows(drafts, table, sampler, state_pool, apply_mask) if drafts is not None else None
        self._feed_ok: dict[Any, bool] = {}  # execute function -> takes a feed (takes_feed)

    # ------------------------------------------------------------------ run
    def run(
        self,
        plan: Plan,
        prev: PendingStep | None = None,
        overlap: bool = False,
        land_early: Callable[[], None] | None = None,
    ) -> Launched:
        """Execute ``plan`` and sample. ``overlap`` (engine/overlap.py): the tokens stay on the device (a
        ``PendingStep``, landed later); placeholders sampled by the in-flight step ``prev`` are fed from it
        on the device. ``land_early`` (``StepOrder.land_early``) lands ``prev`` after this step's forward is
        launched and before it samples, when a structured row's grammar mask needs ``prev``'s token. Never
        raises: an unexpected error fails the requests of this batch alone."""
        try:
            step = self._run(plan, prev, overlap, land_early)
        except Exception as e:  # fail this batch's requests, keep the engine
            log.exception("engine: step %d failed; its batch's requests fail", plan.step_id)
            step = Launched(plan, self.fail_plan(plan, f"engine step failed: {type(e).__name__}: {e}"))
        self.stats.steps += 1
        self.stats.verify_rows += int((plan.num_drafts > 0).sum())
        return step

    def _run(
        self, plan: Plan, prev: PendingStep | None, overlap: bool, land_early: Callable[[], None] | None
    ) -> Launched:
        t0 = time.perf_counter()
        self._forget_preempted(plan)
        seqs = self.table.seqs
        ix = seqs.ix(plan.seq_ids)
        ntok = plan.num_tokens.astype(np.int64)
        tokens = plan.token_ids.astype(np.int64)
        if self.drafts is not None:
            self.drafts.fill(plan, tokens, plan.seq_ids)
        # one step ahead: placeholders are the token the previous step sampled for that sequence (on
        # the host, or with the overlap still on the device: fed_pos / fed_src)
        fed_pos, fed_src = fill_holes(tokens, plan.seq_ids, ix, ntok, seqs.last_token, prev)
        spec_row = (plan.sample > 0) & (DraftBook.eligible(seqs, ix) if self.drafts is not None else False)
        w = _Work(plan, ix, ntok, tokens, spec_row, fed_pos, fed_src, prev)
        self._acquire_slots(w)
        rows = np.flatnonzero(~seqs.dead[ix])  # rows of requests that already ended are discarded
        if self.prefix is not None and rows.size:
            w.pre = self._prepare_prefix(w, rows)
            rows = w.pre.rows
        res = self._execute_rows(w, rows, t0)
        if res is None:  # no row left to run
            return Launched(plan, self._step_tokens(plan, np.zeros(plan.num_rows, np.int32), {}))
        if overlap and prev is not None and land_early is not None and self.needs_host_tokens(plan):
            land_early()  # the grammars need prev's tokens; the device runs this step's forward meanwhile
        t0 = time.perf_counter()
        sampled, pending, got = self._sample(w, res, overlap)
        if w.pre is not None:
            self._publish_prefix(w, res)
        self.stats.sample_s += time.perf_counter() - t0
        if pending is not None:
            return Launched(plan, pending=pending)
        return Launched(plan, self._step_tokens(plan, sampled, got))

    def _forget_preempted(self, plan: Plan) -> None:
        """A preempted sequence's caches restart at position 0 when it is admitted again."""
        for rid in plan.preempted:
            req = self.table.reqs.get(rid)
            seq = req.seq if req is not None else -1
            if seq < 0:
                continue
            if self.state_pool.contains(seq):
                self.state_pool.release(seq)
            if self.drafts is not None:
                self.drafts.drop(seq)  # the executor forgets its drafts when the slot restarts
            if self.prefix is not None:
                self.prefix.drop(seq)  # it re-hits its own prefix when it is admitted again

    def _acquire_slots(self, w: _Work) -> None:
        """A state slot for each admission. Only a sequence's first chunk (new, or recomputed after
        preemption; it starts after its shared prefix hit) needs one; every later row holds one already,
        so this is no per-row loop in decode steps."""
        plan, pool = w.plan, self.state_pool
        for r in np.flatnonzero((plan.cached >= 0) & ~self.table.seqs.dead[w.ix]).tolist():
            seq = int(plan.seq_ids[r])
            if not pool.contains(seq) and pool.acquire(seq) is None:
                # cannot happen while slots are returned before seats (RequestTable.end); fail it alone if it does
                log.error("engine: no free state slot for seq %d (%d slots)", seq, pool.num_slots)
                self._fail_row(seq, f"no free state slot ({pool.num_slots} slots)")

    def _prepare_prefix(self, w: _Work, rows: np.ndarray) -> StepRows:
        """Prefix caching: hit tokens skipped, encoder-only parts run, the tail's decoder floor."""
        assert self.prefix is not None
        plan = w.plan
        pre = self.prefix.prepare(
            plan.step_type == StepType.PREFILL,
            rows,
            plan.seq_ids,
            plan.start,
            w.ntok,
            w.tokens,
            plan.block_tables,
            self.state_pool.slots,
            self.table.known_tokens,
            plan.cached,
        )
        for seq, msg in pre.failed:
            self._fail_row(seq, msg)
        return pre

    def _execute_rows(self, w: _Work, rows: np.ndarray, t0: float) -> _Executed | None:
        """Build the batch of ``rows`` and execute it. A request the executor refuses (``BatchError``)
        fails alone and the other rows are built and executed again (nothing was written); None when no
        row is left."""
        while rows.size:
            keep_row = np.zeros(w.plan.num_rows, bool)  # a mask of ``rows`` (np.isin's sort: not needed)
            keep_row[rows] = True
            batch, tok_keep = self._batch(w, rows, keep_row)
            feed = batch_feed(w.fed_pos, w.fed_src, tok_keep, w.prev)
            self.stats.build_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                logits, spec = self._execute(batch, feed)
            except BatchError as e:  # one bad request: fail it, rerun the others
                if e.request is None:
                    raise
                self._fail_row(int(w.plan.seq_ids[rows[e.request]]), f"executor refused the request: {e}")
                rows = np.delete(rows, e.request)
                continue
            finally:
                SpecRows.masks_off(self.executor.spec)
            self.stats.execute_s += time.perf_counter() - t0
            return _Executed(rows, keep_row, batch, logits, spec)
        return None

    def _batch(self, w: _Work, rows: np.ndarray, keep_row: np.ndarray) -> tuple[ForwardBatch, np.ndarray]:
        """The ``ForwardBatch`` of ``rows`` and the mask of the plan's flat tokens it keeps."""
        plan, pre = w.plan, w.pre
        nd = plan.num_drafts.astype(np.int64)
        tok_keep = np.repeat(keep_row, w.ntok)
        qn, qs = (w.ntok, plan.start) if pre is None else (pre.ntok, pre.start)
        spec_kw: dict[str, Any] = {}
        if pre is not None:
            tok_keep &= pre.tok_mask
            spec_kw.update(decoder_floor=pre.floor[rows], snapshot_pos=pre.snap[rows])
        if self.spec is not None:
            temp = np.where(w.spec_row[rows], self.table.seqs.temperature[w.ix[rows]], 0.0)
            spec_kw.update(verify_lens=nd[rows], draft=w.spec_row[rows], temperature=temp)
            self.spec.masks_on(self.executor.spec, plan, rows, w.spec_row, w.tokens, w.ntok, w.ix)
        batch = ForwardBatch(
            token_ids=w.tokens[tok_keep],
            query_lens=qn[rows],
            start_pos=qs[rows],
            block_tables=plan.block_tables[rows],
            state_slots=self.state_pool.slots(plan.seq_ids[rows]),
            num_logits=plan.sample[rows] + nd[rows],
            **spec_kw,
        )
        return batch, tok_keep

    def _sample(
        self, w: _Work, res: _Executed, overlap: bool
    ) -> tuple[np.ndarray, PendingStep | None, dict[int, list[int]]]:
        """Sample the plain rows (on the host, or with ``overlap`` left on the device) and collect the
        executor-verified rows: (tokens per plan row, the pending device tokens, verified rows' tokens)."""
        plan, rows = w.plan, res.rows
        sampled = np.zeros(plan.num_rows, np.int32)
        last = np.cumsum(res.batch.num_logits) - 1  # each request's last logits row
        plain = np.flatnonzero((plan.sample[rows] > 0) & ~w.spec_row[rows])
        srows = rows[plain]
        lg = res.logits[h2d(last[plain], res.logits.device)]
        pos = plan.context_lens[srows].astype(np.int64)
        seq, ix = plan.seq_ids[srows], w.ix[srows]
        pending = None
        if overlap:  # the tokens stay on the device; engine/overlap.py lands them after the next launch
            tok_t, ended = self.sampler.sample_device(lg, seq, ix, pos)
            pending = PendingStep(
                srows.astype(np.int64),
                seq.astype(np.int64),
                DeviceTokens(tok_t),
                plan.num_rows,
                ended_by_token=ended,
            )
        else:
            sampled[srows] = self.sampler.sample_rows(lg, seq, ix, pos)
        self.stats.tokens_sampled += int(srows.size)
        got: dict[int, list[int]] = {}
        if self.spec is not None:
            got = self.spec.collect(plan, rows, w.spec_row, res.spec, w.tokens, w.ntok, w.ix)
            self.stats.tokens_sampled += sum(len(r) for r in got.values())
        return sampled, pending, got

    def _publish_prefix(self, w: _Work, res: _Executed) -> None:
        """Publish completed exact blocks and the encoder rings at their end (engine/prefix.py)."""
        assert self.prefix is not None and w.pre is not None
        plan, pre, prev = w.plan, w.pre, w.prev
        starts = np.concatenate(([0], np.cumsum(w.ntok)[:-1])).astype(np.int64)
        first = w.tokens[starts]
        if w.fed_pos.size and prev is not None:  # fed from the device: its value (waits for prev only)
            r_fed = np.searchsorted(starts, w.fed_pos).clip(max=starts.size - 1)
            at_start = starts[r_fed] == w.fed_pos  # a placeholder is a row's first token
            r_fed, src = r_fed[at_start], w.fed_src[at_start]
            need = (pre.snap[r_fed] > 0) if pre.decode else np.ones(r_fed.shape, bool)
            need &= res.keep_row[r_fed]  # == np.isin(r_fed, rows): r_fed are plan rows
            if need.any():  # after this step's launch: the device is busy meanwhile
                first[r_fed[need]] = prev.tokens.host()[src[need]]
        self.prefix.after(
            pre, res.rows, plan.seq_ids, plan.block_tables, self._snapshots, self.table.known_tokens, first
        )

    def _step_tokens(self, plan: Plan, sampled: np.ndarray, got: dict[int, list[int]]) -> StepTokens:
        """The step's tokens as ``Scheduler.update`` takes them; with drafts, flat tokens and a count per row."""
        if self.drafts is None:
            return StepTokens(sampled)
        flat: list[int] = []
        counts = np.zeros(plan.num_rows, np.int32)
        for i in range(plan.num_rows):
            if i in got:
                flat += got[i]
                counts[i] = len(got[i])
            elif plan.sample[i]:  # sampled here, or a dropped row (its request ended: the token is ignored)
                flat.append(int(sampled[i]))
                counts[i] = 1
        return StepTokens(np.asarray(flat, np.int32), counts)

    # ------------------------------------------------------------------ failures
    def _fail_row(self, seq: int, msg: str) -> None:
        """End a running request from inside a step (its later rows are dropped)."""
        self.table.end(self.table.by_seq[seq], ERROR, msg)

    def fail_plan(self, plan: Plan, msg: str) -> StepTokens:
        """End every live request with a row in ``plan`` (error ``msg``); the tokens to ``update`` it with."""
        for seq in np.unique(plan.seq_ids).tolist():
            req = self.table.by_seq.get(int(seq))
            if req is not None and req.reason is None:
                self.table.end(req, ERROR, msg)
        return StepTokens(np.full(plan.num_rows, -1, np.int32))

    # ------------------------------------------------------------------ landing (engine/overlap.py)
    def land(self, step: Launched) -> Launched:
        """``step`` with its tokens on the host: a pending step waits for its tokens (its event only) and
        the host side of sampling runs for the rows whose request is still live; a failure to get them (a
        device error surfacing at the wait) fails that step's batch alone, as a failed step does."""
        if step.pending is None:
            return step  # ran synchronously (or failed): its tokens are already host values
        try:
            return Launched(step.plan, self._land(step.pending))
        except Exception as e:
            log.exception(
                "engine: step %d failed when its tokens were read; its batch's requests fail",
                step.plan.step_id,
            )
            return Launched(
                step.plan, self.fail_plan(step.plan, f"engine step failed: {type(e).__name__}: {e}")
            )

    def _land(self, pend: PendingStep) -> StepTokens:
        host = pend.tokens.host()
        self.executor.resolve_fed()  # before the next step can restart a slot (ModelExecutor.resolve_fed)
        s = self.table.seqs
        out = np.zeros(pend.num_rows, np.int32)
        if pend.rows.size == 0:
            return StepTokens(out)
        ix = s.ix(pend.seqs)  # looked up now: the table may have compacted since the launch
        live = ~s.dead[ix]  # a request ended since the launch (stop, EOS, abort, failure): token dropped
        # rows whose request the sampler ended on this step's token (-1: a grammar dead end or failure)
        out[pend.rows[pend.ended_by_token]] = -1
        rows, lix, ltok = pend.rows[live], ix[live], host[live]
        if self.table.grammars.manager is not None:  # structured rows: their grammars take the token now
            ltok = self.sampler.advance_grammars(pend.seqs[live], lix, ltok)
        out[rows] = ltok
        s.last_token[lix] = ltok
        if self.table.stops:
            for q, t in zip(pend.seqs[live].tolist(), ltok.tolist()):
                if t >= 0:
                    self.sampler.feed_stops(self.table.by_seq[q], [t])
        return StepTokens(out)

    def takes_feed(self) -> bool:
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
            ok = self._feed_ok[key] = "feed" in params or any(
                p.kind is p.VAR_KEYWORD for p in params.values()
            )
            if not ok:
                log.info(
                    "engine: async overlap off: the executor's execute (%s) takes no device token feed",
                    getattr(key, "__qualname__", key),
                )
        return ok

    def needs_host_tokens(self, plan: Plan) -> bool:
        """A row of a structured request: its grammar mask needs the previous token on the host."""
        s = self.table.seqs
        return self.table.grammars.manager is not None and bool(s.structured[s.ix(plan.seq_ids)].any())

    # ------------------------------------------------------------------ the executor call
    def _execute(
        self, batch: ForwardBatch, feed: TokenFeed | None = None
    ) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Logits of the sampled rows, request by request, and the DSpark outputs (numpy; empty when
        nothing drafts or verifies). ``feed``: batch tokens still on the device (engine/overlap.py)."""
        parts = self._parts(batch)
        if len(parts) == 1:  # executors without the overlap keep their one-argument call
            outs = [self.executor.execute(batch, **({} if feed is None else {"feed": feed}))]
        else:
            self.executor.validate(batch)  # refuse before any cache is written, as one call would
            off = batch.offsets
            outs = []
            for lo, hi in parts:
                sub = {} if feed is None else {"feed": feed.sub(int(off[lo]), int(off[hi]))}
                outs.append(self.executor.execute(_requests(batch, lo, hi), **sub))
        logits = outs[0].logits if len(outs) == 1 else torch.cat([o.logits for o in outs])
        self._snapshots = (
            outs[0].snapshots
            if len(outs) == 1
            else {lo + j: s for (lo, _), o in zip(parts, outs) for j, s in o.snapshots.items()}
        )
        spec: dict[str, np.ndarray] = {}
        if self.drafts is not None:
            for name in ("num_accepted", "next_token", "drafts", "draft_confidence"):
                spec[name] = np.concatenate(
                    [_spec_field(o, name, hi - lo) for (lo, hi), o in zip(parts, outs)]
                )
        return logits, spec

    def _parts(self, batch: ForwardBatch) -> list[tuple[int, int]]:
        """The request ranges [lo, hi) of a step's executor calls (in request order): one call, except in
        batch-invariant mode. There the step stays batched where the executor has the invariant products
        (``invariant_rows``, model/invariant.py), but a request must take the same executor path alone and
        in any batch: the row path runs a step whose every request feeds <= backtrack + 1 tokens, so a short
        prefill chunk next to a long one would take the per-request path instead (other attention code,
        other bits). The step is cut where the requests' own path changes (a prefill step mixing short and
        long chunks: 2-3 calls; decode and verify steps: one). An executor without the products gets the
        old loop: every request alone."""
        n = batch.num_requests
        if not self.batch_invariant or n == 1 or batch.encoder_only or batch.capture_layers:
            return [(0, n)]
        if invariant_rows(self.executor) <= 0:
            return [(i, i + 1) for i in range(n)]
        assert isinstance(self.executor, InvariantRows)  # invariant_rows > 0
        row = batch.query_lens <= self.executor.backtrack + 1
        edges = [0, *(np.flatnonzero(row[1:] != row[:-1]) + 1).tolist(), n]
        return list(itertools.pairwise(edges))


def _requests(batch: ForwardBatch, lo: int, hi: int) -> ForwardBatch:
    """Requests [lo, hi) of ``batch`` as a batch of their own."""
    off = batch.offsets
    sl = slice(lo, hi)
    opt = {
        n: None if getattr(batch, n) is None else getattr(batch, n)[sl]
        for n in ("verify_lens", "draft", "temperature", "decoder_floor", "snapshot_pos")
    }
    return ForwardBatch(
        token_ids=batch.token_ids[off[lo] : off[hi]],
        query_lens=batch.query_lens[sl],
        start_pos=batch.start_pos[sl],
        block_tables=batch.block_tables[sl],
        state_slots=batch.state_slots[sl],
        num_logits=batch.num_logits[sl],
        **opt,
    )


def invariant_rows(executor: object) -> int:
    """The executor's batch-invariant chunk rows (model.invariant; 0: it has none, or they are off)."""
    return int(executor.invariant_rows or 0) if isinstance(executor, InvariantRows) else 0


def enable_invariant_rows(executor: object) -> None:
    """Switch the executor's batch-invariant products on (its device's default chunk), if it has them."""
    if isinstance(executor, InvariantRows) and not executor.invariant_rows:
        executor.invariant_rows = default_rows(executor.device)


def _spec_field(out: ForwardOutput, name: str, r: int) -> np.ndarray:
    """A DSpark output of ``out`` as numpy (filled with "nothing" when no row drafted or verified)."""
    v = getattr(out, name)
    if v is not None:
        return v.detach().cpu().numpy()
    if name in ("drafts", "draft_confidence"):
        return np.full((r, 5), -1 if name == "drafts" else np.nan)
    return np.full(r, 0 if name == "num_accepted" else -1)
