"""The DSpark drafter: block-parallel drafts conditioned on the target's hidden states.

After a step, a request's last accepted token ``y`` sits at position ``q`` (not yet fed to the target).
The drafter embeds the block ``[y, noise, ..., noise]`` (``dspark_block_size`` tokens, noise id
``dspark_noise_token_id``) at positions ``q .. q + B - 1`` and runs ``num_nextn_predict_layers`` SWA-only
stages over it; block row k yields draft k, the token at position ``q + 1 + k``. Conditioning on the
target, two ways (our construction; docs/model.md):

- *context*: the fused feature ``f_t = W_f norm([s_t^(l) for l in dspark_target_layer_ids])`` of every
  token the target processed (``s^(l)``: layer l's output, streams summed) is turned by each stage into a
  context key (its own ``swa_kv`` of ``ctx_norm(f_t)``); block rows attend to the window of context
  keys ending at ``q - 1`` plus the whole block (bidirectional inside the block). The executor keeps
  these keys in per-stage rings (like the SWA rings), so drafting needs no target recompute;
- *injection*: ``W_c f_(q-1)`` is added to every block row's embedding.

Heads, per block row k, sequential over k because each uses the previous draft ``x_(k-1)`` (``x_(-1) =
y``): logits = ``head(norm(h_k)) + W2 W1[x_(k-1)]`` (the Markov bias, rank ``dspark_markov_rank``,
``head`` shared with the target); confidence ``c_k = sigmoid(w . [norm(h_k); W1[x_(k-1)]] + b)``, the
drafter's estimate that draft k is accepted given the earlier ones were. Greedy rows take the argmax
(draft distribution one-hot), sampled rows draw from ``softmax(logits / T)``; that distribution is what
lossless verification needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.norm import RMSNorm

__all__ = ["DSparkDrafter", "DraftResult", "DraftTarget"]


class DraftTarget(Protocol):
    """What the drafter uses of its target model (``DeepSeekV41`` satisfies it): the shared embedding and
    head, and the cache-free forward for the oracle. A protocol, so the drafter does not import the model
    that owns it (no import cycle)."""

    @property
    def embed(self) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def forward_full(self, token_ids: torch.Tensor, capture: Sequence[int] | None = None) -> Any: ...


@attrs.frozen
class DraftResult:
    """``tokens`` [R, B] int64, ``confidence`` [R, B] in (0, 1), ``probs`` [R, B, V] (draft distributions)."""

    tokens: torch.Tensor
    confidence: torch.Tensor
    probs: torch.Tensor


class DraftStage(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, cfg.num_hidden_layers + stage)  # ratio 0: SWA only
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        i = cfg.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(i, d))
        self.w3 = nn.Parameter(torch.empty(i, d))
        self.w2 = nn.Parameter(torch.empty(d, i))

    def context_keys(self, feat: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.attn.swa_kv(self.ctx_norm(feat), pos)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w1.t()) * (x @ self.w3.t())) @ self.w2.t()


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, t, r, v = cfg.hidden_size, len(cfg.dspark_target_layer_ids), cfg.dspark_markov_rank, cfg.vocab_size
        self.block, self.window = cfg.dspark_block_size, cfg.sliding_window
        self.noise = int(cfg.dspark_noise_token_id)  # type: ignore[arg-type]
        self.target_layers = tuple(cfg.dspark_target_layer_ids)
        self.fuse_norm = RMSNorm(t * d, cfg.rms_norm_eps)
        self.w_fuse = nn.Parameter(torch.empty(d, t * d))
        self.w_cond = nn.Parameter(torch.empty(d, d))
        # typed as what it holds (an nn.ModuleList indexes and iterates as Module)
        self.stages: list[DraftStage] = nn.ModuleList(  # type: ignore[assignment]
            DraftStage(cfg, k) for k in range(cfg.num_nextn_predict_layers)
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_in = nn.Parameter(torch.empty(v, r))  # W1: previous token -> rank-r code
        self.markov_out = nn.Parameter(torch.empty(v, r))  # W2 (as rows): code -> vocab bias
        self.conf_w = nn.Parameter(torch.empty(d + r))
        self.conf_b = nn.Parameter(torch.zeros(1))

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        def rnd(p: torch.Tensor, scale: float) -> None:
            p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) * scale)

        for n in [self.fuse_norm, self.norm] + [
            m for s in self.stages for m in (s.attn_norm, s.ctx_norm, s.ffn_norm)
        ]:
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape, generator=gen, device=gen.device))
        for p in (self.w_fuse, self.w_cond, self.markov_out):
            rnd(p, 1 / math.sqrt(p.shape[-1]))
        rnd(self.markov_in, 1.0)
        for s in self.stages:
            s.attn.reset_parameters(gen)
            for p in (s.w1, s.w3, s.w2):
                rnd(p, 1 / math.sqrt(p.shape[-1]))
        rnd(self.conf_w, 1 / math.sqrt(self.conf_w.shape[0]))

    # ---------------------------------------------------------------- conditioning
    def features(self, layer_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """Fused feature [T, D] from the target layers' outputs (each [T, D], in target_layers order)."""
        return self.fuse_norm(torch.cat(list(layer_states), dim=-1)) @ self.w_fuse.t()

    # ---------------------------------------------------------------- the block
    def run_block(
        self,
        model: DraftTarget,
        y: torch.Tensor,
        q: torch.Tensor,
        cond: torch.Tensor,
        ctx_keys: Sequence[torch.Tensor],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Normed block states [R, B, D]. ``y`` [R] at positions ``q`` [R]; ``cond`` [R, D] = f_(q-1);
        ``ctx_keys[s]`` [R, W, d] stage s's context keys with validity ``ctx_mask`` [R, W]."""
        r, b = y.shape[0], self.block
        toks = torch.full((r, b), self.noise, dtype=torch.long, device=y.device)
        toks[:, 0] = y
        h = model.embed[toks] + (cond @ self.w_cond.t())[:, None, :]
        pos = (q[:, None] + torch.arange(b, device=y.device)[None, :]).reshape(-1)
        mask = torch.cat((ctx_mask, torch.ones(r, b, dtype=torch.bool, device=y.device)), dim=1)
        mask = mask.repeat_interleave(b, dim=0)
        h = h.reshape(r * b, -1)
        for st, ck in zip(self.stages, ctx_keys):
            a = st.attn
            x = st.attn_norm(h)
            qr, _ = a.queries(x, pos)
            keys = torch.cat((ck, a.swa_kv(x, pos).view(r, b, -1)), dim=1).repeat_interleave(b, dim=0)
            h = h + a.output(sink_attention(qr, keys, mask, None, None, a.attn_sink, a.scale))
            h = h + st.mlp(st.ffn_norm(h))
        return self.norm(h).view(r, b, -1)

    def heads(
        self,
        model: DraftTarget,
        hidden: torch.Tensor,
        y: torch.Tensor,
        temperature: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> DraftResult:
        """Drafts, confidences and draft distributions; rows with temperature 0 are greedy."""
        # probabilities and confidences in >= float32 (a bf16 model's drafts feed a lossless verify)
        cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        base = model.logits(hidden).to(cd)  # [R, B, V]
        greedy = temperature <= 0
        t = torch.where(greedy, torch.ones_like(temperature), temperature).to(base.dtype)
        prev = y
        toks, confs, probs = [], [], []
        for k in range(self.block):
            code = self.markov_in[prev].to(cd)
            lg = base[:, k] + code @ self.markov_out.to(cd).t()
            feat = torch.cat((hidden[:, k].to(cd), code), dim=-1)
            confs.append(torch.sigmoid(feat @ self.conf_w.to(cd) + self.conf_b.to(cd)))
            am = lg.argmax(-1)
            p = torch.softmax(lg / t[:, None], dim=-1)
            if bool((~greedy).any()):
                drawn = torch.multinomial(p.float(), 1, generator=generator).squeeze(1)
                x = torch.where(greedy, am, drawn)
            else:
                x = am
            probs.append(torch.where(greedy[:, None], F.one_hot(am, lg.shape[-1]).to(p.dtype), p))
            toks.append(x)
            prev = x
        return DraftResult(torch.stack(toks, 1), torch.stack(confs, 1), torch.stack(probs, 1))

    # ---------------------------------------------------------------- the oracle
    @torch.no_grad()
    def draft_full(
        self,
        model: DraftTarget,
        prefix: torch.Tensor,
        y: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftResult:
        """Drafts after ``prefix`` (positions 0..q-1) with accepted token ``y`` at q, from a cache-free
        target forward: the ground truth of the executor's cached drafting."""
        q = prefix.shape[0]
        _, _, caps = model.forward_full(prefix, capture=self.target_layers)
        feat = self.features([caps[lid] for lid in self.target_layers])
        kp = torch.arange(q - self.window, q, device=prefix.device)
        valid = kp >= 0
        keys = []
        for st in self.stages:
            k = feat.new_zeros(self.window, st.attn.head_dim)
            k[valid] = st.context_keys(feat[kp[valid]], kp[valid])
            keys.append(k[None])
        dev = prefix.device
        hidden = self.run_block(
            model,
            torch.tensor([y], device=dev),
            torch.tensor([q], device=dev),
            feat[q - 1 :],
            keys,
            valid[None],
        )
        return self.heads(
            model,
            hidden,
            torch.tensor([y], device=dev),
            torch.tensor([temperature], dtype=feat.dtype, device=dev),
            generator,
        )
