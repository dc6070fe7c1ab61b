"""Torch references of the Engram device ops: ``engram_hash`` and ``engram_gather``.

``engram_hash`` keeps tile_kernels' ``engram_hash`` signature and layout so the two can be compared bit
for bit on the GPU:

- ``ngram_token_ids`` [T, N] int: column k is the (canonical) token k positions back, k = 0 the token
  itself, already padded at sequence starts;
- ``multipliers`` int64 [L, N], ``vocab_sizes`` int [L, N-1, H] (the primes), ``offsets`` int
  [L, (N-1)*H] (each layer's sub-tables concatenated, offsets restart at 0 per layer);
- output int32 [L, T, (N-1)*H]: for order n = k+1 (k = 1..N-1), ``h_k = XOR_{j<=k} ids[:, j] * m[j]``
  in wrapping signed 64-bit arithmetic, row = ``h_k mod prime`` (floor mod: never negative, as numpy's
  ``%`` in the public references) + offset.

``engram_gather`` reads rows of a bf16 / fp32 table, or of an fp8 e4m3 table with one power-of-two scale
per ``block`` values stored as its biased exponent byte (ue8m0: scale = 2**(code - 127)), and returns
them dequantised.

Both take ``check`` (default True): ``check=False`` skips the value checks (table sizes positive, ids in
range), which read a tensor's min back to the host: a device synchronisation, and no value check can run
under CUDA-graph capture. For callers whose inputs are in range by construction (the hasher's own
parameters, ids it hashed); dtype and shape checks stay (they read no tensor). Out-of-range ids are then
an index error at best, unchecked memory reads in a kernel at worst.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_int(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: must be an integer tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: must be {ndim}-D, got shape {tuple(t.shape)}")


@register("engram_hash")
def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    check: bool = True,
) -> torch.Tensor:
    """Row ids int32 [L, T, (N-1)*H] of every token's n-grams (orders 2..N) in every layer.
    ``check=False``: no table-size check (see the module docstring)."""
    _check_int("ngram_token_ids", ngram_token_ids, 2)
    _check_int("multipliers", multipliers, 2)
    _check_int("vocab_sizes", vocab_sizes, 3)
    _check_int("offsets", offsets, 2)
    n = ngram_token_ids.shape[1]
    layers, heads = vocab_sizes.shape[0], vocab_sizes.shape[2]
    if n < 2:
        raise ValueError(f"ngram_token_ids: needs N >= 2 columns, got shape {tuple(ngram_token_ids.shape)}")
    if tuple(multipliers.shape) != (layers, n):
        raise ValueError(f"multipliers: shape {tuple(multipliers.shape)}, expected [L={layers}, N={n}]")
    if tuple(vocab_sizes.shape) != (layers, n - 1, heads):
        raise ValueError(f"vocab_sizes: shape {tuple(vocab_sizes.shape)}, expected [L, N-1={n - 1}, H]")
    if tuple(offsets.shape) != (layers, (n - 1) * heads):
        raise ValueError(
            f"offsets: shape {tuple(offsets.shape)}, expected [L={layers}, (N-1)*H={(n - 1) * heads}]"
        )
    if check and vocab_sizes.numel() and int(vocab_sizes.min()) <= 0:
        raise ValueError("vocab_sizes: table sizes must be positive")
    dev = ngram_token_ids.device
    # int64 products wrap on overflow (two's complement) on every torch backend, like the CUDA kernel.
    prod = ngram_token_ids.to(torch.int64).unsqueeze(0) * multipliers.to(dev, torch.int64).unsqueeze(
        1
    )  # [L, T, N]
    sizes = vocab_sizes.to(dev, torch.int64)
    h = prod[:, :, 0]
    cols = []
    for k in range(1, n):
        h = torch.bitwise_xor(h, prod[:, :, k])
        cols.append(torch.remainder(h.unsqueeze(-1), sizes[:, k - 1, :].unsqueeze(1)))  # [L, T, H]
    rows = torch.cat(cols, dim=-1) + offsets.to(dev, torch.int64).unsqueeze(1)
    return rows.to(torch.int32)


def dequantize_fp8(data: torch.Tensor, scale_codes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8 e4m3 values [..., D] times 2**(code - 127) per block of D // scale_codes.shape[-1] values."""
    d = data.shape[-1]
    nb = scale_codes.shape[-1]
    if nb == 0 or d % nb:
        raise ValueError(f"scales: {nb} blocks do not divide row_dim {d}")
    vals = data.to(torch.float32).unflatten(-1, (nb, d // nb))
    scale = torch.exp2(scale_codes.to(torch.float32) - 127.0).unsqueeze(-1)
    return (vals * scale).flatten(-2).to(out_dtype)


_INDEX_DTYPES = (torch.int32, torch.int64)  # what index_select takes: the hasher's int32 ids need no cast


@register("engram_gather")
def engram_gather(
    table: torch.Tensor,
    row_ids: torch.Tensor,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    check: bool = True,
) -> torch.Tensor:
    """Rows ``table[row_ids]`` as [*row_ids.shape, D] in ``out_dtype``; fp8 tables need ``scales``
    (uint8 exponent codes [R, D // block]). Ids outside [0, R) raise ``IndexError`` (``check=False``:
    not checked, see the module docstring)."""
    if table.dim() != 2:
        raise ValueError(f"table: must be 2-D [rows, dim], got shape {tuple(table.shape)}")
    if row_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"row_ids: must be an integer tensor, got {row_ids.dtype}")
    rows = table.shape[0]
    if check and row_ids.numel():
        lo, hi = int(row_ids.min()), int(row_ids.max())
        if lo < 0 or hi >= rows:
            raise IndexError(f"row_ids: id {lo if lo < 0 else hi} is outside [0, num_rows={rows})")
    flat = row_ids.reshape(-1)
    if flat.device != table.device or flat.dtype not in _INDEX_DTYPES:  # (a no-op .to still costs host time)
        flat = flat.to(table.device, flat.dtype if flat.dtype in _INDEX_DTYPES else torch.int64)
    is_fp8 = table.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if is_fp8:
        if scales is None:
            raise ValueError("scales: required for an fp8 table")
        if scales.dim() != 2 or scales.shape[0] != rows:
            raise ValueError(f"scales: shape {tuple(scales.shape)}, expected [{rows}, blocks]")
        # Gather the fp8 bytes through a uint8 view: index kernels cover uint8 on every device and torch
        # version, fp8 dtypes not everywhere.
        vals = table.view(torch.uint8).index_select(0, flat).view(table.dtype)
        sc_ids = flat if scales.device == flat.device else flat.to(scales.device)
        out = dequantize_fp8(vals, scales.index_select(0, sc_ids), out_dtype)
    else:
        if scales is not None:
            raise ValueError(f"scales: only fp8 tables take scales, table is {table.dtype}")
        out = table.index_select(0, flat).to(out_dtype)
    return out.reshape(*row_ids.shape, table.shape[1])
