"""Speculative decoding for structured (greedy) requests: verify rows masked by the grammar.

A structured request that drafts feeds ``k`` unconstrained DSpark drafts; before the executor verifies
them, its ``k + 1`` verify logits rows are masked with the manager's draft rows
(``StructuredOutputManager.fill_bitmask([(rid, drafts)])``: row ``j`` is the mask after accepting drafts
``1..j``). Verification then accepts exactly the drafts the masked target would have produced itself
(greedy: a draft is accepted iff it is the masked argmax), and the next token comes from the masked row
at the first rejection, so the output equals the same request decoded without speculation.

Rows past the grammar's cut repeat the last valid row (the manager's rule); a draft the grammar refuses
is rejected by its masked row anyway. A draft the row allows but that leads to a dead state (no token
can follow) is cut by the manager one row earlier than verification would see it, so its bit is cleared
in that row: the masked target then never takes a token that dead-ends the grammar. A request whose row
0 is dead is left unmasked here (its tokens are discarded: the engine ends it with the dead end).

The masks reach the executor through ``SpecState.logits_hook``, keyed by state slot, so they hold in
the batched and in the batch-invariant (one executor call per request) modes alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch


class VerifyMasks:
    """This step's grammar masks for the verify rows of structured requests, by state slot."""

    def __init__(self, grammar: Any, apply_mask: Any) -> None:
        self._grammar = grammar
        self._apply = apply_mask
        self._masks: dict[int, torch.Tensor] = {}
        self.dead: list[Hashable] = []  # request ids whose row 0 allowed nothing (ended by the engine)

    def build(self, items: Sequence[tuple[int, Hashable, Sequence[int]]]) -> None:
        """``items``: (state slot, request id, the drafts fed this step) per structured spec row."""
        self._masks.clear()
        self.dead = []
        if not items:
            return
        bm = self._grammar.fill_bitmask([(rid, list(map(int, d))) for _, rid, d in items])
        rows = bm.bitmask.clone()  # the manager's buffer is reused by its next call
        for j, (slot, rid, drafts) in enumerate(items):
            lo, hi = int(bm.offsets[j]), int(bm.offsets[j + 1])
            if bm.dead_end[j]:
                self.dead.append(rid)
                continue
            m = rows[lo:hi]
            k = int(bm.num_drafts[j])
            if k < len(drafts):  # refuse the cut draft in the row before it (see the module docstring)
                t = int(drafts[k])
                m[k, t // 32] = int(m[k, t // 32]) & ~(1 << (t % 32))  # stays in int32 range
            self._masks[slot] = m

    def hook(self, b: Any, logits: torch.Tensor) -> None:
        """``SpecState.logits_hook``: mask the verify rows (and the bonus row) of structured requests."""
        if not self._masks:
            return
        ends = np.cumsum(b.num_logits)
        vl = b.verify_lens
        for i in range(b.num_requests):
            m = self._masks.get(int(b.state_slots[i]))
            if m is None:
                continue
            v = 0 if vl is None else int(vl[i])
            rows = logits[int(ends[i]) - v - 1 : int(ends[i])]
            self._apply(rows, m[: v + 1])

    def clear(self) -> None:
        self._masks.clear()
        self.dead = []
