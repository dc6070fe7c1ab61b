"""Expert-parallel MoE over torch.distributed: dispatch / combine by all-to-all over an EPLB placement.

Each EP rank holds ``slots_per_gpu`` physical expert slots of every layer (EPLB's ``phy2log``: slot ``p``
lives on rank ``p // slots_per_gpu``; redundant replicas of hot experts included). One MoE layer on a rank:

1. route its own tokens with the (replicated) gate; count tokens per logical expert (EPLB's load);
2. pick a replica for each token-expert pair: ``log2phy[e, src_rank % logcnt[e]]`` (every pair of one
   source rank and one expert goes to one replica, different source ranks spread over the replicas;
   ``replica_choice="token"`` spreads one rank's pairs round robin instead, see REPLICA_CHOICES);
3. one small all-to-all of (pairs for you, active flag, layer id), then two of the pairs' slot ids and
   rows; each owner runs every (source rank, slot) group as its own matmul (so a token's result never
   depends on other ranks' tokens: with batch-invariant mode the tokens equal the single-process
   engine's), and a last all-to-all sends the rows back, where they are weighted and summed over k in
   the same order as :class:`~deepinfer_core.model.layers.moe.MoE` does;
4. the shared expert runs locally.

Lock-step rule: every rank issues the same collectives in the same order. A rank with fewer (or no)
forwards in a step keeps joining: :class:`StepSync` pairs each real forward with a dummy one on the
others (empty Engram fetches, then :meth:`ExpertParallel.drain`, in which an idle rank still computes
for the tokens others send to its slots), and a round whose every rank is inactive ends the forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deepinfer_core.eplb import ExpertPlacement
from deepinfer_core.model.layers.moe import MoE, clamped_swiglu

log = logging.getLogger(__name__)


# "rank": every pair of one source rank and one expert goes to replica src_rank % count (a request's
# tokens for an expert stay together: batch-invariant results). "token": round robin over the replicas in
# flat (token, k) order, offset by the source rank (better balance; a request's tokens may split, so the
# results are equal to the single-process engine's only up to matmul summation order).
REPLICA_CHOICES = ("rank", "token")


class ProtocolError(RuntimeError):
    """Ranks of one group disagree on the collective sequence (a bug, never a user error)."""


class _EPLayer(nn.Module):
    """Stands in for one block's ``ffn``: same call, (output, counts per logical expert)."""

    def __init__(self, owner: ExpertParallel, layer: int, moe: MoE) -> None:
        super().__init__()
        self.layer = layer
        self.moe = moe
        self._owner = [owner]  # a list: not a registered submodule (no parameter duplication)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner[0].forward_layer(self.layer, self.moe, x)


class ExpertParallel:
    """The EP MoE of one rank: its slots' weights, the placement, the collectives over ``group``.

    Built from a model holding every expert (the tiny model is drawn whole on each rank): it keeps this
    rank's slots, empties the blocks' full expert tensors (so nothing can read them) and puts an
    :class:`_EPLayer` in place of each block's ``ffn``. ``w1`` / ``w3`` / ``w2`` are [layers,
    slots_per_gpu, ...] contiguous: the layout :func:`deepinfer_core.eplb.transfer.execute_moves` moves.
    """

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        placement: ExpertPlacement,
        device: torch.device | str = "cpu",
        replica_choice: str = "rank",
    ) -> None:
        if replica_choice not in REPLICA_CHOICES:
            raise ValueError(f"replica_choice={replica_choice!r}: must be one of {list(REPLICA_CHOICES)}")
        self.replica_choice = replica_choice
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)
        blocks = list(cast(Iterable[Any], model.layers))  # an nn.Module attribute types as Tensor | Module
        moes = [b.ffn for b in blocks]
        if not all(isinstance(m, MoE) for m in moes):
            raise TypeError("model: every block's ffn must be a deepinfer MoE (already expert-parallel?)")
        self.num_layers, self.num_experts, self.top_k = len(moes), moes[0].n_experts, moes[0].top_k
        self._check_placement(placement)
        self.placement = placement
        per = placement.slots_per_gpu
        lo = self.rank * per
        mine = torch.as_tensor(placement.phy2log[:, lo : lo + per])
        self.w1 = torch.stack([m.w1.data[mine[i].to(m.w1.device)] for i, m in enumerate(moes)]).contiguous()
        self.w3 = torch.stack([m.w3.data[mine[i].to(m.w3.device)] for i, m in enumerate(moes)]).contiguous()
        self.w2 = torch.stack([m.w2.data[mine[i].to(m.w2.device)] for i, m in enumerate(moes)]).contiguous()
        self.hidden, self.dtype = int(self.w1.shape[-1]), self.w1.dtype
        self.expert_bytes = sum(int(t[0, 0].numel() * t.element_size()) for t in (self.w1, self.w3, self.w2))
        for b, m in zip(blocks, moes):
            for name in ("w1", "w3", "w2"):  # the full stacks are no longer this rank's to use
                setattr(
                    m,
                    name,
                    nn.Parameter(torch.empty(0, dtype=self.dtype, device=m.gate.device), requires_grad=False),
                )
            b.ffn = _EPLayer(self, b.layer_id, m)
        self.limit = moes[0].limit
        self._tables(placement)
        self.step_counts = np.zeros((self.num_layers, self.num_experts), np.int64)  # this step's load
        # measurements (benchmarks, tests): rows this rank sent to other ranks / computed, time in a2a
        self.rows_remote = 0
        self.rows_computed = 0
        self.a2a_s = 0.0
        self.rounds = 0
        self.received_per_layer = np.zeros(self.num_layers, np.int64)  # rows computed here, this step

    def _check_placement(self, p: ExpertPlacement) -> None:
        if not isinstance(p, ExpertPlacement):
            raise TypeError(f"placement: expected an eplb.ExpertPlacement, got {type(p).__name__}")
        if (p.num_layers, p.num_experts, p.num_gpus) != (self.num_layers, self.num_experts, self.size):
            raise ValueError(
                f"placement: {p.num_layers} layers x {p.num_experts} experts on {p.num_gpus} GPUs; "
                f"this model and EP group need {self.num_layers} x {self.num_experts} on {self.size}"
            )

    def _tables(self, p: ExpertPlacement) -> None:
        self.log2phy = torch.as_tensor(p.log2phy, dtype=torch.int64, device=self.device)
        self.logcnt = torch.as_tensor(p.logcnt, dtype=torch.int64, device=self.device)
        self.per = p.slots_per_gpu

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on; the caller has moved the slot weights to match it."""
        self._check_placement(placement)
        if placement.slots_per_gpu != self.per:
            raise ValueError(
                f"placement: {placement.slots_per_gpu} slots per GPU, the weights hold {self.per}"
            )
        self.placement = placement
        self._tables(placement)

    @property
    def weights(self) -> list[torch.Tensor]:
        return [self.w1, self.w3, self.w2]

    # ------------------------------------------------------------------ collectives
    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        self.a2a_s += time.perf_counter() - t0
        return out

    def _header(self, send_counts: torch.Tensor, active: bool, layer: int) -> tuple[list[int], bool, int]:
        """All-to-all of (pairs for rank j, active, layer): returns (pairs from each rank, any active, layer)."""
        w = self.size
        head = torch.stack(
            [
                send_counts.to(torch.int64),
                torch.full((w,), int(active), dtype=torch.int64, device=self.device),
                torch.full((w,), layer, dtype=torch.int64, device=self.device),
            ],
            dim=1,
        ).reshape(-1)
        got = self._a2a(head, [3] * w, [3] * w).view(w, 3).cpu()
        self.rounds += 1
        act = got[:, 1] > 0
        if not act.any():
            return [0] * w, False, -1
        layers = set(got[act, 2].tolist())
        if len(layers) != 1 or (active and layers != {layer}):
            raise ProtocolError(
                f"EP rank {self.rank}: ranks are in different MoE layers {sorted(layers)} "
                f"(this rank: {layer if active else 'idle'})"
            )
        return got[:, 0].tolist(), True, layers.pop()

    def _serve(self, layer: int, recv: list[int], slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Expert outputs for received rows: one matmul per (source rank, local slot) run."""
        out = torch.empty_like(rows)
        self.received_per_layer[layer] += rows.shape[0]
        self.rows_computed += rows.shape[0]
        if rows.shape[0] == 0:
            return out
        s = slots.tolist()
        start = 0
        for n in recv:  # per source rank: its slots arrive sorted, so equal slots are one run
            end = start + n
            a = start
            while a < end:
                j = s[a]
                b = a
                while b < end and s[b] == j:
                    b += 1
                xs = rows[a:b]
                h = clamped_swiglu(xs @ self.w1[layer, j].t(), xs @ self.w3[layer, j].t(), self.limit)
                out[a:b] = h @ self.w2[layer, j].t()
                a = b
            start = end
        return out

    def _exchange(
        self, layer: int, send: list[int], recv: list[int], slots: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        got_slots = self._a2a(slots, send, recv)
        got_rows = self._a2a(rows, send, recv)
        y = self._serve(layer, recv, got_slots, got_rows)
        return self._a2a(y, recv, send)

    # ------------------------------------------------------------------ one layer, and an idle rank
    def forward_layer(self, layer: int, moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = x.shape[0], self.top_k
        ids, w = moe.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.step_counts[layer] += counts.cpu().numpy()
        flat = ids.reshape(-1).to(self.device)
        cnt = self.logcnt[layer][flat]
        if self.replica_choice == "rank":
            rep = self.rank % cnt
        else:
            by_e = torch.argsort(flat, stable=True)
            e_sorted = flat[by_e]
            n_e = torch.bincount(flat, minlength=self.num_experts)
            occ = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(n_e, 0) - n_e)[e_sorted]
            rep = torch.empty_like(flat)
            rep[by_e] = (occ + self.rank) % cnt[by_e]
        slot = self.log2phy[layer][flat, rep]
        order = torch.argsort(slot, stable=True)
        s_sorted = slot[order]
        dest = torch.div(s_sorted, self.per, rounding_mode="floor")
        send_t = torch.bincount(dest, minlength=self.size)
        send = send_t.tolist()
        self.rows_remote += n * k - send[self.rank]
        recv, _, _ = self._header(send_t, True, layer)
        order_x = order.to(x.device)
        back = self._exchange(
            layer,
            send,
            recv,
            (s_sorted % self.per).contiguous(),
            x[torch.div(order_x, k, rounding_mode="floor")].to(self.device),
        )
        buf = x.new_empty(n * k, x.shape[1])
        # weighted where MoE.forward weights it, then summed over k in (token, k) order: the same bits
        buf[order_x] = back.to(x.device) * w.reshape(-1)[order_x][:, None]
        out = buf.view(n, k, -1).sum(1)
        if moe.shared:
            out = out + clamped_swiglu(x @ moe.s_w1.t(), x @ moe.s_w3.t(), moe.shared_limit) @ moe.s_w2.t()
        return out, counts

    def drain(self) -> None:
        """Join MoE rounds with nothing of our own until every rank is idle (ends each forward)."""
        zeros = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        no_slots = torch.zeros(0, dtype=torch.int64, device=self.device)
        no_rows = torch.zeros(0, self.hidden, dtype=self.dtype, device=self.device)
        while True:
            recv, any_active, layer = self._header(zeros, False, -1)
            if not any_active:
                return
            self._exchange(layer, [0] * self.size, recv, no_slots, no_rows)

    def take_step_counts(self) -> np.ndarray:
        """This step's tokens per (layer, logical expert) on this rank; resets the accumulator."""
        c = self.step_counts
        self.step_counts = np.zeros_like(c)
        return c


class StepSync:
    """Per-step lock-step rounds over the DP group (one tiny MAX all-reduce each).

    A real forward opens with :meth:`begin_forward`. At the end of its step every rank calls
    :meth:`end_step`, which keeps answering other ranks' forwards with ``dummy()`` until a round finds no
    rank starting one; that round also carries each rank's "has unfinished work", so all ranks learn at
    once whether the group is busy.
    """

    def __init__(self, group: Any, device: torch.device | str, dummy: Callable[[], None]) -> None:
        self.group, self.device, self.dummy = group, torch.device(device), dummy
        self.dummies = 0

    def _round(self, starting: bool, busy: bool) -> tuple[bool, bool]:
        t = torch.tensor([int(starting), int(busy)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        a, b = t.tolist()
        return bool(a), bool(b)

    def begin_forward(self) -> None:
        self._round(True, True)

    def end_step(self, busy: bool) -> bool:
        """Serve the others' remaining forwards; return whether any rank of the group has work left."""
        while True:
            someone, group_busy = self._round(False, busy)
            if not someone:
                return group_busy
            self.dummies += 1
            self.dummy()
