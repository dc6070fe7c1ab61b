"""Weights that read the same input, stored as row blocks of one tensor: one wide GEMM instead of several.

At decode a layer's projections are weight-bandwidth-bound products of a few dozen rows: several narrow
products of the same input cost a launch each (and cuBLAS's split-K reduce for the narrow ones) where one
product over the concatenated weight streams the same bytes in one kernel. :func:`pack_parts` re-points
the parameters at consecutive blocks of one new tensor (no extra memory once the old storage is freed;
state_dict names and values unchanged); :func:`is_packed` tells whether they still are (a host-side pointer
check: anything that replaces a parameter, ``.to()`` or ``load_state_dict`` with assign, undoes the pack).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def pack_parts(parts: Sequence[nn.Parameter], dim: int) -> torch.Tensor:
    """``parts`` concatenated along ``dim`` into one tensor, each parameter re-pointed at its block."""
    both = torch.cat([p.data for p in parts], dim=dim)
    off = 0
    for p in parts:
        n = p.shape[dim]
        p.data = both.narrow(dim, off, n)
        off += n
    return both


def is_block(p: torch.Tensor, blk: torch.Tensor) -> bool:
    """``p`` is the view ``blk`` (same memory, shape and strides)."""
    return p.data_ptr() == blk.data_ptr() and p.shape == blk.shape and p.stride() == blk.stride()


def is_packed(both: torch.Tensor | None, parts: Sequence[nn.Parameter], dim: int) -> bool:
    """``parts`` still are the consecutive blocks of ``both`` along ``dim`` (nothing replaced their storage)."""
    if both is None or sum(p.shape[dim] for p in parts) != both.shape[dim]:
        return False
    off = 0
    for p in parts:
        n = p.shape[dim]
        if not is_block(p, both.narrow(dim, off, n)):
            return False
        off += n
    return True
