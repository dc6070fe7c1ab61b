"""The engine's DSpark side: which requests draft, how many drafts each step verifies, and turning the
executor's verify results into the scheduler's variable-length row results.

The executor drafts after a step (``draft[i]``) and verifies the fed drafts losslessly inside the next
``execute`` (``verify_lens[i]``); the scheduler plans rows of ``1 + k`` tokens. This module sits between
them: it keeps each sequence's last drafts and confidences, asks the policy (``spec.MTPVarlen``, or
``spec.FixedLength`` with varlen off) for per-request verify lengths, fills the plan's draft placeholders,
and collects ``[accepted drafts..., next token]`` per row.

Who drafts: once their ``min_tokens`` are out, greedy requests and requests sampled from the full
distribution (no top-k / top-p, since the executor verifies against softmax(logits / T)), structured
ones included. The engine keys every drafting row's verification by (seed, position)
(``SpecState.counter_seeds``: batch-invariant, argmax drafts) and masks structured rows' verify logits
with the grammar's draft rows (``engine/structured_spec.py``). Top-k / top-p requests and requests still
under ``min_tokens`` (the EOS / stop ban) keep plain one-token decode rows.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from deepinfer_core.engine.requests import SeqTable
from deepinfer_core.scheduler import Plan

log = logging.getLogger(__name__)


class DraftBook:
    """Per-sequence drafts of the last step that drafted, and the verify-length policy."""

    def __init__(self, policy: Any, max_drafts: int) -> None:
        self.policy = policy
        self.max_drafts = max_drafts
        self._tokens: dict[int, np.ndarray] = {}  # seq -> drafts [block] int64
        self._conf: dict[int, np.ndarray] = {}  # seq -> confidences [block] float64
        self.verified = 0  # drafts fed for verification
        self.accepted = 0  # of which accepted

    @staticmethod
    def eligible(seqs: SeqTable, ix: np.ndarray) -> np.ndarray:
        """Rows whose requests may draft / verify (see the module docstring); ``ix``: the rows' places in
        ``seqs`` (``SeqTable.ix``)."""
        # greedy, or sampled from the full distribution (no top-k / top-p: the executor verifies against
        # softmax(logits / T)); structured rows verify against grammar-masked logits (engine/structured_spec.py)
        full = (seqs.top_k[ix] < 0) & (seqs.top_p[ix] >= 1.0)
        return ((seqs.temperature[ix] <= 0) | full) & (seqs.n_out[ix] >= seqs.min_tokens[ix])

    def clear(self) -> None:
        """Forget every sequence's drafts (engine reset)."""
        self._tokens.clear()
        self._conf.clear()

    def drop(self, seq: int) -> None:
        self._tokens.pop(seq, None)
        self._conf.pop(seq, None)

    def ask(self, live: dict[int, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """(seq ids int64, drafts to verify int32) for every live sequence holding drafts with a
        non-zero verify length from the policy (``live``: seq id -> the engine's request record): the
        scheduler's array form, so no request-id mapping per row."""
        seqs = [s for s in self._tokens if s in live]
        if not seqs:
            return None
        conf = np.stack([self._conf[s][: self.max_drafts] for s in seqs])
        lengths = np.asarray(self.policy.plan(conf, None).lengths)
        keep = lengths > 0
        return np.asarray(seqs, np.int64)[keep], lengths[keep].astype(np.int32)

    def fill(self, plan: Plan, tokens: np.ndarray, seq_of_row: np.ndarray) -> None:
        """Write each verify row's drafts over its ``-1`` placeholders (``tokens`` is flat, in place)."""
        ks = plan.num_drafts
        if not ks.any():
            return
        ends = np.cumsum(plan.num_tokens.astype(np.int64))
        for i in np.flatnonzero(ks).tolist():
            k = int(ks[i])
            tokens[ends[i] - k : ends[i]] = self._tokens[int(seq_of_row[i])][:k]

    def store(self, seq: int, drafts: np.ndarray, conf: np.ndarray) -> None:
        self._tokens[seq] = drafts
        self._conf[seq] = conf

    def clear_rows(self, seqs: np.ndarray) -> None:
        for s in seqs.tolist():
            self.drop(int(s))
