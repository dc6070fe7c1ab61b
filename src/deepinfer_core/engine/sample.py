"""The engine's token side of a step: min_tokens bans and grammar masks on the logits, the batch-invariant
sampler, then each constrained request's grammar advanced and its stop strings fed.

A mixin of :class:`~deepinfer_core.engine.engine.LLMEngine`; see ``run.py`` for the model side.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from deepinfer_core.device_tokens import h2d
from deepinfer_core.engine.outputs import ERROR, STOP, VIOLATION
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_kernels.ops.sampling import greedy_tokens

log = logging.getLogger("deepinfer_core.engine.engine")


class RowSampler:
    """``_sample_rows`` and the grammar / stop-string bookkeeping around it."""

    # attributes of the engine this mixin reads (set by LLMEngine.__init__)
    stats: Any
    tokenizer: Any
    vocab_size: int
    _seqs: Any
    _reqs: dict
    _by_seq: dict
    _grammar: Any
    _to_abort: list
    _sample: Any
    _apply_mask: Any
    _stops: dict[str, Any]

    def _sample_rows(self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Mask (min_tokens, grammar) and sample one token per logits row; advance the grammars.
        ``seq``: the rows' seq ids; ``ix``: their places in the per-sequence arrays."""
        s = self._seqs
        n = seq.shape[0]
        if n == 0:
            return np.zeros(0, np.int32)
        self._ban_early(logits, seq, ix)
        con = np.flatnonzero(s.structured[ix])
        failed = np.zeros(n, bool)  # rows whose grammar raised: they fail alone
        dead_end = np.zeros(0, np.int64)
        if con.size:
            full, dead_end = self._grammar_masks(seq, con, n, failed)
            self._apply_mask(logits, full, torch.as_tensor(con))
        tok = self._draw(logits, ix, positions).cpu().numpy().astype(np.int64)
        for r in dead_end.tolist():  # the grammar allows no token: the request ends (FAILED -> reason below)
            req = self._by_seq[int(seq[r])]
            req.reason, req.error = str(self._grammar.finish_reason(req.request_id)), "grammar dead end: no token can continue"
            tok[r] = -1  # the scheduler fails the request on a negative token
            s.dead[ix[r]] = True  # a row already planned one step ahead is dropped
        tok[failed] = -1
        s.last_token[ix] = tok
        s.n_out[ix] += 1
        self.stats.tokens_sampled += n
        for r in con.tolist():
            t = int(tok[r])
            if t < 0:
                continue
            req = self._by_seq[int(seq[r])]
            g = self._grammar
            try:
                g.advance(req.request_id, [t])
                why = g.finish_reason(req.request_id)
            except Exception as e:  # a grammar library error fails that request alone
                req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
                tok[r] = -1
                s.dead[ix[r]] = True
                continue
            if why is None:
                continue
            s.dead[ix[r]] = True  # the grammar is done: a row already planned one step ahead is dropped
            # the grammar accepted its end: EOS was sampled, which the scheduler stops on unless
            # ignore_eos; then the engine ends it itself once this token is applied
            if req.params.ignore_eos or str(why) != STOP:
                req.reason = str(why)
                if str(why) == VIOLATION:  # the document check failed: say what it found
                    req.error = f"SamplingParams.so_args: {g.error(req.request_id)}"
                elif str(why) != STOP:
                    lib = g.error(req.request_id)  # the library's own message, when it failed itself
                    req.error = f"grammar: {why}" if not lib else f"SamplingParams.so_args: grammar library error: {lib}"
                    if lib:
                        req.reason = ERROR
                self._to_abort.append(req.request_id)
        if self._stops:
            for r in range(n):
                if tok[r] >= 0:
                    self._feed_stops(self._by_seq[int(seq[r])], int(ix[r]), [int(tok[r])])
        return tok.astype(np.int32)

    def _sample_device(self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """``_sample_rows`` for the asynchronous overlap: the tokens stay a device tensor (never read back
        here). Only for rows that need no host token value before the next step: no grammar (the caller
        keeps structured steps synchronous). The host side (last token, stop strings) runs when the
        tokens land (``Overlap._land``); the counts move now, so the next step's min_tokens bans see
        this token as sampled, exactly as in the synchronous path."""
        self._ban_early(logits, seq, ix)
        tok_t = self._draw(logits, ix, positions)
        self._seqs.n_out[ix] += 1
        self.stats.tokens_sampled += seq.shape[0]
        return tok_t

    def _ban_early(self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray) -> None:
        """EOS and stop tokens may not end the text before min_tokens: one indexed write for every such
        row, its indices copied without a stream synchronisation (the step may still be running)."""
        s = self._seqs
        early = np.flatnonzero(s.n_out[ix] < s.min_tokens[ix])
        if early.size == 0:
            return
        rr: list[int] = []
        cc: list[int] = []
        for r in early.tolist():
            req = self._by_seq[int(seq[r])]
            ban = ([] if req.params.ignore_eos else [self.tokenizer.eos_token_id]) + list(req.params.stop_token_ids)
            rr += [r] * len(ban)
            cc += ban
        if rr:
            logits[h2d(np.asarray(rr), logits.device), h2d(np.asarray(cc), logits.device)] = float("-inf")

    def _draw(self, logits: torch.Tensor, ix: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """One token per (masked) logits row, on the logits' device: no host synchronisation."""
        s, dev = self._seqs, logits.device
        if (s.temperature[ix] > 0).any():
            return self._sample(logits, h2d(s.temperature[ix], dev), h2d(s.top_k[ix], dev),
                                h2d(s.top_p[ix], dev), h2d(s.seed[ix], dev), h2d(positions, dev))
        # every row greedy (known on the host): the sampler's argmax without its full sort and RNG
        return greedy_tokens(logits)

    def _feed_stops(self, req: EngineRequest, ixr: int, toks: list[int]) -> None:
        """Stop strings (engine/stops.py): a match ends the request once these tokens are applied."""
        stops = self._stops.get(req.request_id)
        if stops is None or stops.hit is not None or req.reason is not None:  # already ending otherwise
            return
        if stops.feed(toks) is not None:
            req.reason = STOP
            self._seqs.dead[ixr] = True  # a row already planned one step ahead is dropped
            self._to_abort.append(req.request_id)

    def _grammar_commit(self, req: EngineRequest, ixr: int, toks: list[int]) -> bool:
        """A verify row's tokens into the request's grammar (as ``_sample_rows`` does for one token);
        False when the request ended here."""
        g = self._grammar
        try:
            g.advance(req.request_id, toks)
            why = g.finish_reason(req.request_id)
        except Exception as e:  # a grammar library error fails that request alone
            self._seqs.dead[ixr] = True
            req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
            self._to_abort.append(req.request_id)
            return False
        if why is None:
            return True
        self._seqs.dead[ixr] = True
        if req.params.ignore_eos or str(why) != STOP:
            req.reason = str(why)
            if str(why) != STOP:
                lib = g.error(req.request_id)
                req.error = f"SamplingParams.so_args: {lib}" if lib else f"grammar: {why}"
            self._to_abort.append(req.request_id)
        return False

    def _grammar_masks(self, seq: np.ndarray, con: np.ndarray, n: int,
                       failed: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Bitmask rows for the constrained rows ``con`` (others allow all) and the dead-end rows. The
        batch is filled in one call; if the library raises, row by row, so only the failing requests
        fail (marked in ``failed``, their rows allow nothing)."""
        g = self._grammar
        rids = [self._by_seq[int(q)].request_id for q in seq[con]]
        try:
            masks = g.fill_bitmask([(rid, ()) for rid in rids])
            full = torch.full((n, masks.bitmask.shape[1]), -1, dtype=torch.int32)
            full[torch.as_tensor(con)] = masks.bitmask
            return full, con[masks.dead_end]
        except Exception:  # find the request(s) at fault
            log.exception("engine: grammar fill failed for a batch of %d; retrying request by request", len(rids))
        full = torch.full((n, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        dead: list[int] = []
        for r, rid in zip(con.tolist(), rids):
            try:
                m = g.fill_bitmask([(rid, ())])
            except Exception as e:
                req = self._reqs[rid]
                req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
                self._seqs.dead[self._seqs.row(req.seq)] = True
                failed[r] = True
                full[r] = 0
                continue
            full[r] = m.bitmask[0]
            if m.dead_end[0]:
                dead.append(r)
        return full, np.asarray(dead, np.int64)
