"""Mixture of experts: sqrt-softplus scoring, selection-only bias, top-k, shared expert, clamped SwiGLU.

Routed experts are computed grouped by expert: token-expert pairs are sorted by expert id and each
expert runs one matmul over its tokens (no per-token Python loop). ``forward`` also returns the number of
tokens each expert received, the load source of EPLB.

Expert placement (EPLB's ``phy2log`` / ``log2phy`` / ``logcnt``): with a :class:`SlotPlacement` set, each
token-expert pair goes to one physical slot of its expert, round robin in flat (token, k) order per
expert, so an expert's replicas get token counts that differ by at most one, and the same batch always
splits the same way. A slot computes with its logical expert's weights (read through ``phy2log``; in an
EP deployment the slot holds a copy, which ``eplb.transfer`` moves), so the output is the same under any
placement up to summation order.

Static mode (:func:`static_shapes`, used by the executor on the cuda backend): the same outputs with fixed
shapes and no host synchronisation (no ``bincount`` / ``.tolist()`` / per-expert slicing), so a decode step
can be captured in a CUDA graph. Routed experts then run as three ``torch._grouped_mm`` calls over the
expert-sorted pairs (bf16 on sm_90+, the offsets stay on the device), else densely (every expert on every
token, weighted by its routing weight, 0 when not routed). Compute is by logical expert (a placement moves
no numbers, see above); the expert counts are the same. The static mode's switches and its counting-sort
dispatch and gather-combine live in :mod:`~deepinfer_core.model.layers.moe_static` (importable from here).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.model import invariant
from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.moe_static import (
    GROUPED_IMPL,
    STATIC_MODE,
    _combine,
    _dispatch_rows,
    _torch_grouped,
)
from deepinfer_core.model.layers.moe_static import _dispatch as _dispatch
from deepinfer_core.model.layers.moe_static import grouped_gemm_impl as grouped_gemm_impl
from deepinfer_core.model.layers.moe_static import static_shapes as static_shapes
from deepinfer_core.model.layers.packing import is_block, is_packed, pack_parts

# grouped GEMMs in static mode where torch._grouped_mm applies (a switch for the tests: off = dense)
GROUPED_MM = True
# static mode's grouped products take the shared expert as one more group (SGLang's shared-experts fusion):
# its rows are the batch's own, appended after the routed pairs, and its weights are the last block of
# the packed expert tensors (MoE.pack_gate_up), so a layer's shared gate / up, SwiGLU and down (two dense
# GEMMs with their split-K reduces and a SwiGLU kernel at decode) ride in the routed kernels. Applies to
# one shared expert of the routed width, clamped as the routed ones are (else the separate products run).
FUSE_SHARED = True


def _grouped_ok(x: torch.Tensor) -> bool:
    return (
        GROUPED_MM
        and hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


@fusable
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); ``limit`` 0 disables the clamp.

    (choice) the gate is clamped from above only and the up projection on both sides, as in the
    published clamped-SwiGLU variants; sources do not say which side V4.1 clamps.
    """
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


@attrs.frozen
class SlotPlacement:
    """One layer's physical slots: ``phy2log`` [P], ``log2phy`` [E, max replicas] (-1 padded), ``logcnt`` [E]."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    def to(self, device: torch.device | str) -> SlotPlacement:
        return SlotPlacement(self.phy2log.to(device), self.log2phy.to(device), self.logcnt.to(device))

    @staticmethod
    def from_eplb(phy2log: Any, log2phy: Any, logcnt: Any, layers: int, experts: int) -> list[SlotPlacement]:
        """Check EPLB's arrays (numpy or torch) and split them per layer; ``log2phy`` / ``logcnt`` may be
        None (derived: replicas in slot order). Errors name the field."""
        p2l = np.asarray(phy2log.cpu() if isinstance(phy2log, torch.Tensor) else phy2log)
        if p2l.ndim != 2 or p2l.shape[0] != layers or p2l.shape[1] < experts:
            raise ValueError(f"phy2log: shape {p2l.shape}, expected [{layers} layers, >= {experts} slots]")
        if not np.issubdtype(p2l.dtype, np.integer) or p2l.min() < 0 or p2l.max() >= experts:
            raise ValueError(f"phy2log: entries must be logical expert ids in [0, {experts})")
        cnt = np.stack([np.bincount(row, minlength=experts) for row in p2l])
        if (cnt == 0).any():
            lay, e = (int(v) for v in np.argwhere(cnt == 0)[0])
            raise ValueError(
                f"phy2log: layer {lay} has no slot for expert {e}; every expert needs >= 1 replica"
            )
        if logcnt is not None:
            lc = np.asarray(logcnt.cpu() if isinstance(logcnt, torch.Tensor) else logcnt)
            if lc.shape != cnt.shape or not (lc == cnt).all():
                raise ValueError(f"logcnt: does not match the replica counts of phy2log (shape {lc.shape})")
        width = int(cnt.max())
        if log2phy is None:
            l2p = np.full((layers, experts, width), -1, np.int64)
            for lay in range(layers):
                for e in range(experts):
                    s = np.flatnonzero(p2l[lay] == e)
                    l2p[lay, e, : len(s)] = s
        else:
            l2p = np.asarray(log2phy.cpu() if isinstance(log2phy, torch.Tensor) else log2phy).astype(np.int64)
            if l2p.ndim != 3 or l2p.shape[:2] != (layers, experts) or l2p.shape[2] < width:
                raise ValueError(f"log2phy: shape {l2p.shape}, expected [{layers}, {experts}, >= {width}]")
            for lay in range(layers):
                for e in range(experts):
                    got = l2p[lay, e, : cnt[lay, e]]
                    if (
                        sorted(got.tolist()) != np.flatnonzero(p2l[lay] == e).tolist()
                        or (l2p[lay, e, cnt[lay, e] :] != -1).any()
                    ):
                        raise ValueError(
                            f"log2phy: layer {lay} expert {e} lists slots {l2p[lay, e].tolist()}, "
                            f"phy2log puts it at {np.flatnonzero(p2l[lay] == e).tolist()}"
                        )
        return [
            SlotPlacement(
                torch.from_numpy(p2l[i].astype(np.int64)),
                torch.from_numpy(l2p[i]),
                torch.from_numpy(cnt[i].astype(np.int64)),
            )
            for i in range(layers)
        ]


def route_scores(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


# experts up to which the compiled glue selects the routed experts by ranking (below); beyond it, torch.topk
RANK_TOPK_MAX_EXPERTS = 64


_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _order_key(v: torch.Tensor) -> torch.Tensor:
    """Integers in the order of ``v``'s values (equal values, +-0.0 included, equal keys) as stored in
    ``v``'s dtype: the bits, negative ones with their magnitude bits flipped (they order backwards).

    Through the bits because Inductor keeps fused bf16 / fp16 intermediates in float32: comparing the
    values themselves inside a fused kernel would rank unrounded scores, where ``torch.topk`` (a library
    call on a stored tensor) sees them rounded to the dtype, and near-ties would be decided differently;
    the bitcast makes the kernel round exactly as a store does."""
    it = _BITS[v.dtype]
    b = torch.where(v == 0, torch.zeros_like(v), v).view(it)  # -0.0 as +0.0, as comparisons have it
    return b ^ ((b >> (torch.iinfo(it).bits - 1)) & torch.iinfo(it).max)


def rank_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [N, k] of the k largest of ``v`` [N, E] per row, ordered by (value descending, id ascending).

    Each entry's rank is the number of entries before it in that order (larger, or equal with a lower id):
    ranks are distinct, and the id of rank r is the sum of ``id * (rank == r)``. Fixed-shape elementwise
    code and two reductions over E, which Inductor fuses into the routing kernel, where ``torch.topk``
    is two more launches a layer (gatherTopK, then a bitonic sort of the k results). The same ids in the
    same order as ``torch.topk`` whenever a row's values are distinct; with ties the same selection as
    CUDA's topk, whose gather keeps the lowest ids of the k-th value (the order of tied ids it returns is
    its sort's, unspecified: here ascending). Values compare as stored in ``v``'s dtype (:func:`_order_key`).
    NaN is not supported (router scores hold none).
    """
    e = v.shape[-1]
    key = _order_key(v)
    idx = torch.arange(e, device=v.device)
    kj, ki = key[:, None, :], key[:, :, None]
    before = (kj > ki) | ((kj == ki) & (idx[None, :] < idx[:, None])[None])
    rank = before.sum(-1)  # [N, E]: rank of entry i (its row i of the [N, i, j] comparison)
    pick = rank[:, None, :] == torch.arange(k, device=v.device)[None, :, None]  # [N, k, E]
    return (pick * idx).sum(-1)


@fusable
def _route(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    scoring: str,
    norm_topk: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = route_scores(x @ gate.t(), scoring)
    if torch.compiler.is_compiling() and gate.shape[0] <= RANK_TOPK_MAX_EXPERTS:
        ids = rank_topk(scores + bias, k)  # traced for the glue: fused (see rank_topk)
    else:
        ids = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(-1, ids)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scale


class MoE(nn.Module):
    """Routed experts (stacked weights [E, ...]) plus ``n_shared_experts`` always-on experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.n_experts, self.top_k = e, cfg.num_experts_per_tok
        self.scoring, self.norm_topk = cfg.scoring_func, cfg.norm_topk_prob
        self.scale, self.limit = cfg.routed_scaling_factor, cfg.swiglu_limit
        self.shared_limit = cfg.swiglu_limit if cfg.shared_expert_clamp else 0.0
        self.gate = nn.Parameter(torch.empty(e, d))
        # noaux_tc: a learned bias added to the scores for *selection only*; weights use raw scores
        self.gate_bias = nn.Parameter(torch.zeros(e))
        self.w1 = nn.Parameter(torch.empty(e, i, d))  # gate proj
        self.w3 = nn.Parameter(torch.empty(e, i, d))  # up proj
        self.w2 = nn.Parameter(torch.empty(e, d, i))  # down proj
        si = i * cfg.n_shared_experts
        self.shared = cfg.n_shared_experts > 0
        if self.shared:
            self.s_w1 = nn.Parameter(torch.empty(si, d))
            self.s_w3 = nn.Parameter(torch.empty(si, d))
            self.s_w2 = nn.Parameter(torch.empty(d, si))
        self.placement: SlotPlacement | None = None  # physical slots (EPLB); None = one slot per expert
        # gate and up projections packed as the two halves of one tensor (pack_gate_up), or None
        self._w13: torch.Tensor | None = None
        self._s_w13: torch.Tensor | None = None
        # with FUSE_SHARED: [E + 1, 2I, D] gate-up and [E + 1, D, I] down tensors whose last block is the
        # shared expert (the routed and shared packs above are views of them), or None
        self._all13: torch.Tensor | None = None
        self._all2: torch.Tensor | None = None

    @torch.no_grad()
    def pack_gate_up(self) -> None:
        """Store ``w1`` / ``w3`` (and the shared ``s_w1`` / ``s_w3``) as the two halves of one tensor each,
        the parameters becoming views of it (no extra memory; state_dict names and values unchanged), so a
        decode step reads both projections in ONE grouped GEMM of twice the width: at decode the expert
        GEMMs are weight-bandwidth-bound and a single wider product keeps more of the GPU streaming than
        two narrow ones (and halves their launches). Idempotent; undone by anything that replaces the
        parameters (``.to()``, ``load_state_dict`` with assign): :meth:`_packed` then ignores the pack."""
        if self._can_fuse_shared():
            if self._shared_group() is None:
                self._pack_with_shared()
            return
        if self._packed() is None:
            self._w13 = pack_parts((self.w1, self.w3), 1)
        if self.shared and self._shared_packed() is None:
            self._s_w13 = pack_parts((self.s_w1, self.s_w3), 0)

    def _pack_stale(self) -> bool:
        """Whether :meth:`pack_gate_up` has something to (re)pack."""
        return self._packed() is None or (self._can_fuse_shared() and self._shared_group() is None)

    def _can_fuse_shared(self) -> bool:
        """Whether the shared expert can be one more group of the routed products (:data:`FUSE_SHARED`):
        one shared expert of the routed width, clamped as they are."""
        return (
            FUSE_SHARED
            and self.shared
            and self.s_w1.shape == self.w1.shape[1:]
            and self.shared_limit == self.limit
        )

    @torch.no_grad()
    def _pack_with_shared(self) -> None:
        """:meth:`pack_gate_up` with the shared expert as block E of [E + 1, 2I, D] and [E + 1, D, I] tensors:
        w1 / w3 are ``[:E]``'s halves and s_w1 / s_w3 block E's, w2 is ``[:E]`` and s_w2 block E (views)."""
        e, i = self.n_experts, self.w1.shape[1]
        all13 = torch.cat(
            (
                torch.cat((self.w1.data, self.w3.data), 1),
                torch.cat((self.s_w1.data, self.s_w3.data), 0)[None],
            ),
            0,
        )
        all2 = torch.cat((self.w2.data, self.s_w2.data[None]), 0)
        self.w1.data, self.w3.data = all13[:e, :i], all13[:e, i:]
        self.s_w1.data, self.s_w3.data = all13[e, :i], all13[e, i:]
        self.w2.data, self.s_w2.data = all2[:e], all2[e]
        self._w13, self._s_w13, self._all13, self._all2 = all13[:e], all13[e], all13, all2

    def _shared_group(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate-up [E + 1, 2I, D], down [E + 1, D, I]) while every parameter still is its block of them
        (:meth:`_pack_with_shared`; a host-side pointer check), else None (the pack is dropped)."""
        a13, a2 = self._all13, self._all2
        if a13 is None or a2 is None:
            return None
        e = self.n_experts
        if (
            is_packed(a13[:e], (self.w1, self.w3), 1)
            and is_packed(a13[e], (self.s_w1, self.s_w3), 0)
            and is_block(self.w2, a2[:e])
            and is_block(self.s_w2, a2[e])
        ):
            return a13, a2
        self._all13 = self._all2 = None
        return None

    def _packed(self) -> torch.Tensor | None:
        """The packed [E, 2I, D] gate-up tensor if ``w1`` / ``w3`` still are its halves, else None (a host-side
        pointer check: no device work). A stale pack is dropped, so its memory is freed."""
        if self._w13 is not None and not is_packed(self._w13, (self.w1, self.w3), 1):
            self._w13 = None
        return self._w13

    def _shared_packed(self) -> torch.Tensor | None:
        """:meth:`_packed` of the shared expert's [2 * si, D] gate-up tensor."""
        if self._s_w13 is not None and not is_packed(self._s_w13, (self.s_w1, self.s_w3), 0):
            self._s_w13 = None
        return self._s_w13

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The always-on shared expert (one product for gate and up when packed)."""
        # (choice, config shared_expert_clamp) the shared expert uses the routed experts' clamp
        s13 = self._shared_packed() if not torch.is_grad_enabled() else None
        if s13 is None:
            g, u = x @ self.s_w1.t(), x @ self.s_w3.t()
        else:
            g, u = (x @ s13.t()).split(self.s_w1.shape[0], dim=-1)
        return clamped_swiglu(g, u, self.shared_limit) @ self.s_w2.t()

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        for name, p in self.named_parameters():
            if name == "gate_bias":
                p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) / math.sqrt(p.shape[-1]))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [N, k] and weights [N, k] for tokens ``x`` [N, D]."""
        return _route(x, self.gate, self.gate_bias, self.top_k, self.scoring, self.norm_topk, self.scale)

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical slot [N, k] of each token-expert pair: per expert, round robin over its replicas in
        flat (token, k) order (replica counts differ by at most one; deterministic)."""
        pl = self.placement
        if pl is None:
            return ids
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        e = flat[order]
        counts = torch.bincount(flat, minlength=self.n_experts)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(flat.shape[0], device=flat.device) - start[e]
        out = torch.empty_like(flat)
        out[order] = pl.log2phy[e, rank % pl.logcnt[e]]
        return out.view_as(ids)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [N, D], tokens per routed (logical) expert [E] int64)."""
        on, mask = STATIC_MODE.get()
        # where grouped GEMMs apply (CUDA bf16, sm_90+) every call takes them, prefill included: the
        # grouped loop's bincount + .tolist() of the bounds are two host synchronisations per layer and
        # ~7 launches per expert; the grouped products keep the offsets on the device (same outputs up to
        # summation order, the static mode's contract)
        if on or _grouped_ok(x):
            return self._forward_static(x, mask)
        return self._forward_loop(x)

    def _forward_loop(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The grouped loop: expert by expert over its sorted tokens (the ground truth of the other paths)."""
        n = x.shape[0]
        ids, w = self.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=self.n_experts)
        flat = self.slots(ids).reshape(-1)
        nslots = self.n_experts if self.placement is None else self.placement.phy2log.shape[0]
        per_slot = torch.bincount(flat, minlength=nslots)
        weight_of = None if self.placement is None else self.placement.phy2log.tolist()
        order = torch.argsort(flat, stable=True)
        tok = order // self.top_k
        wts = w.reshape(-1)[order]
        # each (token, slot) pair's output lands back in its flat slot; summing the k slots per token
        # is deterministic (no scatter-add) and independent of how the batch was grouped
        buf = x.new_empty(n * self.top_k, x.shape[1])
        bounds = torch.cumsum(per_slot, 0).tolist()
        start = 0
        # batch-invariant mode: an expert's products in chunks of a few rows (it gets a few rows a step)
        with invariant.smaller_chunks(invariant.EXPERT_DIVISOR):
            for slot, end in enumerate(bounds):
                if end > start:
                    e = slot if weight_of is None else weight_of[slot]
                    t = tok[start:end]
                    xs = x[t]
                    h = clamped_swiglu(xs @ self.w1[e].t(), xs @ self.w3[e].t(), self.limit)
                    buf[order[start:end]] = (h @ self.w2[e].t()) * wts[start:end, None]
                start = end
        out = buf.view(n, self.top_k, -1).sum(1)
        if self.shared:
            out = out + self._shared(x)
        return out, counts

    def _forward_static(
        self, x: torch.Tensor, row_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with fixed shapes and no host synchronisation (static mode)."""
        n, e, k = x.shape[0], self.n_experts, self.top_k
        ids, w = self.route(x)
        flat = ids.reshape(-1)
        # the executor's grouped kernel if one is set, else torch._grouped_mm where it applies
        gg = GROUPED_IMPL.get() or (_torch_grouped if _grouped_ok(x) else None)
        if gg is not None:
            # the pack is a plain tensor: under autograd (training) the parameters themselves are used
            infer = not torch.is_grad_enabled()
            if infer and self._pack_stale() and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.pack_gate_up()  # once, on the first eager static step (a graph's warm-up runs one)
            grp = self._shared_group() if infer else None
            counts, tok, place, offs = _dispatch_rows(flat, e, k, row_mask, n if grp is not None else 0)
            xs = x[tok]  # group bounds (offs) over every computed row
            w13, w2 = grp if grp is not None else (self._packed() if infer else None, self.w2)
            if w13 is None:
                g, u = gg(xs, self.w1, offs), gg(xs, self.w3, offs)
            else:
                g, u = gg(xs, w13, offs).split(self.w1.shape[1], dim=-1)
            y = gg(clamped_swiglu(g, u, self.limit), w2, offs)
            if grp is not None:  # the shared expert's rows are the last n (a view: no copy)
                return _combine(y, w, place, n, k, y[n * k :]), counts
            return _combine(y, w, place, n, k, self._shared(x) if self.shared else None), counts
        else:
            counts = _dispatch_rows(flat, e, k, row_mask)[0]
            # top-k ids are distinct: a scatter, no accumulation
            wd = torch.zeros(n, e, dtype=w.dtype, device=x.device).scatter_(1, ids, w)
            out = torch.zeros_like(x)
            for j in range(e):
                h = clamped_swiglu(x @ self.w1[j].t(), x @ self.w3[j].t(), self.limit)
                out = out + (h @ self.w2[j].t()) * wd[:, j, None]
            if self.shared:
                out = out + self._shared(x)
            return out, counts
