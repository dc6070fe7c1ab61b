"""The DeepSeek-V4.1-Flash-architecture model (torch, any device) and its cache-free full forward.

``DeepSeekV41`` holds the weights and the layer loop. :meth:`DeepSeekV41.forward_full` runs one whole
sequence with no cache at all (masks over complete matrices): it is the ground truth the cached
:class:`~deepinfer_core.model.executor.ModelExecutor` is tested against.

Part 2: ``residual`` is :class:`~deepinfer_core.model.mhc.MHCResidual` when ``hc_mult > 1`` (else
:class:`PlainResidual`, same methods); ``engram`` holds an :class:`EngramLayer` per configured layer, fed
with rows the ``engram`` component's hasher and tables return (:meth:`DeepSeekV41.engram_rows`);
``drafter`` is the DSpark drafter when ``num_nextn_predict_layers > 0``; every MoE accepts an expert
placement (:meth:`DeepSeekV41.set_expert_placement`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA, ModelConfig
from deepinfer_core.model.drafter import DSparkDrafter
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.engram import EngramLayer
from deepinfer_core.model.layers.indexer import candidate_pool, index_scores, mask_scores, topk_mask
from deepinfer_core.model.layers.moe import MoE
from deepinfer_core.model.layers.norm import RMSNorm
from deepinfer_core.model.mhc import MHCResidual

log = logging.getLogger(__name__)

# attend(layer_id, attention module, normed input [N, D]) -> attention heads output [N, H, d]
AttendFn = Callable[[int, Attention, torch.Tensor], torch.Tensor]


def _to_device(t: torch.Tensor, dev: torch.device, dt: torch.dtype) -> torch.Tensor:
    """``t.to(dev, dt)``; host rows to a CUDA device go through pinned memory without a blocking copy, which
    would wait for the device's queued work (the decode step's one host synchronisation otherwise)."""
    if t.device.type == "cpu" and dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True).to(dt)
    return t.to(dev, dt)


class Residual(Protocol):
    """The residual stream around a layer's two sublayers (0 attention, 1 MoE): ``begin`` makes the state
    from the embedding, ``sublayer_input`` / ``sublayer_output`` read a sublayer's input from it and fold
    its output back, ``handover`` / ``sublayer_input_normed`` are those with the sublayer's RMSNorm
    (what the layer loop calls: an implementation may fuse them), ``collapse`` / ``end`` give [T, D]."""

    def begin(self, h: torch.Tensor) -> torch.Tensor: ...
    def sublayer_input(self, state: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor: ...
    def sublayer_output(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int
    ) -> torch.Tensor: ...
    def sublayer_input_normed(
        self, state: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> torch.Tensor: ...
    def handover(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def collapse(self, state: torch.Tensor) -> torch.Tensor: ...
    def end(self, state: torch.Tensor) -> torch.Tensor: ...


class PlainResidual(nn.Module):
    """h + sublayer(norm(h)): the :class:`Residual` of one stream (mHC, :class:`MHCResidual`, keeps
    hc_mult streams behind the same methods)."""

    def begin(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def sublayer_input(self, state: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor:
        return state

    def sublayer_output(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int
    ) -> torch.Tensor:
        return state + out

    def sublayer_input_normed(
        self, state: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> torch.Tensor:
        """``norm(sublayer_input(...))`` (mHC fuses the two)."""
        return norm(state)

    def handover(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``sublayer_output`` of ``sub``, ``sublayer_input_normed`` of ``sub + 1``) (mHC fuses them)."""
        new = state + out
        return new, norm(new)

    def collapse(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def end(self, state: torch.Tensor) -> torch.Tensor:
        return state


# Engram tables are drawn in memory only up to this many values; bigger ones must be given
_MAX_RANDOM_TABLE_VALUES = 1 << 27


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
        # typed as what they hold: nn.ModuleList / ModuleDict index and iterate as Module (whose attributes
        # mypy reads as Tensor | Module)
        self.layers: list[Block] = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))  # type: ignore[assignment]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = (
            None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        )
        self.residual: Residual = MHCResidual(cfg) if cfg.hc_mult > 1 else PlainResidual()
        self.engram: dict[str, EngramLayer] = nn.ModuleDict(  # type: ignore[assignment]  # as self.layers
            {str(i): EngramLayer(cfg, i) for i in cfg.engram_layer_ids}
        )
        self.drafter = DSparkDrafter(cfg) if cfg.num_nextn_predict_layers else None
        self._engram_hasher: Any = None
        self._engram_tables: dict[int, Any] | None = None
        self._share_rope_freqs()

    def _share_rope_freqs(self) -> None:
        """One inv_freq tensor per distinct ``Attention.rope_params`` (the first layer's): the decode step
        then computes cos / sin once per frequency set, not once per layer (rope.cached_angles keys on the
        tensor). Same values: the layers' own buffers were equal, and stay so through any ``.to()``."""
        first: dict[Any, Attention] = {}
        for m in self.modules():
            if isinstance(m, Attention):
                owner = first.setdefault(m.rope_params, m)
                if owner is not m and owner.inv_freq.device == m.inv_freq.device:
                    m.inv_freq = owner.inv_freq

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> DeepSeekV41:
        # nn.Module.to / cuda / half convert each module's buffers separately: shared tensors come out as
        # equal copies, shared again here
        out = super()._apply(fn, recurse)
        self._share_rope_freqs()
        return out

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_on_device: bool = False,
    ) -> DeepSeekV41:
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
            self.head.copy_(
                torch.randn(self.head.shape, generator=gen, device=gen.device)
                / math.sqrt(self.cfg.hidden_size)
            )
        for n in [self.norm] + [m for b in self.layers for m in (b.attn_norm, b.ffn_norm)]:
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape, generator=gen, device=gen.device))
        for b in self.layers:
            b.attn.reset_parameters(gen)
            b.ffn.reset_parameters(gen)
        if isinstance(self.residual, MHCResidual):
            self.residual.reset_parameters(gen)
        for e in self.engram.values():
            e.reset_parameters(gen)
        if self.drafter is not None:
            self.drafter.reset_parameters(gen)

    # ------------------------------------------------------------------ Engram rows
    @property
    def engram_hasher(self) -> Any:
        """The ``engram`` component's hasher for this config (identity canonical map)."""
        if self._engram_hasher is None:
            from deepinfer_core.engram import EngramConfig, EngramHasher

            c = self.cfg
            self._engram_hasher = EngramHasher(
                EngramConfig(
                    layer_ids=c.engram_layer_ids,
                    max_ngram=c.engram_max_ngram,
                    heads_per_order=c.engram_n_heads,
                    table_sizes=c.engram_table_sizes,
                    vocab_size=c.vocab_size,
                    pad_id=c.engram_pad_id,
                    seed=c.engram_seed,
                    head_dim=c.engram_head_dim,
                )
            )
        return self._engram_hasher

    @property
    def engram_tables(self) -> dict[int, Any]:
        """{layer id: EngramTable}. Default: seeded N(0, 1) rows in bf16 (``engram_seed``), built on first
        use; a real checkpoint's tables are given with :meth:`set_engram_tables`."""
        if self._engram_tables is None:
            from deepinfer_core.engram import local_table

            h, c = self.engram_hasher, self.cfg
            tables = {}
            for lid in c.engram_layer_ids:
                rows = h.num_rows(lid)
                if rows * c.engram_head_dim > _MAX_RANDOM_TABLE_VALUES:
                    raise ValueError(
                        f"engram_table_sizes={c.engram_table_sizes}: layer {lid}'s table has {rows:,} "
                        "rows, too big to draw at random; give real tables with set_engram_tables()"
                    )
                g = torch.Generator().manual_seed(c.engram_seed * 1000003 + lid)
                vals = torch.randn(rows, c.engram_head_dim, generator=g)
                tables[lid] = local_table(vals.to(torch.bfloat16), None, out_dtype=torch.float32)
            self._engram_tables = tables
        return self._engram_tables

    def set_engram_tables(self, tables: Mapping[int, Any]) -> None:
        """Use these ``EngramTable``s (one per Engram layer, ``num_rows`` and ``row_dim`` checked)."""
        want = set(self.cfg.engram_layer_ids)
        if set(tables) != want:
            raise ValueError(f"tables: keys {sorted(tables)}, expected the Engram layers {sorted(want)}")
        for lid, t in tables.items():
            if t.num_rows != self.engram_hasher.num_rows(lid) or t.row_dim != self.cfg.engram_head_dim:
                raise ValueError(
                    f"tables[{lid}]: {t.num_rows} x {t.row_dim}, expected "
                    f"{self.engram_hasher.num_rows(lid)} x {self.cfg.engram_head_dim}"
                )
        self._engram_tables = dict(tables)

    def engram_rows(
        self,
        token_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        tables: Mapping[int, Any] | None = None,
    ) -> dict[int, torch.Tensor]:
        """{layer: fetched rows [T, orders * heads * head_dim]} in the model dtype. ``cu_seqlens`` /
        ``context`` as in ``EngramHasher.hash`` (context continues sequences across steps); ``tables``
        defaults to :attr:`engram_tables` (the executor passes its placement's tables)."""
        if not self.cfg.engram_layer_ids:
            return {}
        h = self.engram_hasher
        rows = h.hash(
            token_ids.cpu(),
            None if cu_seqlens is None else cu_seqlens.cpu(),
            None if context is None else context.cpu(),
        )
        return self.engram_fetch(rows, tables)

    def engram_fetch(
        self, rows: torch.Tensor, tables: Mapping[int, Any] | None = None
    ) -> dict[int, torch.Tensor]:
        """{layer: rows [T, row_dim]} in the model dtype for hashed row ids [L, T, columns] (the output of
        ``EngramHasher.hash`` / ``hash_host``), from ``tables`` (default :attr:`engram_tables`)."""
        tabs = self.engram_tables if tables is None else tables
        h = self.engram_hasher
        dt, dev = self.embed.dtype, self.embed.device
        return {
            lid: _to_device(tabs[lid].fetch(rows[h.layer_index(lid)]).reshape(rows.shape[1], -1), dev, dt)
            for lid in self.cfg.engram_layer_ids
        }

    # ------------------------------------------------------------------ expert placement
    def set_expert_placement(self, phy2log: Any, log2phy: Any = None, logcnt: Any = None) -> None:
        """Route every layer's tokens over physical expert slots (EPLB's ``phy2log`` [layers, slots];
        ``log2phy`` / ``logcnt`` are derived when omitted and checked when given). None restores the
        plain one-slot-per-expert layout. Outputs do not change: replicas share their expert's weights."""
        from deepinfer_core.model.layers.moe import SlotPlacement

        if phy2log is None:
            for b in self.layers:
                b.ffn.placement = None
            return
        places = SlotPlacement.from_eplb(
            phy2log, log2phy, logcnt, self.cfg.num_hidden_layers, self.cfg.n_routed_experts
        )
        dev = self.embed.device
        for b, p in zip(self.layers, places):
            b.ffn.placement = p.to(dev)

    # ------------------------------------------------------------------ shared layer loop
    def run_layers(
        self,
        token_ids: torch.Tensor,
        attend: AttendFn,
        source_only: AttendFn | None = None,
        capture: dict[int, torch.Tensor] | None = None,
        engram_rows: Mapping[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [N, D] (after the final norm) and expert counts [layers, experts].

        With ``source_only`` (CED prefix prefill), the loop stops at the first decoder layer: that
        layer's input goes to ``source_only`` (which writes the decoder's global KV) and the returned
        hidden state is that input; counts cover the encoder layers only. ``capture`` (a dict whose keys
        are layer ids) receives each listed layer's output residual state, streams summed ([T, D]; the
        drafter's conditioning input). ``engram_rows`` ({layer: [T, row_dim]}, see :meth:`engram_rows`)
        feeds the Engram layers; None fetches them here for one sequence without context.
        """
        if engram_rows is None and len(self.engram):
            engram_rows = self.engram_rows(token_ids)
        state = self.residual.begin(self.embed[token_ids])
        counts: list[torch.Tensor] = []
        for blk in self.layers:
            lid = blk.layer_id
            if str(lid) in self.engram:
                state = self.engram[str(lid)](state, engram_rows[lid])  # type: ignore[index]
            x = self.residual.sublayer_input_normed(state, lid, 0, blk.attn_norm)
            if source_only is not None and lid == self.cfg.encoder_layers:
                source_only(lid, blk.attn, x)
                self.residual.end(state)  # drops pending coefficients
                return x, torch.stack(counts)
            o = attend(lid, blk.attn, x)
            # the attention's update and the MoE's normalised input in one step (mHC: one fused function)
            state, x = self.residual.handover(state, blk.attn.output(o), lid, 0, blk.ffn_norm)
            y, c = blk.ffn(x)
            state = self.residual.sublayer_output(state, y, lid, 1)
            counts.append(c)
            if capture is not None and lid in capture:
                capture[lid] = self.residual.collapse(state)
        return self.norm(self.residual.end(state)), torch.stack(counts)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's [V, D] weight (the embedding when tied)."""
        return self.embed if self.head is None else self.head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head_weight.t()

    # ------------------------------------------------------------------ the ground truth
    @torch.no_grad()
    def forward_full(self, token_ids: torch.Tensor, capture: Sequence[int] | None = None) -> Any:
        """Logits [T, V] and expert counts of one whole sequence, with no cache (the oracle); with
        ``capture`` (layer ids) also {layer: output state [T, D]} as a third element."""
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
                    pools[lid] = candidate_pool(
                        sc, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks
                    )
                sel[lid] = topk_mask(sc, cfg.index_topk)
            isrc = cfg.index_source_of(lid)
            assert isrc is not None
            return sink_attention(q, kswa, win, comp[src], sel[isrc], a.attn_sink, a.scale)

        # run_layers fills a state for every key it is given
        caps = None if capture is None else cast(dict[int, torch.Tensor], dict.fromkeys(capture))
        hidden, counts = self.run_layers(token_ids, attend, capture=caps)
        if caps is not None:
            return self.logits(hidden), counts, caps
        return self.logits(hidden), counts
