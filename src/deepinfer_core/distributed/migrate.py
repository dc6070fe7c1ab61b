"""Expert weight moves spread over serving steps: stage, then switch at a step boundary.

:func:`deepinfer_core.eplb.transfer.execute_moves` moves every slot in one go, between two steps. Here a
:class:`~deepinfer_core.eplb.migration.MovePlan` is carried out ``moves_per_step`` moves at a time, one
batch after each step, while the old placement keeps serving: incoming slots land in a staging buffer,
never in a live slot, so every source still holds its old expert until the end (no snapshot needed) and
routing stays on the old tables. When the last batch has arrived, :meth:`StagedMigration.commit` checks
fingerprints across the group, copies the staged slots in and switches the routing, all between two
steps. Every rank runs the same batches at the same step (the engine's steps are lock-step).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.distributed.ep import ExpertParallel
from deepinfer_core.eplb import ExpertPlacement
from deepinfer_core.eplb.migration import MovePlan
from deepinfer_core.eplb.transfer import fingerprint

log = logging.getLogger(__name__)


class StagedMigration:
    """One plan's moves, ``moves_per_step`` per :meth:`advance`; collective over ``group``."""

    def __init__(
        self, ep: ExpertParallel, moves: MovePlan, placement: ExpertPlacement, group: Any, moves_per_step: int
    ) -> None:
        if isinstance(moves_per_step, bool) or not isinstance(moves_per_step, int) or moves_per_step < 1:
            raise ValueError(f"moves_per_step={moves_per_step!r}: must be an int >= 1")
        self.ep, self.moves, self.placement, self.group = ep, moves, placement, group
        self.per_step = moves_per_step
        self.rank = dist.get_rank(group)
        self._peer = (lambda g: dist.get_global_rank(group, g)) if group is not None else (lambda g: g)
        per = moves.slots_per_gpu
        self._lay, self._src, self._dst = moves.layer, moves.src_slot % per, moves.dst_slot % per
        mine = np.flatnonzero(moves.dst_gpu == self.rank)
        self._stage_of = {int(i): j for j, i in enumerate(mine)}  # move index -> staging row
        self._stage = [t.new_empty((len(mine), *t.shape[2:])) for t in ep.weights]
        self._fp = np.zeros((len(moves), 2), dtype=np.int64)
        self.next = 0
        self.batches = 0
        self.bytes_sent = 0

    @property
    def done(self) -> bool:
        return self.next >= len(self.moves)

    def advance(self) -> None:
        """Send / receive the next batch of moves (all ranks at once); the old placement keeps serving."""
        tensors = self.ep.weights
        end = min(self.next + self.per_step, len(self.moves))
        reqs = []
        for i in range(self.next, end):
            s_gpu, d_gpu = int(self.moves.src_gpu[i]), int(self.moves.dst_gpu[i])
            lay, src = int(self._lay[i]), int(self._src[i])
            if s_gpu == self.rank:
                parts = [t[lay, src] for t in tensors]
                self._fp[i, 0] = fingerprint(parts)
            if s_gpu == self.rank and d_gpu == self.rank:
                for st, x in zip(self._stage, parts):
                    st[self._stage_of[i]].copy_(x)
            elif s_gpu == self.rank:
                for k, x in enumerate(parts):
                    reqs.append(
                        dist.isend(
                            x.contiguous(),
                            self._peer(d_gpu),
                            group=self.group,
                            tag=(i - self.next) * len(tensors) + k,
                        )
                    )
                    self.bytes_sent += x.numel() * x.element_size()
            elif d_gpu == self.rank:
                for k, st in enumerate(self._stage):
                    reqs.append(
                        dist.irecv(
                            st[self._stage_of[i]],
                            self._peer(s_gpu),
                            group=self.group,
                            tag=(i - self.next) * len(tensors) + k,
                        )
                    )
        for r in reqs:
            if r is not None:  # None: this rank is not in the group (never here: peers are members)
                r.wait()
        self.next = end
        self.batches += 1

    def commit(self) -> None:
        """After the last batch: verify across the group, copy the staged slots in, switch routing."""
        if not self.done:
            raise RuntimeError(
                f"StagedMigration.commit: {len(self.moves) - self.next} moves still to carry out"
            )
        for i, j in self._stage_of.items():
            self._fp[i, 1] = fingerprint([st[j] for st in self._stage])
        if len(self.moves):
            dev = torch.device("cpu") if dist.get_backend(self.group) == "gloo" else self.ep.weights[0].device
            both_t = torch.from_numpy(self._fp).to(dev)
            dist.all_reduce(both_t, group=self.group)
            both = both_t.cpu().numpy()
            bad = np.flatnonzero(both[:, 0] != both[:, 1])
            if bad.size:
                raise RuntimeError(
                    f"{bad.size} staged expert moves arrived corrupted, first (layer, expert, from, to): "
                    f"{[self.moves.as_tuples()[k] for k in bad[:5]]}"
                )
        tensors = self.ep.weights
        for i, j in self._stage_of.items():
            for t, st in zip(tensors, self._stage):
                t[int(self._lay[i]), int(self._dst[i])].copy_(st[j])
        self.ep.set_placement(self.placement)
        log.debug(
            "rank %d: staged migration committed: %d moves in %d batches",
            self.rank,
            len(self.moves),
            self.batches,
        )
