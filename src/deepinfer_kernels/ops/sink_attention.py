"""Torch reference of ``sink_attention_rows``: one query row's MQA attention over two per-row key sets
and a per-head sink logit, values = keys (the decode step of V4.1's attention).

- ``q`` [N, H, D]: the N rows' queries (H heads each, roped);
- ``k_a`` [N, A, D] with ``mask_a`` bool [N, A]: each row's window keys (the SWA ring, gathered);
- ``k_b`` [N, B, D] with ``mask_b`` bool [N, B]: each row's top-k compressed keys (gathered), or None;
- ``sink`` [H]: the per-head sink logit, which adds ``exp(sink_h)`` to the softmax denominator and
  nothing to the output;
- ``scale``: the logit scale (1 / sqrt(D)).

Returns [N, H, D] in q's dtype: ``softmax([q k_a^T, q k_b^T, sink] * scale) @ [k_a; k_b; 0]`` with
masked keys at ``-inf``. A row with every key masked returns 0 (only the sink has weight). The reference
forms the concatenated softmax in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


def check_sink_attention_inputs(
    q: torch.Tensor,
    k_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    sink: torch.Tensor,
) -> tuple[int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q: must be [rows, heads, dim], got shape {tuple(q.shape)}")
    n, h, d = q.shape
    sets = [("k_a", "mask_a", k_a, mask_a)] + ([] if k_b is None else [("k_b", "mask_b", k_b, mask_b)])
    for kn, mn, k, m in sets:
        if k.dim() != 3 or k.shape[0] != n or k.shape[2] != d:
            raise ValueError(f"{kn}: must be [{n}, keys, {d}], got {tuple(k.shape)}")
        if k.dtype != q.dtype:
            raise ValueError(f"{kn}: dtype {k.dtype} must equal q's {q.dtype}")
        if m is None or m.dtype != torch.bool or tuple(m.shape) != tuple(k.shape[:2]):
            raise ValueError(
                f"{mn}: must be bool [{n}, {k.shape[1]}], got "
                f"{None if m is None else (m.dtype, tuple(m.shape))}"
            )
    if k_b is None and mask_b is not None:
        raise ValueError("mask_b: given without k_b")
    if sink.shape != (h,):
        raise ValueError(f"sink: must be [{h}], got {tuple(sink.shape)}")
    return n, h, d


@register("sink_attention_rows")
def sink_attention_rows(
    q: torch.Tensor,
    k_a: torch.Tensor,
    mask_a: torch.Tensor,
    k_b: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    check_sink_attention_inputs(q, k_a, mask_a, k_b, mask_b, sink)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k_a if k_b is None else torch.cat([k_a, k_b], 1)
    mask = mask_a if k_b is None else torch.cat([mask_a, mask_b], 1)  # type: ignore[list-item]
    logits = torch.einsum("nhd,nkd->nhk", q.to(acc), keys.to(acc)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_col = sink.to(acc)[None, :, None].expand(q.shape[0], -1, 1)
    p = torch.softmax(torch.cat([logits, sink_col], -1), -1)[..., :-1]
    return torch.einsum("nhk,nkd->nhd", p, keys.to(acc)).to(q.dtype)
