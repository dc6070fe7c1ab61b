"""Test driver: runs sequences through a ModelExecutor with block tables from the kv PagedKVPool."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.kv import PagedKVPool, StatePool
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41


class Session:
    """Sequences named by id; each gets a slot from a kv.StatePool and blocks from a kv.PagedKVPool."""

    def __init__(
        self,
        model: DeepSeekV41,
        quantize: bool = False,
        num_blocks: int = 128,
        block_size: int = 16,
        slots: int = 8,
        backtrack: int = 6,
    ) -> None:
        self.pool = PagedKVPool(num_blocks, block_size)
        self.ex = ModelExecutor(
            model, num_blocks, block_size, slots, backtrack_tokens=backtrack, quantize=quantize
        )
        self.states = StatePool(slots)
        self.slot: dict[int, int] = {}

    def _ensure(self, sid: int, end: int) -> None:
        if sid not in self.slot:
            slot = self.states.acquire(sid)
            assert slot is not None
            self.slot[sid] = slot
            assert self.pool.allocate(sid, end)
        have = self.pool.num_tokens(sid)
        if end > have:
            assert self.pool.append_slots(sid, end - have)

    def step(self, items: list[tuple[int, torch.Tensor, int, int]]):
        """items: (seq_id, tokens, start_pos, num_logits). Returns (ForwardOutput, per-item logits)."""
        for sid, toks, start, _ in items:
            self._ensure(sid, start + len(toks))
        ids = [sid for sid, *_ in items]
        b = ForwardBatch(
            token_ids=np.concatenate([t.numpy() for _, t, _, _ in items]),
            query_lens=[len(t) for _, t, _, _ in items],
            start_pos=[s for _, _, s, _ in items],
            block_tables=self.pool.block_tables(ids),
            state_slots=[self.slot[sid] for sid in ids],
            num_logits=[k for *_, k in items],
        )
        out = self.ex.execute(b)
        per = [out.logits[torch.as_tensor(out.request_of_logit == i)] for i in range(len(items))]
        return out, per

    def run(self, sid: int, tokens: torch.Tensor, chunks: list[int], start: int = 0) -> torch.Tensor:
        """Feed ``tokens`` from ``start`` in chunks of the given sizes; logits of every fed row."""
        out, s = [], start
        for n in chunks:
            _, per = self.step([(sid, tokens[s - start : s - start + n], s, n)])
            out.append(per[0])
            s += n
        return torch.cat(out)


def chunks_of(total: int, size: int) -> list[int]:
    return [min(size, total - s) for s in range(0, total, size)]
