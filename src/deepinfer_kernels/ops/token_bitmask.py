"""Torch reference of ``apply_token_bitmask``: mask logits by a packed int32 grammar bitmask.

Bit ``t % 32`` of word ``t // 32`` of a bitmask row allows token ``t`` (xgrammar's and llguidance's
layout). Disallowed logits become ``-inf``; allowed logits are left untouched, so masking never creates a
NaN. Logit columns past the mask (a logits width larger than ``32 * words``) are disallowed.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS_CACHE.get(device)
    if s is None:
        s = _SHIFTS_CACHE[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]``: True where the token is allowed."""
    words = bitmask.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1  # arithmetic shift; & 1 keeps the bit
    allowed = bits.reshape(*bitmask.shape[:-1], words * 32).bool()
    if vocab_size <= words * 32:
        return allowed[..., :vocab_size]
    pad = torch.zeros(*bitmask.shape[:-1], vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=-1)


@register("apply_token_bitmask")
def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask ``logits`` [batch, vocab] in place with ``bitmask`` [batch, words] and return it.

    ``rows`` (int indices into the batch) restricts masking to those rows: the unconstrained requests of a
    mixed batch are left alone. ``bitmask`` row ``i`` always belongs to ``logits`` row ``i``.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: must be a 2-D floating tensor, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask: must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask: {bitmask.shape[0]} rows but logits has {logits.shape[0]}; one row per logits row")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        logits.masked_fill_(~allowed, float("-inf"))
        return logits
    rows = torch.as_tensor(rows, dtype=torch.long).to(logits.device)
    if rows.dim() != 1:
        raise ValueError(f"rows: must be a 1-D index tensor, got shape {tuple(rows.shape)}")
    if rows.numel() == 0:
        return logits
    if int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]:
        raise IndexError(f"rows: indices must be in [0, {logits.shape[0]}), got [{int(rows.min())}, {int(rows.max())}]")
    allowed = unpack_bitmask(bitmask.index_select(0, rows), logits.shape[1])
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
    return logits
