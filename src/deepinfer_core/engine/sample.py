"""The engine's token side of a step: min_tokens bans and grammar masks on the logits, the batch-invariant
sampler, then each constrained request's grammar advanced and its stop strings fed.

``TokenSampler`` is owned by the engine and called by ``StepRunner`` (engine/run.py); a request that its
grammar or a stop string ends is ended through ``RequestTable.end``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deepinfer_core.device_tokens import h2d
from deepinfer_core.engine.grammar import Grammars
from deepinfer_core.engine.outputs import ERROR, STOP, VIOLATION
from deepinfer_core.engine.request_table import EndHow, RequestTable
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_core.protocols import Tokenizer
from deepinfer_kernels.ops.sampling import greedy_tokens

log = logging.getLogger(__name__)


class TokenSampler:
    """``sample_rows`` (host tokens) / ``sample_device`` (the overlap's device tokens) and the grammar /
    stop-string bookkeeping around them."""

    def __init__(
        self,
        table: RequestTable,
        grammars: Grammars,
        tokenizer: Tokenizer,
        vocab_size: int,
        sample_op: Callable[..., torch.Tensor],
        apply_mask_op: Callable[..., Any],
    ) -> None:
        self.table = table
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.sample_op = sample_op
        self.apply_mask = apply_mask_op

    def sample_rows(
        self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """Mask (min_tokens, grammar) and sample one token per logits row; advance the grammars.
        ``seq``: the rows' seq ids; ``ix``: their places in the per-sequence arrays."""
        s = self.table.seqs
        n = seq.shape[0]
        if n == 0:
            return np.zeros(0, np.int32)
        con, failed, dead_end = self._mask(logits, seq, ix)
        tok = self._draw(logits, ix, positions).cpu().numpy().astype(np.int64)
        self._end_dead(seq, dead_end)
        tok[dead_end] = -1
        tok[failed] = -1
        s.last_token[ix] = tok
        s.n_out[ix] += 1
        for r in con.tolist():
            if tok[r] >= 0 and not self._advance(self.table.by_seq[int(seq[r])], int(tok[r])):
                tok[r] = -1
        if self.table.stops:
            for r in range(n):
                if tok[r] >= 0:
                    self.feed_stops(self.table.by_seq[int(seq[r])], [int(tok[r])])
        return tok.astype(np.int32)

    def _advance(self, req: EngineRequest, t: int) -> bool:
        """One sampled token into the request's grammar; False when the grammar library failed (the
        request fails on this token). A grammar that ended here ends its request."""
        g = self.grammars.manager
        assert g is not None
        try:
            g.advance(req.request_id, [t])
            why = g.finish_reason(req.request_id)
        except Exception as e:  # a grammar library error fails that request alone
            self.table.end(req, ERROR, f"SamplingParams.so_args: grammar library error: {e}", EndHow.BY_TOKEN)
            return False
        if why is None:
            return True
        # the grammar accepted its end: EOS was sampled, which the scheduler stops on unless ignore_eos;
        # then the engine ends it itself once this token is applied
        if not (req.params.ignore_eos or str(why) != STOP):
            self.table.end(req, how=EndHow.BY_TOKEN)
            return True
        reason, error = str(why), None
        if str(why) == VIOLATION:  # the document check failed: say what it found
            error = f"SamplingParams.so_args: {g.error(req.request_id)}"
        elif str(why) != STOP:
            lib = g.error(req.request_id)  # the library's own message, when it failed itself
            error = f"grammar: {why}" if not lib else f"SamplingParams.so_args: grammar library error: {lib}"
            if lib:
                reason = ERROR
        self.table.end(req, reason, error, EndHow.AFTER_UPDATE)
        return True

    def sample_device(
        self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray, positions: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """``sample_rows`` for the asynchronous overlap: the tokens stay a device tensor (never read back
        here), with a bool per row: the request ended on this token (-1). Structured rows are masked as in
        ``sample_rows`` (their grammars must have taken every earlier token: the runner lands the previous
        step first, ``StepOrder.land_early``); rows of requests that ended meanwhile are not masked (their
        tokens are dropped when they land). The host side (last token, grammars, stop strings) runs when the
        tokens land (``advance_grammars``, ``engine/overlap.py``); the counts move now, so the next step's
        min_tokens bans see this token as sampled, exactly as in the synchronous path."""
        _, ended, dead_end = self._mask(logits, seq, ix)
        tok_t = self._draw(logits, ix, positions)
        self._end_dead(seq, dead_end)
        ended[dead_end] = True
        if ended.any():  # on the device, without reading the tokens back
            tok_t = tok_t.masked_fill(h2d(ended, tok_t.device), -1)
        self.table.seqs.n_out[ix] += 1
        return tok_t, ended

    def _mask(
        self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """min_tokens bans and the grammar masks of the live structured rows, in place on ``logits``:
        (the masked rows, bool per row whose grammar raised (ended: it fails alone), the dead-end rows)."""
        s = self.table.seqs
        n = seq.shape[0]
        self.ban_early(logits, seq, ix)
        failed = np.zeros(n, bool)
        dead_end = np.zeros(0, np.int64)
        if self.grammars.manager is None:
            return dead_end, failed, dead_end
        con = np.flatnonzero(s.structured[ix] & ~s.dead[ix])
        if con.size:
            full, dead_end = self._grammar_masks(seq, con, n, failed)
            self.apply_mask(logits, full, torch.as_tensor(con))
        return con, failed, dead_end

    def _end_dead(self, seq: np.ndarray, dead_end: np.ndarray) -> None:
        """The grammar allows no token: the scheduler fails each such request on its negative token."""
        g = self.grammars.manager
        for r in dead_end.tolist():
            assert g is not None
            req = self.table.by_seq[int(seq[r])]
            self.table.end(
                req,
                str(g.finish_reason(req.request_id)),
                "grammar dead end: no token can continue",
                EndHow.BY_TOKEN,
            )

    def advance_grammars(self, seq: np.ndarray, ix: np.ndarray, tok: np.ndarray) -> np.ndarray:
        """Landed tokens of live rows (``seq``, ``ix``) into their requests' grammars, as ``sample_rows``
        does after it samples; the tokens with -1 where a grammar library failed (the request ended)."""
        s = self.table.seqs
        con = np.flatnonzero(s.structured[ix] & (tok >= 0))
        if con.size == 0:
            return tok
        tok = tok.copy()
        for r in con.tolist():
            if not self._advance(self.table.by_seq[int(seq[r])], int(tok[r])):
                tok[r] = -1
        return tok

    def ban_early(self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray) -> None:
        """EOS and stop tokens may not end the text before min_tokens: one indexed write for every such
        row, its indices copied without a stream synchronisation (the step may still be running)."""
        s = self.table.seqs
        early = np.flatnonzero(s.n_out[ix] < s.min_tokens[ix])
        if early.size == 0:
            return
        rr: list[int] = []
        cc: list[int] = []
        for r in early.tolist():
            req = self.table.by_seq[int(seq[r])]
            ban = ([] if req.params.ignore_eos else [self.tokenizer.eos_token_id]) + list(
                req.params.stop_token_ids
            )
            rr += [r] * len(ban)
            cc += ban
        if rr:
            logits[h2d(np.asarray(rr), logits.device), h2d(np.asarray(cc), logits.device)] = float("-inf")

    def _draw(self, logits: torch.Tensor, ix: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """One token per (masked) logits row, on the logits' device: no host synchronisation."""
        s, dev = self.table.seqs, logits.device
        if (s.temperature[ix] > 0).any():
            return self.sample_op(
                logits,
                h2d(s.temperature[ix], dev),
                h2d(s.top_k[ix], dev),
                h2d(s.top_p[ix], dev),
                h2d(s.seed[ix], dev),
                h2d(positions, dev),
            )
        # every row greedy (known on the host): the sampler's argmax without its full sort and RNG
        return greedy_tokens(logits)

    def feed_stops(self, req: EngineRequest, toks: list[int]) -> None:
        """Stop strings (engine/stops.py): a match ends the request once these tokens are applied."""
        stops = self.table.stops.get(req.request_id)
        if stops is None or stops.hit is not None or req.reason is not None:  # already ending otherwise
            return
        if stops.feed(toks) is not None:
            self.table.end(req, STOP, None, EndHow.AFTER_UPDATE)

    def grammar_commit(self, req: EngineRequest, toks: list[int]) -> bool:
        """A verify row's tokens into the request's grammar (as ``sample_rows`` does for one token);
        False when the request ended here."""
        g = self.grammars.manager
        assert g is not None
        try:
            g.advance(req.request_id, toks)
            why = g.finish_reason(req.request_id)
        except Exception as e:  # a grammar library error fails that request alone
            self.table.end(
                req, ERROR, f"SamplingParams.so_args: grammar library error: {e}", EndHow.AFTER_UPDATE
            )
            return False
        if why is None:
            return True
        if req.params.ignore_eos or str(why) != STOP:
            error = None
            if str(why) != STOP:
                lib = g.error(req.request_id)
                error = f"SamplingParams.so_args: {lib}" if lib else f"grammar: {why}"
            self.table.end(req, str(why), error, EndHow.AFTER_UPDATE)
        else:
            self.table.end(req, how=EndHow.BY_TOKEN)
        return False

    def _grammar_masks(
        self, seq: np.ndarray, con: np.ndarray, n: int, failed: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Bitmask rows for the constrained rows ``con`` (others allow all) and the dead-end rows. The
        batch is filled in one call; if the library raises, row by row, so only the failing requests
        fail (marked in ``failed``, their rows allow nothing)."""
        g = self.grammars.manager
        assert g is not None
        rids = [self.table.by_seq[int(q)].request_id for q in seq[con]]
        try:
            masks = g.fill_bitmask([(rid, ()) for rid in rids])
            full = torch.full((n, masks.bitmask.shape[1]), -1, dtype=torch.int32)
            full[torch.as_tensor(con)] = masks.bitmask
            return full, con[masks.dead_end]
        except Exception:  # find the request(s) at fault
            log.exception(
                "engine: grammar fill failed for a batch of %d; retrying request by request", len(rids)
            )
        full = torch.full((n, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        dead: list[int] = []
        for r, rid in zip(con.tolist(), rids):
            try:
                m = g.fill_bitmask([(rid, ())])
            except Exception as e:
                self.table.end(
                    self.table.reqs[rid],
                    ERROR,
                    f"SamplingParams.so_args: grammar library error: {e}",
                    EndHow.BY_TOKEN,
                )
                failed[r] = True
                full[r] = 0
                continue
            full[r] = m.bitmask[0]
            if m.dead_end[0]:
                dead.append(r)
        return full, np.asarray(dead, np.int64)
