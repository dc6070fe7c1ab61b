"""TileLang ``mtp_redistribute``: keep the ``total`` drafts of highest cumulative rate, on the device.

The reference ranks every (request, draft) key ``prod_{j<=k} c[r, j]`` (float64, left to right) by a
stable descending sort of the flattened matrix and keeps ranks below ``total``. Sorting is not needed to
know a rank: rank(r, k) = #{keys greater} + #{equal keys earlier in flat order}. A first kernel forms
the keys (the same float64 products in the same order, so bit-identical keys, -1 for invalid drafts);
then one thread per (request, draft) counts over all R*D keys and, if chosen, atomically adds 1 to its
request's count. Work is
O((R*D)^2), small at engine sizes (R = 1024 requests x D = 5 drafts: 26M compares over 5120 threads), and
there is no sort, no host sync (``total`` may stay on the device), and the result is exact.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel
from deepinfer_kernels.ops.mtp_redistribute import check_inputs
from deepinfer_kernels.ops.mtp_redistribute import mtp_redistribute as _reference
from deepinfer_kernels.registry import register

_THREADS = 128


def _build_keys(d: int):
    r_dyn = T.dynamic("R")

    @T.prim_func
    def keys(
        conf: T.Tensor((r_dyn, d), "float64"),
        nd: T.Tensor((r_dyn,), "int32"),
        key: T.Tensor((r_dyn * d,), "float64"),
    ):
        # One thread per request: the running product left to right, as the reference and the C++ greedy.
        with T.Kernel(T.ceildiv(r_dyn, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            run = T.alloc_var("float64")
            r = bx * _THREADS + tx
            if r < r_dyn:
                run = T.float64(1.0)
                for k in T.unroll(d):
                    run = run * conf[r, k]
                    key[r * d + k] = T.if_then_else(k < nd[r], run, T.float64(-1.0))

    return keys


def _build_rank(d: int):
    n_dyn = T.dynamic("n")
    r_dyn = T.dynamic("R")

    @T.prim_func
    def rank(
        key: T.Tensor((n_dyn,), "float64"), total: T.Tensor((1,), "int64"), out: T.Tensor((r_dyn,), "int32")
    ):
        # One thread per (request, draft); all threads of a warp read the same key at once (a broadcast).
        with T.Kernel(T.ceildiv(n_dyn, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            mine = T.alloc_var("float64")
            other = T.alloc_var("float64")
            cnt = T.alloc_var("int64")
            flat = bx * _THREADS + tx
            if flat < n_dyn:
                mine = key[flat]
                if mine >= T.float64(0):  # valid drafts only; invalid keys (-1) rank below all valid ones
                    cnt = T.int64(0)
                    for f in T.serial(n_dyn):
                        other = key[f]
                        cnt = cnt + T.if_then_else((other > mine) | ((other == mine) & (f < flat)), 1, 0)
                    if cnt < total[0]:
                        T.atomic_add(out[flat // d], 1)

    return rank


@register("mtp_redistribute", "cuda")
def mtp_redistribute(
    total: int | torch.Tensor, confidences: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract and result as the reference; ``total`` may be a 0-d device tensor (no sync)."""
    if not HAVE_TILELANG or confidences.device.type != "cuda":
        return _reference(total, confidences, num_drafts)
    r, d, total_0d = check_inputs(total, confidences, num_drafts)
    dev = confidences.device
    total_t = total_0d.reshape(1)
    if num_drafts is None:
        nd = torch.full((r,), d, dtype=torch.int32, device=dev)
    else:
        nd = num_drafts.to(device=dev, dtype=torch.int32).clamp(0, d)
    out = torch.zeros(r, dtype=torch.int32, device=dev)
    if r == 0 or d == 0:
        return out
    keys = torch.empty(r * d, dtype=torch.float64, device=dev)
    compile_kernel(("mtp_keys", d), lambda: _build_keys(d))(
        confidences.to(torch.float64).contiguous(), nd.contiguous(), keys
    )
    compile_kernel(("mtp_rank", d), lambda: _build_rank(d))(keys, total_t, out)
    return out
