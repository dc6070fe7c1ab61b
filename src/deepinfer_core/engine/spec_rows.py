"""The speculative side of a step (DSpark): before the executor verifies, every verify row's seed and the
grammar masks of structured verify rows; after it, each verified row's ``[accepted drafts..., next token]``
collected and the new drafts kept (engine/speculative.py has who drafts and how many are verified)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from deepinfer_core.engine.request_table import EndHow, RequestTable
from deepinfer_core.engine.sample import TokenSampler
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.structured_spec import VerifyMasks
from deepinfer_core.kv import StatePool
from deepinfer_core.protocols import SpecControl
from deepinfer_core.scheduler import Plan

log = logging.getLogger(__name__)


class SpecRows:
    """Verify rows around the executor call: ``masks_on`` / ``masks_off`` and ``collect``."""

    def __init__(
        self,
        book: DraftBook,
        table: RequestTable,
        sampler: TokenSampler,
        state_pool: StatePool,
        apply_mask: Callable[..., Any],
    ) -> None:
        self.book = book
        self.table = table
        self.sampler = sampler
        self.state_pool = state_pool
        self.apply_mask = apply_mask
        self.verify_masks: VerifyMasks | None = None  # this step's grammar masks of verify rows

    def masks_on(
        self,
        spec: SpecControl | None,
        plan: Plan,
        rows: np.ndarray,
        spec_row: np.ndarray,
        tokens: np.ndarray,
        ntok: np.ndarray,
        ix: np.ndarray,
    ) -> None:
        """Before the executor verifies: grammar masks for structured spec rows, and every spec row's seed
        (verification keyed by (seed, position)); engine/structured_spec.py, SpecControl.counter_seeds."""
        self.verify_masks = None
        self.masks_off(spec)  # nothing of an earlier step's (e.g. one that raised) may stay
        if spec is None:
            return
        seqs = self.table.seqs
        sr = rows[spec_row[rows]]
        if sr.size == 0:
            return
        slots = self.state_pool.slots(plan.seq_ids[sr])
        spec.counter_seeds = {int(sl): int(seqs.seed[ix[i]]) for sl, i in zip(slots.tolist(), sr.tolist())}
        con = [(int(sl), int(i)) for sl, i in zip(slots.tolist(), sr.tolist()) if seqs.structured[ix[i]]]
        if not con:
            return
        ends = np.cumsum(ntok)
        items = []
        for sl, i in con:
            k = int(plan.num_drafts[i])
            items.append(
                (
                    sl,
                    self.table.by_seq[int(plan.seq_ids[i])].request_id,
                    tokens[ends[i] - k : ends[i]].tolist(),
                )
            )
        g = self.table.grammars.manager
        vm = VerifyMasks(g, self.apply_mask)
        vm.build(items)
        for rid in vm.dead:  # its row 0 allows nothing: the scheduler fails it on this step's token
            assert g is not None
            self.table.end(
                self.table.reqs[str(rid)],
                str(g.finish_reason(rid)),
                "grammar dead end: no token can continue",
                EndHow.BY_TOKEN,
            )
        self.verify_masks = vm
        spec.logits_hook = vm.hook

    @staticmethod
    def masks_off(spec: SpecControl | None) -> None:
        if spec is not None:
            spec.logits_hook = None
            spec.counter_seeds = None

    def collect(
        self,
        plan: Plan,
        rows: np.ndarray,
        spec_row: np.ndarray,
        out: dict[str, np.ndarray],
        tokens: np.ndarray,
        ntok: np.ndarray,
        ix: np.ndarray,
    ) -> dict[int, list[int]]:
        """Executor-verified rows (``out``: the executor's DSpark outputs for the batch of ``rows``):
        [accepted drafts..., next token] per plan row; keep the new drafts."""
        book, seqs = self.book, self.table.seqs
        ends = np.cumsum(ntok)
        got: dict[int, list[int]] = {}
        for j, i in enumerate(rows.tolist()):
            if not spec_row[i]:
                continue
            k, a, seq = int(plan.num_drafts[i]), int(out["num_accepted"][j]), int(plan.seq_ids[i])
            row = [*tokens[ends[i] - k : ends[i] - k + a].tolist(), int(out["next_token"][j])]
            req = self.table.by_seq[seq]
            if self.verify_masks is not None and req.request_id in self.verify_masks.dead:
                row = [-1]  # the grammar allows no token: the scheduler fails the request (ended in masks_on)
            elif seqs.structured[ix[i]]:
                self.sampler.grammar_commit(req, row)
            if row[-1] >= 0:
                self.sampler.feed_stops(req, row)
            got[i] = row
            book.verified += k
            book.accepted += a
            req.drafts_verified += k  # the request's own counts (its output's metrics)
            req.drafts_accepted += a
            book.store(seq, out["drafts"][j], out["draft_confidence"][j])
            seqs.last_token[ix[i]] = row[-1]
            seqs.n_out[ix[i]] += len(row)
        return got
