"""The engine's model side of a step: a plan's rows -> ``ForwardBatch`` -> ``ModelExecutor.execute`` ->
sampled tokens (and, with DSpark, the verified rows' accepted drafts).

A mixin of :class:`~deepinfer_core.engine.engine.LLMEngine` (it uses the engine's pools, tables and
executor); the request lifecycle and the step loop stay in ``engine.py``, masking and sampling are in
``sample.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deepinfer_core.device_tokens import DeviceTokens, TokenFeed, h2d
from deepinfer_core.engine.overlap import Overlap, PendingStep
from deepinfer_core.engine.prefix import known_tokens
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.structured_spec import VerifyMasks
from deepinfer_core.model import BatchError, ForwardBatch, ForwardOutput
from deepinfer_core.scheduler import Plan, StepType

log = logging.getLogger("deepinfer_core.engine.engine")


class StepRunner(Overlap):
    """Batch build, execution and draft collection for one plan (``_run``)."""

    # attributes of the engine this mixin reads (set by LLMEngine.__init__)
    stats: Any
    drafts: DraftBook | None
    executor: Any
    state_pool: Any
    batch_invariant: bool
    _seqs: Any
    _reqs: dict
    _by_seq: dict
    _grammar: Any
    _apply_mask: Any
    prefix: Any
    _snapshots: Any
    # the engine's methods this mixin calls (LLMEngine and RowSampler define them)
    _fail_row: Callable[[int, str], None]
    _sample_rows: Callable[..., np.ndarray]
    _sample_device: Callable[..., torch.Tensor]
    _grammar_commit: Callable[..., bool]

    def _run(self, plan: Plan, prev: PendingStep | None = None,
             overlap: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray] | PendingStep:
        """Execute ``plan`` and sample. Returns one token per plan row (0 for rows that sample nothing),
        or with speculation (flat tokens, count per row): a verify row yields its accepted drafts and
        the executor's next token. ``overlap`` (engine/overlap.py): the tokens stay on the device (a
        :class:`PendingStep`, landed by the caller); placeholders sampled by the in-flight step ``prev``
        are fed from it on the device."""
        st, seqs, book = self.stats, self._seqs, self.drafts
        t0 = time.perf_counter()
        for rid in plan.preempted:  # its caches restart at position 0 when it is admitted again
            seq = self._reqs[rid].seq if rid in self._reqs else -1
            if seq >= 0 and self.state_pool.contains(seq):
                self.state_pool.release(seq)
            if seq >= 0 and book is not None:
                book.drop(seq)  # the executor forgets its drafts when the slot restarts
            if seq >= 0 and self.prefix is not None:
                self.prefix.drop(seq)  # it re-hits its own prefix when it is admitted again
        seq_ids = plan.seq_ids
        ix = seqs.ix(seq_ids)  # each row's place in the per-sequence arrays
        ntok = plan.num_tokens.astype(np.int64)
        tokens = plan.token_ids.astype(np.int64)
        if book is not None:
            book.fill(plan, tokens, seq_ids)
        # one step ahead: placeholders are the token the previous step sampled for that sequence (on
        # the host, or with the overlap still on the device: fed_pos / fed_src)
        fed_pos, fed_src = self._fill_holes(tokens, seq_ids, ix, ntok, prev)
        # only a sequence's first chunk (an admission: new, or recomputed after preemption; it starts
        # after its shared prefix hit) needs a slot; every later row holds one already, so this is no
        # per-row loop in decode steps
        for r in np.flatnonzero((plan.cached >= 0) & ~seqs.dead[ix]).tolist():
            seq = int(seq_ids[r])
            if not self.state_pool.contains(seq) and self.state_pool.acquire(seq) is None:
                # cannot happen while slots are returned before seats (see _end); fail it alone if it does
                log.error("engine: no free state slot for seq %d (%d slots)", seq, self.state_pool.num_slots)
                self._fail_row(seq, f"no free state slot ({self.state_pool.num_slots} slots)")
        rows = np.flatnonzero(~seqs.dead[ix])  # rows of requests that already ended are discarded
        pre = None  # prefix caching: hit tokens skipped, encoder-only parts run, the tail's decoder floor
        if self.prefix is not None and rows.size:
            pre = self.prefix.prepare(plan.step_type == StepType.PREFILL, rows, seq_ids, plan.start, ntok, tokens,
                                      plan.block_tables, self.state_pool.slots, lambda q: known_tokens(self, q),
                                      plan.cached)
            for seq, msg in pre.failed:
                self._fail_row(seq, msg)
            rows = pre.rows
        sampled = np.zeros(plan.num_rows, np.int32)
        nd = plan.num_drafts.astype(np.int64)
        # rows whose token comes from the executor (greedy verify / draft); the rest sample here
        spec_row = (plan.sample > 0) & (DraftBook.eligible(seqs, ix) if book is not None else False)
        got: dict[int, list[int]] = {}
        pending: PendingStep | None = None
        while rows.size:
            keep_row = np.zeros(plan.num_rows, bool)  # a mask of ``rows`` (np.isin's sort: not needed)
            keep_row[rows] = True
            tok_keep = np.repeat(keep_row, ntok)
            qn, qs = (ntok, plan.start) if pre is None else (pre.ntok, pre.start)
            spec_kw: dict[str, Any] = {}
            if pre is not None:
                tok_keep &= pre.tok_mask
                spec_kw.update(decoder_floor=pre.floor[rows], snapshot_pos=pre.snap[rows])
            if book is not None:
                spec_kw.update(verify_lens=nd[rows], draft=spec_row[rows],
                               temperature=np.where(spec_row[rows], seqs.temperature[ix[rows]], 0.0))
                self._spec_masks(plan, rows, spec_row, tokens, ntok, ix)
            batch = ForwardBatch(token_ids=tokens[tok_keep], query_lens=qn[rows], start_pos=qs[rows],
                                 block_tables=plan.block_tables[rows], state_slots=self.state_pool.slots(seq_ids[rows]),
                                 num_logits=plan.sample[rows] + nd[rows], **spec_kw)
            feed = self._batch_feed(fed_pos, fed_src, tok_keep, prev)
            st.build_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                logits, spec_out = self._execute(batch, feed)
            except BatchError as e:  # one bad request: fail it, rerun the others (nothing was written)
                self._spec_masks_off()
                if e.request is None:
                    raise
                self._fail_row(int(seq_ids[rows[e.request]]), f"executor refused the request: {e}")
                rows = np.delete(rows, e.request)
                continue
            self._spec_masks_off()
            st.execute_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            last = np.cumsum(batch.num_logits) - 1  # each request's last logits row
            plain = np.flatnonzero((plan.sample[rows] > 0) & ~spec_row[rows])
            srows = rows[plain]
            lg = logits[h2d(last[plain], logits.device)]
            pos = plan.context_lens[srows].astype(np.int64)
            if overlap:  # the tokens stay on the device; engine/overlap.py lands them after the next launch
                tok_t = self._sample_device(lg, seq_ids[srows], ix[srows], pos)
                pending = PendingStep(srows.astype(np.int64), seq_ids[srows].astype(np.int64), DeviceTokens(tok_t),
                                      plan.num_rows)
            else:
                sampled[srows] = self._sample_rows(lg, seq_ids[srows], ix[srows], pos)
            if book is not None:
                got = self._collect(plan, rows, spec_row, spec_out, tokens, ntok, ix)
            if pre is not None:  # publish completed exact blocks and the encoder rings at their end
                starts = np.concatenate(([0], np.cumsum(ntok)[:-1])).astype(np.int64)
                first = tokens[starts]
                if fed_pos.size and prev is not None:  # fed from the device: its value (waits for prev only)
                    r_fed = np.searchsorted(starts, fed_pos).clip(max=starts.size - 1)
                    at_start = starts[r_fed] == fed_pos  # a placeholder is a row's first token
                    r_fed, src = r_fed[at_start], fed_src[at_start]
                    need = (pre.snap[r_fed] > 0) if pre.decode else np.ones(r_fed.shape, bool)
                    need &= keep_row[r_fed]  # == np.isin(r_fed, rows): r_fed are plan rows
                    if need.any():  # after this step's launch: the device is busy meanwhile
                        first[r_fed[need]] = prev.tokens.host()[src[need]]
                self.prefix.after(pre, rows, seq_ids, plan.block_tables, self._snapshots,
                                  lambda q: known_tokens(self, q), first)
            st.sample_s += time.perf_counter() - t0
            break
        if pending is not None:
            return pending
        if book is None:
            return sampled
        flat: list[int] = []
        counts = np.zeros(plan.num_rows, np.int32)
        for i in range(plan.num_rows):
            if i in got:
                flat += got[i]
                counts[i] = len(got[i])
            elif plan.sample[i]:  # sampled here, or a dropped row (its request ended: the token is ignored)
                flat.append(int(sampled[i]))
                counts[i] = 1
        return np.asarray(flat, np.int32), counts

    def _spec_masks(self, plan: Plan, rows: np.ndarray, spec_row: np.ndarray, tokens: np.ndarray,
                    ntok: np.ndarray, ix: np.ndarray) -> None:
        """Before the executor verifies: grammar masks for structured spec rows, and every spec row's seed
        (verification keyed by (seed, position)); engine/structured_spec.py, SpecState.counter_seeds."""
        spec = self.executor.spec
        self._verify_masks = None
        self._spec_masks_off()  # nothing of an earlier step's (e.g. one that raised) may stay
        if spec is None:
            return
        sr = rows[spec_row[rows]]
        if sr.size == 0:
            return
        slots = self.state_pool.slots(plan.seq_ids[sr])
        spec.counter_seeds = {int(sl): int(self._seqs.seed[ix[i]]) for sl, i in zip(slots.tolist(), sr.tolist())}
        con = [(int(sl), int(i)) for sl, i in zip(slots.tolist(), sr.tolist()) if self._seqs.structured[ix[i]]]
        if not con:
            return
        ends = np.cumsum(ntok)
        items = []
        for sl, i in con:
            k = int(plan.num_drafts[i])
            items.append((sl, self._by_seq[int(plan.seq_ids[i])].request_id, tokens[ends[i] - k : ends[i]].tolist()))
        vm = VerifyMasks(self._grammar, self._apply_mask)
        vm.build(items)
        for rid in vm.dead:
            req = self._reqs[rid]
            req.reason, req.error = str(self._grammar.finish_reason(rid)), "grammar dead end: no token can continue"
        self._verify_masks = vm
        spec.logits_hook = vm.hook

    def _spec_masks_off(self) -> None:
        spec = self.executor.spec
        if spec is not None:
            spec.logits_hook = None
            spec.counter_seeds = None

    def _collect(self, plan: Plan, rows: np.ndarray, spec_row: np.ndarray, out: dict[str, np.ndarray],
                 tokens: np.ndarray, ntok: np.ndarray, ix: np.ndarray) -> dict[int, list[int]]:
        """Executor-verified rows: [accepted drafts..., next token] per plan row; keep the new drafts."""
        book, seqs = self.drafts, self._seqs
        assert book is not None
        ends = np.cumsum(ntok)
        got: dict[int, list[int]] = {}
        for j, i in enumerate(rows.tolist()):
            if not spec_row[i]:
                continue
            k, a, seq = int(plan.num_drafts[i]), int(out["num_accepted"][j]), int(plan.seq_ids[i])
            row = [*tokens[ends[i] - k : ends[i] - k + a].tolist(), int(out["next_token"][j])]
            req = self._by_seq[seq]
            if self._verify_masks is not None and req.request_id in self._verify_masks.dead:
                row = [-1]  # the grammar allows no token: the scheduler fails the request (reason set)
                seqs.dead[ix[i]] = True
            elif seqs.structured[ix[i]]:
                self._grammar_commit(req, int(ix[i]), row)
            if row[-1] >= 0:
                self._feed_stops(req, int(ix[i]), row)
            got[i] = row
            book.verified += k
            book.accepted += a
            req.drafts_verified += k
            req.drafts_accepted += a
            book.store(seq, out["drafts"][j], out["draft_confidence"][j])
            seqs.last_token[ix[i]] = row[-1]
            seqs.n_out[ix[i]] += len(row)
            self.stats.tokens_sampled += len(row)
        return got

    def _execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Logits of the sampled rows, request by request, and the DSpark outputs (numpy; empty when
        nothing drafts or verifies). ``feed``: batch tokens still on the device (engine/overlap.py)."""
        kw = {} if feed is None else {"feed": feed}  # executors without the overlap keep their one-argument call
        if not self.batch_invariant or batch.num_requests == 1:
            outs = [self.executor.execute(batch, **kw)]
        else:
            # batch-invariant mode: every request alone, so no kernel's reduction order depends on the batch
            self.executor.validate(batch)  # refuse before any cache is written, as a batched call would
            off = batch.offsets
            outs = []
            for i in range(batch.num_requests):
                sl = slice(i, i + 1)
                opt = {n: None if getattr(batch, n) is None else getattr(batch, n)[sl]
                       for n in ("verify_lens", "draft", "temperature", "decoder_floor", "snapshot_pos")}
                one = ForwardBatch(token_ids=batch.token_ids[off[i]:off[i + 1]], query_lens=batch.query_lens[sl],
                                   start_pos=batch.start_pos[sl], block_tables=batch.block_tables[sl],
                                   state_slots=batch.state_slots[sl], num_logits=batch.num_logits[sl], **opt)
                sub = {} if feed is None else {"feed": feed.sub(int(off[i]), int(off[i + 1]))}
                outs.append(self.executor.execute(one, **sub))
        logits = outs[0].logits if len(outs) == 1 else torch.cat([o.logits for o in outs])
        self._snapshots = (outs[0].snapshots if len(outs) == 1
                           else {i: o.snapshots[0] for i, o in enumerate(outs) if o.snapshots})
        spec: dict[str, np.ndarray] = {}
        if self.drafts is not None:
            for name in ("num_accepted", "next_token", "drafts", "draft_confidence"):
                parts = [_spec_field(o, name, batch.num_requests if len(outs) == 1 else 1) for o in outs]
                spec[name] = np.concatenate(parts)
        return logits, spec


def _spec_field(out: ForwardOutput, name: str, r: int) -> np.ndarray:
    """A DSpark output of ``out`` as numpy (filled with "nothing" when no row drafted or verified)."""
    v = getattr(out, name)
    if v is not None:
        return v.detach().cpu().numpy()
    if name in ("drafts", "draft_confidence"):
        return np.full((r, 5), -1 if name == "drafts" else np.nan)
    return np.full(r, 0 if name == "num_accepted" else -1)
