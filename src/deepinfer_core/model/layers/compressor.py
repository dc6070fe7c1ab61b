"""The compressor: pools ``ratio`` consecutive tokens into one compressed KV entry.

Each token contributes a value ``wkv(x)`` and a gate score ``wgate(x) + ape[pos % ratio]``; an entry is
the per-dimension softmax-weighted sum of its group's values, then RMSNorm and RoPE at the entry's
position. Entry j covers tokens [j*ratio, (j+1)*ratio) and exists once token (j+1)*ratio - 1 is seen
(ratio 2 fires on odd positions). Ratio 1 is one entry per token (a plain projection).

A partial group's per-token (value, score) pairs are the compressor state kept in the state pool
between steps; :meth:`Compressor.project` makes them and :meth:`Compressor.pool` turns whole groups into
entries, so the full forward and the cached executor share the maths but not the bookkeeping.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.norm import RMSNorm, rms_norm
from deepinfer_core.model.layers.rope import apply_rope


class Compressor(nn.Module):
    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        ratio: int,
        rope_dim: int,
        eps: float,
        rope_at: str,
        rope_interleave: bool = True,
    ) -> None:
        super().__init__()
        self.ratio, self.out_dim, self.rope_dim, self.rope_at = ratio, out_dim, rope_dim, rope_at
        self.rope_interleave = rope_interleave
        self.wkv = nn.Parameter(torch.empty(out_dim, in_dim))
        if ratio > 1:
            self.wgate = nn.Parameter(torch.empty(out_dim, in_dim))
            self.ape = nn.Parameter(torch.empty(ratio, out_dim))
        self.norm = RMSNorm(out_dim, eps)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        self.wkv.copy_(
            torch.randn(self.wkv.shape, generator=gen, device=gen.device) / math.sqrt(self.wkv.shape[1])
        )
        if self.ratio > 1:
            self.wgate.copy_(
                torch.randn(self.wgate.shape, generator=gen, device=gen.device)
                / math.sqrt(self.wgate.shape[1])
            )
            self.ape.copy_(torch.randn(self.ape.shape, generator=gen, device=gen.device) * 0.5)
        self.norm.weight.copy_(
            1 + 0.1 * torch.randn(self.norm.weight.shape, generator=gen, device=gen.device)
        )

    @property
    def state_dim(self) -> int:
        """Floats of per-token state: value, plus gate score when ratio > 1."""
        return self.out_dim * (2 if self.ratio > 1 else 1)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token pre-pooling state [N, state_dim] (value | score without the positional bias)."""
        v = x @ self.wkv.t()
        if self.ratio == 1:
            return v
        return torch.cat((v, x @ self.wgate.t()), dim=-1)

    def pool(self, state: torch.Tensor, first_entry: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """Entries [G, out_dim] from the states [G*ratio, state_dim] of G consecutive whole groups.

        ``first_entry`` is the index of the first group's entry (for its RoPE position).
        """
        g = state.shape[0] // self.ratio
        assert state.shape[0] == g * self.ratio, "pool() takes whole groups"
        ids = torch.arange(first_entry, first_entry + g, device=state.device)
        # explicit last dim: g may be 0 (a sequence shorter than one group), where -1 is ambiguous
        return self.pool_groups(state.view(g, self.ratio, state.shape[-1]), ids, inv_freq)

    def pool_groups(
        self, groups: torch.Tensor, entry_ids: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """Entries [M, out_dim] from per-group states [M, ratio, state_dim] of entries ``entry_ids`` [M]."""
        return _pool_groups(
            groups,
            entry_ids,
            inv_freq,
            self.ape if self.ratio > 1 else None,
            self.norm.weight,
            self.norm.eps,
            self.ratio,
            self.out_dim,
            self.rope_dim,
            self.rope_at,
            self.rope_interleave,
        )


@fusable
def _pool_groups(
    groups: torch.Tensor,
    entry_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    ape: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    r: int,
    d: int,
    rope_dim: int,
    rope_at: str,
    interleave: bool,
) -> torch.Tensor:
    if r == 1:
        ent = groups[:, 0]
    else:
        assert ape is not None
        v, sc = groups[..., :d], groups[..., d:] + ape.to(groups.dtype)[None]
        ent = (torch.softmax(sc, dim=1) * v).sum(1)
    ent = rms_norm(ent, norm_w, eps)
    pos = entry_ids * r + (r - 1 if rope_at == "last" else 0)
    return apply_rope(ent, pos, inv_freq, rope_dim, interleave)
