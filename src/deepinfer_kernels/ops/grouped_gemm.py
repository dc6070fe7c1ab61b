"""Torch reference of ``moe_grouped_gemm``: the MoE's expert products over expert-sorted rows.

- ``x`` [R, K]: the rows (token, expert) pairs sorted by expert;
- ``w`` [E, N, K]: one weight matrix per expert (out_features x in_features, as ``nn.Linear`` keeps it);
- ``offs`` int32 [E]: the end offset of each expert's rows (ascending; expert e owns rows
  ``offs[e - 1] .. offs[e]``, expert 0 from 0), ``torch._grouped_mm``'s convention.

Returns [R, N] in x's dtype: row r of expert e is ``x[r] @ w[e].T`` (float32 accumulation); rows at or past
``offs[-1]`` are 0.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


def check_grouped_gemm_inputs(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> tuple[int, int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x: must be [rows, in_features], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w: must be [experts, out_features, {x.shape[1]}], got {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w: dtype {w.dtype} must equal x's {x.dtype}")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs: must be int32 [{w.shape[0]}] (each expert's end row), got {offs.dtype} {tuple(offs.shape)}")
    return x.shape[0], x.shape[1], w.shape[0], w.shape[1]


@register("moe_grouped_gemm")
def moe_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    r, _, e, n = check_grouped_gemm_inputs(x, w, offs)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.arange(r, device=x.device)
    ends = offs.to(device=x.device, dtype=torch.long)
    expert = torch.searchsorted(ends, rows, right=True)  # rows past the last end get expert e (none)
    out = torch.zeros(r, n, dtype=acc, device=x.device)
    for j in range(e):  # a loop over experts, each one masked product (the reference: no host reads)
        sel = (expert == j).to(acc)[:, None]
        out += sel * (x.to(acc) @ w[j].to(acc).t())
    return out.to(x.dtype)
