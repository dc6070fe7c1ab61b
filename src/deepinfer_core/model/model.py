"""The DeepSeek-V4.1-Flash-architecture model (torch, any device) and its cache-free full forward.

``DeepSeekV41`` holds the weights and the layer loop. :meth:`DeepSeekV41.forward_full` runs one whole
sequence with no cache at all (masks over complete matrices): it is the ground truth the cached
:class:`~deepinfer_core.model.executor.ModelExecutor` is tested against.

Part-2 hooks: ``residual`` (mHC replaces :class:`PlainResidual`; the same four methods) and ``engram``
(a ModuleDict keyed by layer id, called on the residual before that layer's attention).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA, ModelConfig
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import candidate_pool, index_scores, mask_scores, topk_mask
from deepinfer_core.model.layers.moe import MoE
from deepinfer_core.model.layers.norm import RMSNorm

log = logging.getLogger(__name__)

# attend(layer_id, attention module, normed input [N, D]) -> attention heads output [N, H, d]
AttendFn = Callable[[int, Attention, torch.Tensor], torch.Tensor]


class PlainResidual(nn.Module):
    """h + sublayer(norm(h)). mHC (part 2) keeps hc_mult streams behind the same four methods."""

    def begin(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def sublayer_input(self, state: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor:
        return state

    def sublayer_output(self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor:
        return state + out

    def end(self, state: torch.Tensor) -> torch.Tensor:
        return state


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg)


class DeepSeekV41(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.residual: nn.Module = PlainResidual()
        self.engram = nn.ModuleDict()  # part 2: {str(layer_id): engram module}
        if cfg.hc_mult > 1 or cfg.engram_layer_ids or cfg.num_nextn_predict_layers:
            log.info("mHC / Engram / DSpark are part 2: this model runs a plain residual, no Engram, no drafter")

    @classmethod
    def from_config(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", init_on_device: bool = False) -> DeepSeekV41:
        """A model with seeded random weights (no files needed).

        Weights are drawn on the CPU by default, so a seed gives the same model on every device;
        ``init_on_device`` draws them on ``device`` instead (fast for wide GPU configs, other values).
        """
        if init_on_device:
            with torch.device(device):
                m = cls(cfg)
            m.reset_parameters(seed, device)
        else:
            m = cls(cfg)
            m.reset_parameters(seed)
        return m.to(dtype=dtype, device=device)

    @torch.no_grad()
    def reset_parameters(self, seed: int, device: str | torch.device = "cpu") -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.embed.copy_(torch.randn(self.embed.shape, generator=gen, device=gen.device))
        if self.head is not None:
            self.head.copy_(torch.randn(self.head.shape, generator=gen, device=gen.device) / math.sqrt(self.cfg.hidden_size))
        for n in [self.norm] + [m for b in self.layers for m in (b.attn_norm, b.ffn_norm)]:
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape, generator=gen, device=gen.device))
        for b in self.layers:
            b.attn.reset_parameters(gen)
            b.ffn.reset_parameters(gen)

    # ------------------------------------------------------------------ shared layer loop
    def run_layers(self, token_ids: torch.Tensor, attend: AttendFn, source_only: AttendFn | None = None,
                   capture: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [N, D] (after the final norm) and expert counts [layers, experts].

        With ``source_only`` (CED prefix prefill), the loop stops at the first decoder layer: that
        layer's input goes to ``source_only`` (which writes the decoder's global KV) and the returned
        hidden state is that input; counts cover the encoder layers only. ``capture`` (a dict whose keys
        are layer ids) receives each listed layer's output residual state (the drafter's conditioning
        input in part 2).
        """
        state = self.residual.begin(self.embed[token_ids])
        counts = []
        for blk in self.layers:
            lid = blk.layer_id
            if str(lid) in self.engram:
                state = self.engram[str(lid)](state, token_ids)
            x = blk.attn_norm(self.residual.sublayer_input(state, lid, 0))
            if source_only is not None and lid == self.cfg.encoder_layers:
                source_only(lid, blk.attn, x)
                return x, torch.stack(counts)
            o = attend(lid, blk.attn, x)
            state = self.residual.sublayer_output(state, blk.attn.output(o), lid, 0)
            y, c = blk.ffn(blk.ffn_norm(self.residual.sublayer_input(state, lid, 1)))
            state = self.residual.sublayer_output(state, y, lid, 1)
            counts.append(c)
            if capture is not None and lid in capture:
                capture[lid] = state
        return self.norm(self.residual.end(state)), torch.stack(counts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed if self.head is None else self.head
        return hidden @ w.t()

    # ------------------------------------------------------------------ the ground truth
    @torch.no_grad()
    def forward_full(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, V] and expert counts of one whole sequence, with no cache (the oracle)."""
        cfg = self.cfg
        t = token_ids.shape[0]
        pos = torch.arange(t, device=token_ids.device)
        i, j = pos[:, None], pos[None, :]
        win = (j <= i) & (j > i - cfg.sliding_window)
        comp: dict[int, torch.Tensor] = {}
        ikeys: dict[int, torch.Tensor] = {}
        sel: dict[int, torch.Tensor] = {}
        pools: dict[int, torch.Tensor] = {}

        def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
            q, lat = a.queries(x, pos)
            kswa = a.swa_kv(x, pos)
            if a.kind == LAYER_SWA:
                return sink_attention(q, kswa, win, None, None, a.attn_sink, a.scale)
            r = a.ratio
            src = cfg.kv_source_of(lid)
            assert src is not None
            e = t // r
            if a.kind == LAYER_FULL:
                comp[lid] = a.compressor.pool(a.compressor.project(x[: e * r]), 0, a.inv_freq)
                ikeys[lid] = a.index_compressor.pool(a.index_compressor.project(x[: e * r]), 0, a.inv_freq)
            visible = (pos + 1) // r
            vis = torch.arange(e, device=pos.device)[None, :] < visible[:, None]
            if a.kind in (LAYER_FULL, LAYER_REINDEX):
                qi, wi = a.indexer(x, lat, pos, a.inv_freq)
                sc = mask_scores(index_scores(qi, wi, ikeys[src]), vis)
                if cfg.uses_candidates(lid):
                    sc = mask_scores(sc, pools[src])
                if lid == cfg.candidate_source_layer_id:
                    pools[lid] = candidate_pool(sc, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                sel[lid] = topk_mask(sc, cfg.index_topk)
            isrc = cfg.index_source_of(lid)
            assert isrc is not None
            return sink_attention(q, kswa, win, comp[src], sel[isrc], a.attn_sink, a.scale)

        hidden, counts = self.run_layers(token_ids, attend)
        return self.logits(hidden), counts
