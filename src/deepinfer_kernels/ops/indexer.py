"""Torch references of the lightning indexer: scores ``sum_h w_h * relu(q_h . k)`` and their top-k.

Layout follows DeepGEMM's ``fp8_mqa_logits`` so the adapter can hand tensors over unchanged:

- ``q`` [T, H, D] (one row of H index heads per query token), ``weights`` float [T, H];
- ``keys`` [S, D]: the gathered (dequantised) index keys, e.g. ``kv_load`` of the MXFP4 indexer pool;
- ``key_start`` / ``key_end`` int [T]: query t scores keys ``key_start[t] <= s < key_end[t]`` (its own
  sequence, causal); other entries are ``-inf``.

``indexer_topk(scores, k)`` returns int32 [T, k] key indices of the k largest scores, ``-1`` where a row
has fewer than k valid keys (torch.topk; ties broken however torch does, so tests compare score values).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


def check_indexer_inputs(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor
) -> tuple[int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q: must be [tokens, heads, dim], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if weights.shape != (t, h):
        raise ValueError(f"weights: must be [tokens, heads] = [{t}, {h}], got {tuple(weights.shape)}")
    if keys.dim() != 2 or keys.shape[1] != d:
        raise ValueError(f"keys: must be [num_keys, {d}], got {tuple(keys.shape)}")
    for name, v in (("key_start", key_start), ("key_end", key_end)):
        if v.shape != (t,) or v.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: must be int32/int64 of shape ({t},), got {v.dtype} {tuple(v.shape)}")
    return t, h, d, keys.shape[0]


@register("indexer_scores")
def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor
) -> torch.Tensor:
    """float32 [T, S]: ``sum_h weights[t, h] * relu(q[t, h] . keys[s])`` inside [key_start[t], key_end[t]), else -inf."""
    t, _, _, s = check_indexer_inputs(q, weights, keys, key_start, key_end)
    logits = torch.einsum("thd,sd->ths", q.float(), keys.float()).relu()
    scores = (logits * weights.float()[:, :, None]).sum(dim=1)
    j = torch.arange(s, device=q.device)[None, :]
    valid = (j >= key_start.to(q.device)[:, None]) & (j < key_end.to(q.device)[:, None])
    return scores.masked_fill(~valid, float("-inf")) if t else scores


@register("indexer_topk")
def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [T, k]: indices of the k largest finite scores per row (descending), -1 past the valid ones."""
    if scores.dim() != 2:
        raise ValueError(f"scores: must be [tokens, keys], got shape {tuple(scores.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be a positive int")
    t, s = scores.shape
    kk = min(k, s)
    vals, idx = torch.topk(scores, kk, dim=1)
    idx = torch.where(torch.isfinite(vals), idx, -1).to(torch.int32)
    if kk < k:
        idx = torch.cat([idx, torch.full((t, k - kk), -1, dtype=torch.int32, device=scores.device)], dim=1)
    return idx
