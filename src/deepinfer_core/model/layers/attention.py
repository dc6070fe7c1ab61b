"""Attention of one layer: low-rank queries, one shared KV head (MQA), attention sinks, grouped output.

Every layer owns a sliding-window KV (``wkv``, one vector per token, value = key, RoPE on the last dims).
Layers with compress ratio > 0 also attend to compressed entries of their group's Full layer, selected
by the lightning indexer. The projections live here; which keys a query sees is decided by the caller
(the full forward with masks, the executor from its caches), and :func:`sink_attention` does the maths.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_core.model import invariant
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, ModelConfig
from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.compressor import Compressor
from deepinfer_core.model.layers.indexer import IndexerQuery
from deepinfer_core.model.layers.norm import RMSNorm
from deepinfer_core.model.layers.packing import is_packed, pack_parts
from deepinfer_core.model.layers.rope import apply_rope_, norm_rope, rope_inv_freq


class Attention(nn.Module):
    inv_freq: torch.Tensor  # a buffer (register_buffer below), declared for its type

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kind = cfg.layer_kind(layer_id)
        self.ratio = cfg.ratio(layer_id)
        h, d, r = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.n_heads, self.head_dim, self.rope_dim, self.o_groups = h, d, r, cfg.o_groups
        self.rope_interleave = il = cfg.rope_interleave
        self.scale = 1.0 / math.sqrt(d)
        self.wq_a = nn.Parameter(torch.empty(cfg.q_lora_rank, cfg.hidden_size))
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Parameter(torch.empty(h * d, cfg.q_lora_rank))
        self.wkv = nn.Parameter(torch.empty(d, cfg.hidden_size))
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # grouped output projection: each group of heads -> o_lora_rank, then all groups -> hidden
        self.wo_a = nn.Parameter(torch.empty(cfg.o_groups, cfg.o_lora_rank, (h // cfg.o_groups) * d))
        self.wo_b = nn.Parameter(torch.empty(cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank))
        self.attn_sink = nn.Parameter(torch.empty(h))
        # (choice) compressed layers use compress_rope_theta (+ YaRN); SWA-only layers use rope_theta
        if self.ratio > 0 and cfg.compress_rope_theta is not None:
            base, scaling = cfg.compress_rope_theta, cfg.rope_scaling
        else:
            base, scaling = cfg.rope_theta, None
        # layers with equal rope_params share one inv_freq tensor (DeepSeekV41 re-shares it after every
        # .to()): the decode step's cos / sin cache (rope.cached_angles) is keyed by the tensor
        self.rope_params = (r, float(base), None if scaling is None else repr(sorted(scaling.items())))
        self.register_buffer("inv_freq", rope_inv_freq(r, base, scaling), persistent=False)
        if self.kind == LAYER_FULL:
            self.compressor = Compressor(
                cfg.hidden_size, d, self.ratio, r, cfg.rms_norm_eps, cfg.compress_rope_position, il
            )
            self.index_compressor = Compressor(
                cfg.hidden_size,
                cfg.index_head_dim,
                self.ratio,
                r,
                cfg.rms_norm_eps,
                cfg.compress_rope_position,
                il,
            )
        if self.kind in (LAYER_FULL, LAYER_REINDEX):
            self.indexer = IndexerQuery(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, r, il
            )
        self._x_pack: torch.Tensor | None = None  # the x-reading projections as one tensor (pack_inputs)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        for p in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) / math.sqrt(p.shape[-1]))
        for n in (self.q_norm, self.kv_norm):
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape, generator=gen, device=gen.device))
        self.attn_sink.copy_(torch.randn(self.attn_sink.shape, generator=gen, device=gen.device) * 0.5)
        for m in ("compressor", "index_compressor", "indexer"):
            if hasattr(self, m):
                getattr(self, m).reset_parameters(gen)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [N, H, d] roped, query latent [N, q_lora_rank] for the indexer)."""
        return self.queries_from(x @ self.wq_a.t(), positions)

    def queries_from(
        self, lat_raw: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`queries` from the product ``x @ wq_a.t()`` (:meth:`input_products`)."""
        lat = self.q_norm(lat_raw)
        q = (lat @ self.wq_b.t()).view(-1, self.n_heads, self.head_dim)
        # in place (q is this call's own product): only the rope dims are read and written, not all d
        return apply_rope_(q, positions, self.inv_freq, self.rope_dim, self.rope_interleave), lat

    def swa_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Sliding-window KV [N, d] (normed, roped)."""
        return self.swa_kv_from(x @ self.wkv.t(), positions)

    def swa_kv_from(self, kv_raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`swa_kv` from the product ``x @ wkv.t()`` (:meth:`input_products`)."""
        n = self.kv_norm
        return norm_rope(
            kv_raw, n.weight, n.eps, positions, self.inv_freq, self.rope_dim, self.rope_interleave
        )

    # ------------------------------------------------------------------ the input projections as one
    def input_weights(self) -> list[nn.Parameter]:
        """Every projection that reads the layer input x, in :meth:`input_products` order: the query
        latent, the SWA key, (Full) the compressor's value / gate then the index compressor's, (Full /
        Reindex) the indexer's head weights. The compressor blocks are adjacent, in the order of the
        concatenated ``project`` outputs that the decode step's compressor state is."""
        ws = [self.wq_a, self.wkv]
        if self.kind == LAYER_FULL:
            for c in (self.compressor, self.index_compressor):
                ws += [c.wkv, c.wgate] if c.ratio > 1 else [c.wkv]
        if self.kind in (LAYER_FULL, LAYER_REINDEX):
            ws.append(self.indexer.weights_proj)
        return ws

    def pack_inputs(self) -> None:
        """Store :meth:`input_weights` as row blocks of one tensor (``layers.packing``): a decode step then
        computes them in ONE product of the layer input (2-7 narrow GEMMs and their split-K reduces
        become one wider GEMM). Idempotent; undone by anything that replaces a parameter."""
        if not is_packed(self._x_pack, self.input_weights(), 0):
            self._x_pack = pack_parts(self.input_weights(), 0)

    def input_products(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"q": x @ wq_a.t(), "kv": x @ wkv.t(), "comp" (Full): the compressor state (value | gate of the
        compressor then of the index compressor, as ``torch.cat`` of their ``project``), "iw" (Full /
        Reindex): x @ indexer.weights_proj.t()}. Without autograd the weights are packed on the first
        call outside a CUDA graph capture (:meth:`pack_inputs`) and the products are column slices of
        one GEMM (views; the same sums, one product); under autograd, separate products."""
        ws = self.input_weights()
        infer = not torch.is_grad_enabled()
        packed = infer and is_packed(self._x_pack, ws, 0)
        if infer and not packed and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.pack_inputs()
            packed = True
        if packed:
            assert self._x_pack is not None
            y = x @ self._x_pack.t()
            widths = [w.shape[0] for w in ws]
            parts = list(y.split(widths, dim=-1))
            if self.kind == LAYER_FULL:  # the compressor blocks are adjacent columns: one slice, no copy
                lo = widths[0] + widths[1]
                parts = [parts[0], parts[1], y[..., lo : lo + sum(widths[2:-1])], parts[-1]]
        else:
            parts = [x @ self.wq_a.t(), x @ self.wkv.t()]
            if self.kind == LAYER_FULL:
                parts.append(
                    torch.cat((self.compressor.project(x), self.index_compressor.project(x)), dim=-1)
                )
            if self.kind in (LAYER_FULL, LAYER_REINDEX):
                parts.append(x @ self.indexer.weights_proj.t())
        out = {"q": parts[0], "kv": parts[1]}
        if self.kind == LAYER_FULL:
            out["comp"] = parts[2]
        if self.kind in (LAYER_FULL, LAYER_REINDEX):
            out["iw"] = parts[-1]
        return out

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """[N, H, d] -> [N, hidden] through the grouped low-rank output projection."""
        n = o.shape[0]
        og = o.reshape(n, self.o_groups, -1)
        if torch.is_grad_enabled() or invariant.active():
            # (batch-invariant mode: the einsum is row-chunked, the bmm through ``out=`` is not)
            mid = torch.einsum("ngk,grk->ngr", og, self.wo_a)
        else:
            # the batched product (over groups) written straight into [N, G, R] layout through a transposed
            # out view (cuBLAS takes its row stride), so the reshape below is a view, not a copy kernel
            # (``out=`` does not take autograd: training keeps the einsum, the same products)
            mid = torch.empty(n, self.o_groups, self.wo_a.shape[1], dtype=o.dtype, device=o.device)
            torch.bmm(og.transpose(0, 1), self.wo_a.transpose(1, 2), out=mid.transpose(0, 1))
        return mid.reshape(n, -1) @ self.wo_b.t()


@fusable
def sink_attention(
    q: torch.Tensor,
    k_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over two key sets plus a per-head sink logit; values are the keys (shared KV).

    q [N, H, d]; k_a either [A, d] (shared by all rows) or [N, A, d] (per row) with mask_a [N, A]; k_b
    likewise [B, d] or [N, B, d] with mask_b [N, B]. The sink adds exp(sink_h) to each head's denominator.
    """
    la = torch.einsum("nhd,ad->nha" if k_a.dim() == 2 else "nhd,nad->nha", q, k_a) * scale
    parts = [la.masked_fill(~mask_a[:, None, :], float("-inf"))]
    if k_b is not None and k_b.shape[-2] > 0:
        eq = "nhd,bd->nhb" if k_b.dim() == 2 else "nhd,nbd->nhb"
        lb = torch.einsum(eq, q, k_b) * scale
        parts.append(lb.masked_fill(~mask_b[:, None, :], float("-inf")))  # type: ignore[index]
    ws, den = sink_softmax(parts, sink.to(q.dtype)[None, :, None])
    out = torch.einsum("nha,ad->nhd" if k_a.dim() == 2 else "nha,nad->nhd", ws[0], k_a)
    if len(ws) == 2:
        eq = "nhb,bd->nhd" if k_b.dim() == 2 else "nhb,nbd->nhd"  # type: ignore[union-attr]
        out = out + torch.einsum(eq, ws[1], k_b)
    return (out.to(den.dtype) / den).to(q.dtype)


def sink_softmax(parts: list[torch.Tensor], sink: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Unnormalised weights ``exp(l - m)`` of each logit part (in the part's dtype) and the denominator
    (the sink's ``exp`` included, in float32 or wider), ``m`` the row max over the parts and the sink
    (broadcast against the parts' rows, one column). ``sum_p weights_p @ values_p / den`` is one softmax
    over ``cat(parts, sink)``, without the concatenation: a slice of that softmax has an odd row stride
    (the one sink column), which sends the probability x value products to cuBLAS's alignment-1
    kernels (H200 profile, 2026-12-01: ~0.25 ms of a 4.9 ms wide decode step). The sink is finite, so a
    row whose keys are all masked gets weight 0 everywhere, not NaN."""
    acc = torch.promote_types(sink.dtype, torch.float32)
    s = m = sink.to(acc)
    for lg in parts:
        m = torch.maximum(m, lg.amax(-1, keepdim=True).to(acc))
    den = torch.exp(s - m)
    ws = []
    for lg in parts:
        w = torch.exp(lg.to(acc) - m)
        den = den + w.sum(-1, keepdim=True)
        ws.append(w.to(lg.dtype))  # the products run in the keys' dtype, as a softmax's output would
    return ws, den
