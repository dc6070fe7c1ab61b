"""The executor's batch validation: every rule a :class:`~deepinfer_core.model.batch.ForwardBatch` must
meet before a step writes anything, with :class:`~deepinfer_core.model.batch.BatchError` naming the first
bad request and field.

Functions of the executor's :class:`~deepinfer_core.model.state.ExecutorState`. The per-request rules
run as numpy checks over the whole batch (:func:`rows_ok`, no per-request loop: the host cost of a decode
step at dozens of rows); only a batch that fails them goes through the request-by-request loop
(:func:`validate_rows`), which finds and names the first bad request. The two accept exactly the same
batches (tested).
"""

from __future__ import annotations

import numpy as np

from deepinfer_core.model.batch import BatchError, ForwardBatch
from deepinfer_core.model.state import ExecutorState


def validate(st: ExecutorState, b: ForwardBatch) -> None:
    """Raise :class:`BatchError` naming the first bad request and field; touches nothing."""
    r = b.num_requests
    if r == 0:
        raise BatchError(None, "query_lens", "empty batch: at least one request is needed")
    for name in ("start_pos", "state_slots", "num_logits"):
        if getattr(b, name).shape != (r,):
            raise BatchError(None, name, f"shape {getattr(b, name).shape}, expected ({r},) (one per request)")
    if b.block_tables.ndim != 2 or b.block_tables.shape[0] != r:
        raise BatchError(None, "block_tables", f"shape {b.block_tables.shape}, expected ({r}, W)")
    if b.encoder_only and (st.cfg.encoder_layers >= st.cfg.num_hidden_layers or b.num_logits.any()):
        raise BatchError(
            None, "encoder_only", "needs a model with a decoder (CED split) and num_logits all 0"
        )
    bad = [lid for lid in b.capture_layers if not 0 <= lid < st.cfg.num_hidden_layers]
    if bad:
        raise BatchError(None, "capture_layers", f"{bad} outside [0, {st.cfg.num_hidden_layers})")
    if int(b.query_lens.sum()) != b.num_tokens:
        raise BatchError(None, "query_lens", f"sum {int(b.query_lens.sum())} != {b.num_tokens} token_ids")
    for name in ("verify_lens", "draft", "temperature", "decoder_floor", "snapshot_pos"):
        a = getattr(b, name)
        if a is not None and a.shape != (r,):
            raise BatchError(None, name, f"shape {a.shape}, expected ({r},) (one per request)")
    if st.spec is None and (
        (b.verify_lens is not None and b.verify_lens.any()) or (b.draft is not None and b.draft.any())
    ):
        raise BatchError(
            None,
            "draft",
            "this executor does not draft: the model has no drafter "
            "(num_nextn_predict_layers = 0) or it was built with draft_context=False",
        )
    if b.temperature is not None and not (np.isfinite(b.temperature) & (b.temperature >= 0)).all():
        i = int(np.flatnonzero(~(np.isfinite(b.temperature) & (b.temperature >= 0)))[0])
        raise BatchError(i, "temperature", f"{b.temperature[i]}: must be finite and >= 0 (0 = greedy)")
    if rows_ok(st, b):
        if st.spec is not None:  # drafter checks only concern rows that draft or verify
            want = np.zeros(r, bool) if b.draft is None else b.draft.astype(bool)
            if b.verify_lens is not None:
                want = want | (b.verify_lens > 0)
            off = b.offsets
            for i in np.flatnonzero(want).tolist():
                st.spec.validate(
                    b,
                    i,
                    b.token_ids[off[i] : off[i + 1]],
                    int(b.start_pos[i]),
                    int(b.state_slots[i]),
                    int(b.num_logits[i]),
                )
        return
    validate_rows(st, b)


def rows_ok(st: ExecutorState, b: ForwardBatch) -> bool:
    """Every per-request rule of :func:`validate_rows` at once (numpy, no per-request loop): True when
    all hold; False sends the batch to the loop, which names the first bad request and field."""
    n, s, slot, k = (
        b.query_lens.astype(np.int64),
        b.start_pos.astype(np.int64),
        b.state_slots.astype(np.int64),
        b.num_logits.astype(np.int64),
    )
    if (n < 1).any() or ((k < 0) | (k > n)).any() or ((slot < 0) | (slot >= st.num_slots)).any():
        return False
    seen = np.zeros(st.num_slots, bool)  # slots are in range here: a mark per slot, no sort (np.unique)
    seen[slot] = True
    if int(np.count_nonzero(seen)) != slot.size:
        return False
    if b.num_tokens and (int(b.token_ids.min()) < 0 or int(b.token_ids.max()) >= st.cfg.vocab_size):
        return False
    end = st.slot_end[slot]
    if ((s < 0) | ((s > 0) & ((s < end - st.backtrack) | (s > end)))).any():
        return False
    f = np.zeros_like(s) if b.decoder_floor is None else b.decoder_floor.astype(np.int64)
    if ((f < 0) | (f > s)).any():
        return False
    if not b.encoder_only and ((s > 0) & st.encoder_only[slot] & (f < s)).any():
        return False
    if ((s > 0) & (s < st.min_start[slot])).any():
        return False
    if b.snapshot_pos is not None:
        x = b.snapshot_pos.astype(np.int64)
        if ((x != 0) & ((x <= s) | (x > s + n))).any():
            return False
    if st.min_ratio:
        total, last = s + n, np.full(s.shape, -1, np.int64)
        for ratio in st.src_ratios:  # blocks_needed, vectorised
            last = np.maximum(
                last, np.where(total >= ratio, (total // ratio - 1) * ratio // st.min_ratio, -1)
            )
        need = np.where(last >= 0, last // st.block_size + 1, 0)
        bt = b.block_tables
        if need.size and int(need.max()) > bt.shape[1]:
            return False
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        if (used & ((bt <= 0) | (bt >= st.num_blocks))).any():
            return False
    return True


def validate_rows(st: ExecutorState, b: ForwardBatch) -> None:
    """The per-request rules, request by request: raises for the first bad one."""
    r = b.num_requests
    slots_seen: dict[int, int] = {}
    off = b.offsets
    v = st.cfg.vocab_size
    for i in range(r):
        n, s, slot, k = (
            int(b.query_lens[i]),
            int(b.start_pos[i]),
            int(b.state_slots[i]),
            int(b.num_logits[i]),
        )
        if n < 1:
            raise BatchError(i, "query_lens", f"{n}: must be >= 1")
        toks = b.token_ids[off[i] : off[i + 1]]
        if toks.min() < 0 or toks.max() >= v:
            raise BatchError(i, "token_ids", f"values must be in [0, vocab_size={v})")
        if not 0 <= k <= n:
            raise BatchError(i, "num_logits", f"{k}: must be in [0, query_lens={n}]")
        if not 0 <= slot < st.num_slots:
            raise BatchError(i, "state_slots", f"{slot}: must be in [0, {st.num_slots})")
        if slot in slots_seen:
            raise BatchError(i, "state_slots", f"{slot} is also used by request {slots_seen[slot]}")
        slots_seen[slot] = i
        _check_start(st, b, i, s, slot)
        x = 0 if b.snapshot_pos is None else int(b.snapshot_pos[i])
        if x and not s < x <= s + n:
            raise BatchError(i, "snapshot_pos", f"{x}: must be 0 (none) or in ({s}, {s + n}]")
        if st.min_ratio:
            _check_blocks(st, b.block_tables[i], i, s + n)
        if st.spec is not None:
            st.spec.validate(b, i, toks, s, slot, k)


def _check_start(st: ExecutorState, b: ForwardBatch, i: int, s: int, slot: int) -> None:
    """Request ``i``'s start position against what its state slot holds, and its decoder floor."""
    end = int(st.slot_end[slot])
    if s < 0 or (s > 0 and not end - st.backtrack <= s <= end):
        raise BatchError(
            i,
            "start_pos",
            f"{s}: slot {slot} holds positions up to {end}; allowed 0 "
            f"(restart) or [{max(end - st.backtrack, 0)}, {end}] (rollback <= {st.backtrack})",
        )
    f = 0 if b.decoder_floor is None else int(b.decoder_floor[i])
    if not 0 <= f <= s:
        raise BatchError(i, "decoder_floor", f"{f}: must be in [0, start_pos={s}]")
    if s > 0 and st.encoder_only[slot] and not b.encoder_only and f < s:
        raise BatchError(
            i,
            "start_pos",
            f"{s}: slot {slot} holds an encoder-only prefix, whose decoder "
            "SWA rings are empty; continue with encoder_only steps, restart at 0, or set "
            "decoder_floor = start_pos (bounded replay)",
        )
    if 0 < s < st.min_start[slot]:
        raise BatchError(
            i,
            "start_pos",
            f"{s}: slot {slot} was restored at {int(st.min_start[slot])}; no rollback below it",
        )


def _check_blocks(st: ExecutorState, row: np.ndarray, i: int, total: int) -> None:
    """Request ``i``'s block table ``row`` covers the blocks ``total`` tokens need, with valid ids."""
    need = st.blocks_needed(total)
    if row.shape[0] < need:
        raise BatchError(i, "block_tables", f"{row.shape[0]} blocks, {need} needed for {total} tokens")
    used = row[:need]
    if (used <= 0).any() or (used >= st.num_blocks).any():
        raise BatchError(
            i,
            "block_tables",
            f"first {need} ids must be in [1, {st.num_blocks}) (0 is the null block)",
        )
