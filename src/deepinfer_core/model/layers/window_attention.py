"""Sliding-window attention in query tiles: the prefill's window part without the [n, H, n] logits.

The plain prefill path (``ModelExecutor`` with ``prefill_path="dense"``) lets every query of a chunk
score every key of the chunk through a dense [n, n] mask, although a query at position p sees only keys in
[p - (w - 1), p] (window w): quadratic work and memory where the model is linear. Here the queries are cut
into tiles of ``tile`` rows; the tile of queries [t0, t0 + tile) can only see keys at positions
[t0 - (w - 1), t0 + tile), a window of ``tile + w - 1`` keys (rounded up to a multiple of 8 so the GEMMs
stay aligned; the extra keys lie after every query of the tile and are masked as future keys). All tiles
run as ONE batched GEMM ([tiles, tile * H, d] @ [tiles, d, W]), the band mask is shared by the tiles,
and the window logits are joined with the compressed keys' logits and the sink in one softmax per row, as
:func:`~deepinfer_core.model.layers.attention.sink_attention` does: same maths, only the summation
order of the products differs (and masked keys, whose weight is exactly 0, are never visited).

:func:`window_attention_reference` is the oracle: the dense masks of the plain path through
``sink_attention``.
"""

from __future__ import annotations

import torch

from deepinfer_core.model.fusion import fusable
from deepinfer_core.model.layers.attention import sink_attention, sink_softmax

NEG = float("-inf")


def window_width(tile: int, window: int) -> int:
    """Keys a tile of ``tile`` queries may see (``tile + window - 1``), rounded up to a multiple of 8."""
    return -(-(tile + window - 1) // 8) * 8


def window_keys(
    keys: torch.Tensor, key_pos0: int, q_pos0: int, m: int, window: int, floor: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's keys [T, W, d] and its mask [T, tile, W] for ``m`` queries at q_pos0 + arange(m).

    ``keys`` [K, d] sit at positions key_pos0 + arange(K); a key is visible to query p when
    p - window < pos <= p, pos >= floor and it exists (key_pos0 <= pos < key_pos0 + K). Rows past ``m``
    (the last tile's padding) get masks too; their outputs are dropped by the caller.
    """
    n_t = -(-m // tile)
    width = window_width(tile, window)
    dev = keys.device
    # key position of column j of tile b: q_pos0 + b * tile - (window - 1) + j
    kpos = (
        (q_pos0 - (window - 1))
        + tile * torch.arange(n_t, device=dev)[:, None]
        + torch.arange(width, device=dev)[None, :]
    )
    idx = kpos - key_pos0
    exists = (idx >= 0) & (idx < keys.shape[0]) & (kpos >= floor)
    kw = keys[idx.clamp(0, max(keys.shape[0] - 1, 0))]  # [T, W, d]; out-of-range columns are masked
    i = torch.arange(tile, device=dev)[:, None]
    j = torch.arange(width, device=dev)[None, :]
    band = (j >= i) & (j <= i + (window - 1))  # query i of a tile sees columns i .. i + window - 1
    return kw, band[None] & exists[:, None, :]


@fusable
def window_sink_attention(
    q: torch.Tensor,
    k_win: torch.Tensor,
    mask_win: torch.Tensor,
    k_b: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax per row over the tile's window keys, the row's compressed keys and the sink.

    q [T, t, H, d]; k_win [T, W, d] with mask_win [T, t, W]; k_b [T, t, B, d] with mask_b [T, t, B], or None;
    values are the keys (shared KV). Returns [T, t, H, d].
    """
    n_t, t, h, d = q.shape
    width = k_win.shape[1]
    # the tile's t * H query rows against its W keys: one batched GEMM for all tiles
    la = torch.matmul(q.reshape(n_t, t * h, d), k_win.transpose(1, 2)).view(n_t, t, h, width) * scale
    parts = [la.masked_fill(~mask_win[:, :, None, :], NEG)]
    if k_b is not None and k_b.shape[-2] > 0:
        lb = torch.einsum("sthd,stbd->sthb", q, k_b) * scale
        parts.append(lb.masked_fill(~mask_b[:, :, None, :], NEG))  # type: ignore[index]
    ws, den = sink_softmax(parts, sink.to(q.dtype)[None, None, :, None])
    out = torch.matmul(ws[0].reshape(n_t, t * h, width), k_win).view(n_t, t, h, d)
    if len(ws) == 2:
        out = out + torch.einsum("sthb,stbd->sthd", ws[1], k_b)
    return (out.to(den.dtype) / den).to(q.dtype)


def window_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_pos0: int,
    q_pos0: int,
    window: int,
    floor: int,
    sink: torch.Tensor,
    scale: float,
    k_b: torch.Tensor | None = None,
    mask_b: torch.Tensor | None = None,
    tile: int = 64,
) -> torch.Tensor:
    """Attention of queries q [m, H, d] at positions q_pos0 + arange(m) over the window keys ``keys`` [K, d]
    (positions key_pos0 + arange(K); visible: p - window < pos <= p and pos >= floor) and, per row, the
    compressed keys k_b [m, B, d] (mask_b [m, B]), with the sink: equal to ``sink_attention`` over the dense
    masks (:func:`window_attention_reference`) up to summation order. Returns [m, H, d]."""
    m, h, d = q.shape
    if m == 0:
        return q.new_zeros(0, h, d)
    tile = max(1, min(tile, m))
    n_t = -(-m // tile)
    pad = n_t * tile - m
    kw, mw = window_keys(keys, key_pos0, q_pos0, m, window, floor, tile)
    qt = _pad_rows(q, pad).reshape(n_t, tile, h, d)
    kbt = mbt = None
    if k_b is not None and k_b.shape[-2] > 0:
        nb = k_b.shape[1]
        kbt = _pad_rows(k_b, pad).reshape(n_t, tile, nb, d)
        mbt = _pad_rows(mask_b, pad).reshape(n_t, tile, nb)  # type: ignore[arg-type]
    out = window_sink_attention(qt, kw, mw, kbt, mbt, sink, scale)
    return out.reshape(n_t * tile, h, d)[:m]


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``x`` with ``pad`` zero (False) rows appended (the last tile's padding queries)."""
    return x if pad == 0 else torch.cat((x, x.new_zeros(pad, *x.shape[1:])))


def window_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_pos0: int,
    q_pos0: int,
    window: int,
    floor: int,
    sink: torch.Tensor,
    scale: float,
    k_b: torch.Tensor | None = None,
    mask_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: every query against every key through the dense mask (the plain prefill path's maths)."""
    qp = q_pos0 + torch.arange(q.shape[0], device=q.device)
    kp = key_pos0 + torch.arange(keys.shape[0], device=q.device)
    mask = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window) & (kp[None, :] >= floor)
    return sink_attention(q, keys, mask, k_b, mask_b, sink, scale)
