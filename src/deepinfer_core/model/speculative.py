"""The executor's DSpark side: drafter context rings, lossless verification, the next draft block.

Per state slot the executor keeps, next to the target's caches, (1) one ring per draft stage of context
keys and one ring of fused target features, written for every row the target processes (indexed by
position, ``window + backtrack`` entries, so a rollback needs no undo, exactly like the SWA rings);
(2) the drafts it made last step with their distributions, so a verify step can be checked (the fed
drafts must be the ones made) and verified losslessly with ``deepinfer_core.spec.verify``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from deepinfer_core.model.batch import BatchError, ForwardBatch
from deepinfer_core.model.cache import CacheFormats
from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.model import DeepSeekV41


class SpecHost(Protocol):
    """What :class:`SpecState` uses of the executor state that owns it (``state.ExecutorState`` satisfies
    it). A protocol, so this module does not import the state module that refers to it (no import cycle)."""

    model: DeepSeekV41
    cfg: ModelConfig
    fmt: CacheFormats
    device: torch.device
    dtype: torch.dtype
    num_slots: int
    swa_ring: int

    def ring_store(
        self,
        ring: torch.Tensor,
        x: torch.Tensor,
        x_bytes: torch.Tensor | None,
        states: torch.Tensor,
        positions: torch.Tensor,
    ) -> None: ...


class SpecState:
    def __init__(self, ex: SpecHost, seed: int) -> None:
        model = ex.model
        d = model.drafter
        assert d is not None
        self.ex, self.drafter = ex, d
        self.block = d.block
        n, ring = ex.num_slots, ex.swa_ring
        self.swa = [
            torch.zeros(n, ring, ex.fmt.swa.bytes_per_token, dtype=torch.uint8, device=ex.device)
            for _ in d.stages
        ]
        self.feat = torch.zeros(n, ring, ex.cfg.hidden_size, dtype=ex.dtype, device=ex.device)
        self.tokens = np.full((n, self.block), -1, np.int64)
        self.pos = np.full(n, -1, np.int64)  # position of the accepted token the drafts follow
        self.y = np.full(n, -1, np.int64)
        self.probs: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator(device=ex.device).manual_seed(seed)
        # Set by the engine for a step: masks the logits of verify / draft rows in place before they are
        # verified (structured outputs: the grammar's draft rows; engine/structured_spec.py).
        self.logits_hook: Callable[[ForwardBatch, torch.Tensor], None] | None = None
        # Set by the engine: state slot -> request seed. When every verifying / drafting row has one,
        # verification runs in counter mode (every random number a function of (seed, position), so a
        # sampled request's tokens do not depend on its batch) and drafts are the drafter's argmax (a
        # deterministic draft distribution: still lossless, and batch-invariant too).
        self.counter_seeds: dict[int, int] | None = None

    def cache_bytes(self) -> int:
        return sum(t.numel() for t in self.swa) + self.feat.numel() * self.feat.element_size()

    # ------------------------------------------------------------------ validation
    def validate(self, b: ForwardBatch, i: int, toks: np.ndarray, s: int, slot: int, k: int) -> None:
        n = toks.shape[0]
        v = 0 if b.verify_lens is None else int(b.verify_lens[i])
        if b.draft is not None and b.draft[i] and k < 1:
            raise BatchError(i, "draft", "drafting needs num_logits >= 1 (the row the next token comes from)")
        if b.encoder_only and (v or (b.draft is not None and b.draft[i])):
            raise BatchError(i, "draft", "encoder-only steps produce no logits: no drafting or verifying")
        if v == 0:
            return
        if s == 0:
            raise BatchError(
                i, "verify_lens", f"{v}: a sequence (re)starting at position 0 has no drafts to verify"
            )
        if not 0 < v < n or v > self.block:
            raise BatchError(i, "verify_lens", f"{v}: must be in [0, min(query_lens - 1, {self.block})]")
        if k < v + 1:
            raise BatchError(i, "num_logits", f"{k}: verifying {v} drafts needs >= {v + 1} logits rows")
        at = s + n - v - 1
        if (
            self.pos[slot] != at
            or self.y[slot] != toks[n - v - 1]
            or (self.tokens[slot, :v] != toks[n - v :]).any()
        ):
            raise BatchError(
                i,
                "verify_lens",
                f"the last {v} tokens at position {at + 1} are not the drafts this "
                f"executor made for slot {slot} (made after position {int(self.pos[slot])})",
            )

    # ------------------------------------------------------------------ context rings
    def write_context(
        self,
        layer_states: list[torch.Tensor],
        positions: torch.Tensor,
        slots: torch.Tensor,
        keep: torch.Tensor,
    ) -> None:
        """Fused features and each stage's context keys of the processed rows ``keep`` into the rings."""
        feat = self.drafter.features(layer_states)[keep]
        pos, sl = positions[keep], slots[keep]
        self.feat[sl, pos % self.ex.swa_ring] = feat
        for st, ring in zip(self.drafter.stages, self.swa):
            self.ex.ring_store(ring, st.context_keys(feat, pos), None, sl, pos)

    def restart(self, slot: int) -> None:
        self.pos[slot] = -1
        self.probs.pop(slot, None)

    # ------------------------------------------------------------------ verify + draft
    def step(self, b: ForwardBatch, logits: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Verify the drafts fed this step (lossless) and draft again for the rows that ask: the output's
        ``num_accepted``, ``next_token``, ``drafts`` and ``draft_confidence`` (None: no row verifies or drafts)."""
        r = b.num_requests
        vl = np.zeros(r, np.int64) if b.verify_lens is None else b.verify_lens
        dr = np.zeros(r, bool) if b.draft is None else b.draft
        idx = np.flatnonzero((vl > 0) | dr)
        if idx.size == 0:
            return None
        if self.logits_hook is not None:
            self.logits_hook(b, logits)
        dev = self.ex.device
        # probabilities in >= float32 whatever the model dtype (they feed the lossless verify)
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        temp_all = np.zeros(r) if b.temperature is None else b.temperature
        temp = torch.as_tensor(temp_all[idx], dtype=dt, device=dev)
        res, keyed = self._verify(b, logits.to(dt), idx, vl, temp)
        acc, nxt = res.num_accepted, res.next_token
        out = {
            "num_accepted": torch.zeros(r, dtype=torch.long, device=dev),
            "next_token": torch.full((r,), -1, dtype=torch.long, device=dev),
            "drafts": torch.full((r, self.block), -1, dtype=torch.long, device=dev),
            "draft_confidence": torch.full((r, self.block), float("nan"), dtype=dt, device=dev),
        }
        out["num_accepted"][idx] = acc
        out["next_token"][idx] = nxt
        for i in idx:
            self.restart(int(b.state_slots[i]))
        j = np.flatnonzero(dr[idx])
        if j.size:
            self._draft(b, out, idx, j, vl, acc, nxt, torch.zeros_like(temp) if keyed else temp)
        return out

    def _verify(
        self, b: ForwardBatch, logits: torch.Tensor, idx: np.ndarray, vl: np.ndarray, temp: torch.Tensor
    ) -> tuple[Any, bool]:
        """(``spec.verify``'s result for rows ``idx``, whether it ran keyed by (seed, position))."""
        from deepinfer_core.spec import verify

        dev, dt = self.ex.device, logits.dtype
        greedy = temp <= 0
        tscale = torch.where(greedy, torch.ones_like(temp), temp)
        v = vl[idx]
        d = int(v.max())
        lend = np.cumsum(b.num_logits)
        vocab = logits.shape[-1]
        # each row's last v + 1 logits rows, padded to d + 1 with its last one: one gather and one softmax
        # for the whole batch (a per-request loop launched ~4 kernels a request on the GPU)
        t = np.arange(d + 1)
        rows = (lend[idx] - v - 1)[:, None] + np.minimum(t[None, :], v[:, None])
        tp = torch.softmax(logits[torch.as_tensor(rows, device=dev)] / tscale[:, None, None], dim=-1)
        slots = np.asarray(b.state_slots)[idx]
        dt_np = np.where(t[None, :d] < v[:, None], self.tokens[slots, :d], 0)
        dtok = torch.as_tensor(dt_np, dtype=torch.long, device=dev)
        dprob = None
        if not bool(greedy.all()):  # the drafts' distributions (uniform past a row's own drafts)
            dprob = torch.full((idx.size, d, vocab), 1.0 / vocab, dtype=dt, device=dev)
            for j in np.flatnonzero(v > 0).tolist():
                dprob[j, : v[j]] = self.probs[int(slots[j])][: v[j]]
        lengths = torch.as_tensor(v, device=dev)
        cs = self.counter_seeds
        if cs is not None and all(int(b.state_slots[i]) in cs for i in idx):
            seeds = torch.as_tensor([cs[int(b.state_slots[i])] for i in idx], dtype=torch.int64, device=dev)
            first = torch.as_tensor(
                b.start_pos[idx] + b.query_lens[idx] - vl[idx], dtype=torch.int64, device=dev
            )
            return verify(dtok, dprob, tp, lengths, None, greedy=greedy, seeds=seeds, positions=first), True
        return verify(dtok, dprob, tp, lengths, self.gen, greedy=greedy), False

    def _draft(
        self,
        b: ForwardBatch,
        out: dict[str, torch.Tensor],
        idx: np.ndarray,
        j: np.ndarray,
        vl: np.ndarray,
        acc: torch.Tensor,
        nxt: torch.Tensor,
        temp: torch.Tensor,
    ) -> None:
        """The next draft block for rows ``idx[j]`` (after their accepted / sampled token), into ``out``."""
        ex, dev = self.ex, self.ex.device
        ii = idx[j]
        jt = torch.as_tensor(j, device=dev)
        s = torch.as_tensor(b.start_pos[ii] + b.query_lens[ii] - vl[ii], device=dev)
        q = s + acc[jt]  # position of the accepted / sampled token
        slots = torch.as_tensor(b.state_slots[ii], device=dev)
        w, ring = self.drafter.window, ex.swa_ring
        kp = q[:, None] - w + torch.arange(w, device=dev)[None, :]
        valid = kp >= 0
        ent = kp.clamp(min=0) % ring
        keys = [ex.fmt.swa.dequantize(rg[slots[:, None], ent]).to(ex.dtype) for rg in self.swa]
        cond = self.feat[slots, (q - 1) % ring]
        y = nxt[jt]
        hidden = self.drafter.run_block(ex.model, y, q, cond, keys, valid)
        dres = self.drafter.heads(ex.model, hidden, y, temp[jt], self.gen)
        out["drafts"][torch.as_tensor(ii, device=dev)] = dres.tokens
        out["draft_confidence"][torch.as_tensor(ii, device=dev)] = dres.confidence
        toks_np = dres.tokens.cpu().numpy()
        for k, i in enumerate(ii):
            slot = int(b.state_slots[i])
            self.tokens[slot] = toks_np[k]
            self.pos[slot] = int(q[k])
            self.y[slot] = int(y[k])
            self.probs[slot] = dres.probs[k]
