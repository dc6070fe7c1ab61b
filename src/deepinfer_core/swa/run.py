"""Run a :class:`~deepinfer_core.swa.plan.ReplayPlan` for one sequence on a ``ModelExecutor`` (tests,
benchmarks; the engine drives the same executor calls from its scheduler's chunks instead).

Imports torch (through the executor it is given); :mod:`deepinfer_core.swa` itself stays numpy-only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer_core.protocols.model import ModelExecutor
from deepinfer_core.swa.plan import (
    ENCODER_PREFILL,
    ENCODER_REPLAY,
    ENCODER_RESTORE,
    PREFILL,
    TAIL,
    ReplayPlan,
)


def run_plan(
    ex: ModelExecutor,
    plan: ReplayPlan,
    tokens: np.ndarray,
    slot: int,
    block_table: np.ndarray,
    host_rings: Any = None,
    chunk: int | None = None,
    snapshot_pos: int = 0,
) -> Any:
    """Execute ``plan`` for ``tokens`` (all ``plan.num_tokens`` of them) in ``slot`` with ``block_table``
    (whose first ``plan.hit // block`` blocks hold the cached KV). Returns the last token's logits [V].

    ``host_rings``: the persisted encoder rings at ``plan.hit`` (needed by an encoder_restore step);
    ``chunk``: split compute steps into chunks of at most this many tokens (chunked prefill);
    ``snapshot_pos``: also return the encoder rings at that position (a (logits, rings) pair).
    """
    from deepinfer_core.batch import ForwardBatch

    toks = np.asarray(tokens, dtype=np.int64)
    if toks.shape != (plan.num_tokens,):
        raise ValueError(f"tokens: shape {toks.shape}, expected ({plan.num_tokens},)")
    table = np.asarray(block_table, dtype=np.int32)
    ctx_n = int(ex.tok_ring)
    logits, snap = None, None
    for st in plan.steps:
        ctx = toks[max(0, st.start - ctx_n) : st.start]
        if st.kind == ENCODER_RESTORE:
            if host_rings is None:
                raise ValueError("host_rings: the plan restores the encoder rings; give them")
            ex.restore_encoder(slot, st.start, host_rings, ctx)
            continue
        if st.kind == ENCODER_REPLAY:
            ex.replay_encoder(slot, toks[st.start : st.end], st.start, table, ctx)
            continue
        if st.kind not in (ENCODER_PREFILL, TAIL, PREFILL):
            raise ValueError(f"plan step kind {st.kind!r}: unknown")
        step = chunk or max(1, st.num_tokens)
        for c0 in range(st.start, st.end, step):
            c1 = min(st.end, c0 + step)
            last = st.logits and c1 == st.end
            sp = snapshot_pos if c0 < snapshot_pos <= c1 else 0
            b = ForwardBatch(
                token_ids=toks[c0:c1],
                query_lens=[c1 - c0],
                start_pos=[c0],
                block_tables=table[None],
                state_slots=[slot],
                num_logits=[int(last)],
                encoder_only=st.kind == ENCODER_PREFILL,
                decoder_floor=[st.floor if st.kind == TAIL else 0],
                snapshot_pos=[sp],
            )
            out = ex.execute(b)
            if sp:
                snap = out.snapshots[0]
            if last:
                logits = out.logits[-1]
    return (logits, snap) if snapshot_pos else logits
