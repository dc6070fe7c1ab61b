"""TileLang ``mtp_redistribute``: keep the ``total`` drafts of highest cumulative rate, on the device.

The reference ranks every (request, draft) key ``prod_{j<=k} c[r, j]`` (float64, left to right) by a
stable descending sort of the flattened matrix and keeps ranks below ``total``. Sorting is not needed to
know a rank: rank(r, k) = #{keys greater} + #{equal keys earlier in flat order}. One thread per
(request, draft) counts over all R*D keys (recomputed on the fly: the same float64 products in the same
order, so bit-identical keys) and, if chosen, atomically adds 1 to its request's count. Work is
O((R*D)^2), small at engine sizes (R = 1024 requests x D = 5 drafts: 26M compares over 5120 threads), and
there is no sort, no host sync (``total`` may stay on the device), and the result is exact.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel
from deepinfer_kernels.ops.mtp_redistribute import mtp_redistribute as _reference
from deepinfer_kernels.registry import register

_THREADS = 128


def _build(d: int):  # noqa: ANN202 - a T.prim_func
    r_dyn = T.dynamic("R")

    @T.prim_func
    def redistribute(
        conf: T.Tensor((r_dyn, d), "float64"),
        nd: T.Tensor((r_dyn,), "int32"),
        total: T.Tensor((1,), "int64"),
        out: T.Tensor((r_dyn,), "int32"),
    ):
        # One thread per (request, draft): its rank is counted over every key; chosen drafts add 1 to out[r].
        with T.Kernel(T.ceildiv(r_dyn * d, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            mine = T.alloc_var("float64")
            other = T.alloc_var("float64")
            rank = T.alloc_var("int64")
            flat = bx * _THREADS + tx
            if flat < r_dyn * d:
                r = flat // d
                k = flat % d
                if k < nd[r]:
                    mine = T.float64(1.0)
                    for j in T.serial(d):  # left to right, as the reference and the C++ greedy
                        if j <= k:
                            mine = mine * conf[r, j]
                    rank = T.int64(0)
                    for f in T.serial(r_dyn * d):
                        r2 = f // d
                        k2 = f % d
                        if k2 < nd[r2]:  # invalid drafts have key -1, below every valid key
                            other = T.float64(1.0)
                            for j in T.serial(d):
                                if j <= k2:
                                    other = other * conf[r2, j]
                            if (other > mine) | ((other == mine) & (f < flat)):
                                rank = rank + 1
                    if rank < total[0]:
                        T.atomic_add(out[r], 1)

    return redistribute


@register("mtp_redistribute", "cuda")
def mtp_redistribute(
    total: int | torch.Tensor, confidences: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract and result as the reference; ``total`` may be a 0-d device tensor (no sync)."""
    if not HAVE_TILELANG or confidences.device.type != "cuda":
        return _reference(total, confidences, num_drafts)
    if confidences.dim() != 2:
        raise ValueError(f"confidences: must be [requests, drafts], got shape {tuple(confidences.shape)}")
    if not confidences.is_floating_point():
        raise ValueError(f"confidences: must be floating point, got {confidences.dtype}")
    r, d = confidences.shape
    dev = confidences.device
    if isinstance(total, torch.Tensor):
        if total.numel() != 1:
            raise ValueError(f"total: must be a scalar, got shape {tuple(total.shape)}")
        total_t = total.reshape(1).to(device=dev, dtype=torch.int64)
    else:
        if int(total) != total or total < 0 or total > r * d:
            raise ValueError(f"total={total!r}: must be an integer in [0, {r * d}] (requests x drafts)")
        total_t = torch.full((1,), int(total), device=dev, dtype=torch.int64)
    if num_drafts is None:
        nd = torch.full((r,), d, dtype=torch.int32, device=dev)
    else:
        if num_drafts.shape != (r,):
            raise ValueError(f"num_drafts: must have shape ({r},), got {tuple(num_drafts.shape)}")
        nd = num_drafts.to(device=dev, dtype=torch.int32).clamp(0, d)
    out = torch.zeros(r, dtype=torch.int32, device=dev)
    if r == 0 or d == 0:
        return out
    kern = compile_kernel(("mtp_redistribute", d), lambda: _build(d))
    kern(confidences.to(torch.float64).contiguous(), nd.contiguous(), total_t, out)
    return out
