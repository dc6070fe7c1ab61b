"""Mixture of experts: sqrt-softplus scoring, selection-only bias, top-k, shared expert, clamped SwiGLU.

Routed experts are computed grouped by expert: token-expert pairs are sorted by expert id and each
expert runs one matmul over its tokens (no per-token Python loop). ``forward`` also returns the number of
tokens each expert received, the load source of EPLB.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.model.config import ModelConfig


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); ``limit`` 0 disables the clamp.

    (choice) the gate is clamped from above only and the up projection on both sides, as in the
    published clamped-SwiGLU variants; sources do not say which side V4.1 clamps.
    """
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def route_scores(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


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

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        for name, p in self.named_parameters():
            if name == "gate_bias":
                p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) / math.sqrt(p.shape[-1]))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [N, k] and weights [N, k] for tokens ``x`` [N, D]."""
        scores = route_scores(x @ self.gate.t(), self.scoring)
        ids = torch.topk(scores + self.gate_bias, self.top_k, dim=-1).indices
        w = scores.gather(-1, ids)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return ids, w * self.scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [N, D], tokens per routed expert [E] int64)."""
        n = x.shape[0]
        ids, w = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = torch.argsort(flat, stable=True)
        tok = order // self.top_k
        wts = w.reshape(-1)[order]
        # each (token, slot) pair's output lands back in its flat slot; summing the k slots per token
        # is deterministic (no scatter-add) and independent of how the batch was grouped
        buf = x.new_empty(n * self.top_k, x.shape[1])
        bounds = torch.cumsum(counts, 0).tolist()
        start = 0
        for e, end in enumerate(bounds):
            if end > start:
                t = tok[start:end]
                xs = x[t]
                h = clamped_swiglu(xs @ self.w1[e].t(), xs @ self.w3[e].t(), self.limit)
                buf[order[start:end]] = (h @ self.w2[e].t()) * wts[start:end, None]
            start = end
        out = buf.view(n, self.top_k, -1).sum(1)
        if self.shared:
            # (choice, config shared_expert_clamp) the shared expert uses the routed experts' clamp
            out = out + clamped_swiglu(x @ self.s_w1.t(), x @ self.s_w3.t(), self.shared_limit) @ self.s_w2.t()
        return out, counts
