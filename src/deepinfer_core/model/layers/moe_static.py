"""The MoE's static mode (see :mod:`~deepinfer_core.model.layers.moe`): the context switches that turn it on
(:func:`static_shapes`) and pick its grouped product (:func:`grouped_gemm_impl`), and its fixed-shape
dispatch (a counting sort of the token-expert pairs by expert) and gather-combine back to token order.

Split from ``moe.py`` (the layer); every name here stays importable from there.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from deepinfer_core.model.fusion import fusable

# static mode on in this context (see the module docstring); a context variable, not a module attribute,
# so an executor turns it on for its own steps only
# (on, row mask or None): rows whose mask is False (a CUDA graph's padded rows) are left out of the counts
STATIC_MODE: contextvars.ContextVar[tuple[bool, torch.Tensor | None]] = contextvars.ContextVar(
    "moe_static", default=(False, None)
)

# the grouped product of static mode in this context: None = torch._grouped_mm where it applies; an
# executor's opt-in kernel (the ``moe_grouped_gemm`` op: x [R, K], w [E, N, K], end offsets [E]) otherwise,
# on any device
GROUPED_IMPL: contextvars.ContextVar[Any] = contextvars.ContextVar("moe_grouped_gemm", default=None)


@contextlib.contextmanager
def grouped_gemm_impl(fn: Any) -> Iterator[None]:
    """Static-mode MoE layers run their expert products through ``fn`` (the ``moe_grouped_gemm`` op's
    contract) inside this block; None: ``torch._grouped_mm`` (or the dense fallback)."""
    tok = GROUPED_IMPL.set(fn)
    try:
        yield
    finally:
        GROUPED_IMPL.reset(tok)


@contextlib.contextmanager
def static_shapes(on: bool = True, row_mask: torch.Tensor | None = None) -> Iterator[None]:
    """MoE layers run in static mode (fixed shapes, no host sync) inside this block; ``row_mask`` [N]
    (bool) marks the rows the expert counts include (None: all)."""
    tok = STATIC_MODE.set((on, row_mask))
    try:
        yield
    finally:
        STATIC_MODE.reset(tok)


def _torch_grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The ``moe_grouped_gemm`` contract through ``torch._grouped_mm`` (w [E, N, K] as the layer keeps it)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _placement(
    flat: torch.Tensor, e: int, k: int, row_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counted tokens per expert [E], each pair's place in the expert-sorted order [P], group end offsets
    int32 [E] over every computed row) of the (token, k) pairs' experts ``flat`` [P]."""
    # the stable sort by expert as a counting sort (E is small): a pair's place is the pairs of lower
    # experts plus the earlier pairs of its own; fused kernels instead of a radix sort launch chain, and
    # the per-expert totals are the one-hot's column sums (no zero-filled scatter-add)
    hot = (flat[:, None] == torch.arange(e, device=flat.device)[None, :]).to(torch.int32)  # [P, E]
    upto = torch.cumsum(hot, 0)  # pairs of each expert up to and including this one
    per_expert = upto[-1]
    if row_mask is None:
        counts = per_expert.to(torch.long)
    else:  # masked rows (a graph's padding) are computed but not counted
        keep = row_mask[:, None].expand(-1, k).reshape(-1, 1)
        counts = (hot * keep).sum(0).to(torch.long)
    ends = torch.cumsum(per_expert, 0)
    place = (ends - per_expert)[flat] + upto.gather(1, flat[:, None])[:, 0] - 1
    return counts, place.to(torch.long), ends.to(torch.int32)


@fusable
def _dispatch(flat: torch.Tensor, e: int, k: int, row_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Static mode's dispatch: (counted tokens per expert, the pairs' expert-sorted order, group end
    offsets int32 over every computed row)."""
    counts, place, offs = _placement(flat, e, k, row_mask)
    order = torch.empty_like(place).scatter_(0, place, torch.arange(flat.shape[0], device=flat.device))
    return counts, order, offs


@fusable
def _dispatch_rows(
    flat: torch.Tensor, e: int, k: int, row_mask: torch.Tensor | None, shared_rows: int = 0
) -> tuple[torch.Tensor, ...]:
    """:func:`_dispatch` as the static MoE uses it: (counts, the token of each sorted row [P], each pair's
    sorted row ``place`` [P], offsets). The token is scattered here (one kernel with the sort's last step)
    rather than divided out of the order afterwards (one more launch a layer). ``shared_rows`` = n > 0:
    one more group after the experts' (see :data:`~deepinfer_core.model.layers.moe.FUSE_SHARED`), rows P .. P + n holding tokens 0 .. n - 1
    (the token rows [P + n] and E + 1 offsets; counts and places stay the routed pairs')."""
    counts, place, offs = _placement(flat, e, k, row_mask)
    p = flat.shape[0]
    tok = torch.empty_like(place).scatter_(0, place, torch.arange(p, device=flat.device) // k)
    if shared_rows:
        tok = torch.cat((tok, torch.arange(shared_rows, device=flat.device)))
        offs = torch.cat((offs, torch.full((1,), p + shared_rows, dtype=offs.dtype, device=offs.device)))
    return counts, tok, place, offs


@fusable
def _combine(
    y: torch.Tensor, w: torch.Tensor, place: torch.Tensor, n: int, k: int, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """Expert outputs in sorted order back to (token, k) order by a gather at each pair's sorted row, weighted,
    the k slots summed in k order: the products and sums of weighting the sorted rows and scattering them
    back (the form before, by ``order``), as one gather-reduce instead of a weighting, a scatter and a sum.
    ``shared``: the shared experts' output [n, D], added last (the same sum as adding it after; under the
    glue in the same kernel, not one more a layer)."""
    out = (y[place].view(n, k, -1) * w[:, :, None]).sum(1)
    return out if shared is None else out + shared
