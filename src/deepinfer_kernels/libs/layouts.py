"""The conversions from the project's formats to the layouts DeepSeek's kernel libraries take (pure torch).

Each adapter in ``deepinfer_kernels.cuda.adapters`` keeps its library's layout at the boundary and calls
exactly one function here to convert; these run on any device, so they are tested on the CPU against
dequantising references (tests/deepinfer_kernels/test_lib_layouts.py). None of them syncs the host unless
its ``check`` argument asks for it (the decode step is captured in a CUDA graph).

Library facts these follow (read from the pinned sources, see docs/cuda_backend.md "Kernel libraries"):

FlashMLA (sparse decode, ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``)
    k_cache [num_blocks, page, 1, 656] (uint8, int8 or e4m3; each block contiguous); per token 512 e4m3
    (NoPE), 4 float32 scales (one per 128 values, value = e4m3 x scale), 64 bf16 (RoPE): byte for byte the
    project's ``v32`` format (``deepinfer_core.kv.formats.V32Format``, pow2 scale rule), so the cache is
    handed over as a view. indices int32 [b, s_q, topk]: block * page + offset; -1 (any negative or
    out-of-range value) is skipped. On SM90 h_q is 64 or 128; the scheduler works in 64-index blocks, so
    :func:`flash_mla_indices` pads top-k to a multiple of 64 with -1.
DeepGEMM (SM90, 1D2D kernels)
    A: e4m3 [M, K] with float32 scales [M, K / 128] (one per token per 128; DeepGEMM transposes them to
    its TMA-aligned MN-major layout itself, or takes them already so). B: e4m3 [G, N, K] with float32
    scales [G, N / 128, K / 128] (one per 128 x 128 block, contiguous): the release checkpoint's
    ``weight`` / ``weight_scale_inv`` pair as stored. Contiguous layout: each group's rows start at a
    multiple of 128 (``get_mk_alignment_for_contiguous_layout``), ``m_indices`` int32 [M] holds the group of
    every row and -1 on padding rows (whole -1 blocks are skipped). Masked layout: A [G, max_m, K],
    ``masked_m`` int32 [G]. Indexer logits: q e4m3 [T, H, D] (H 32 or 64 on SM90) without scales, keys e4m3
    [S, D] with a float32 scale per key, weights float32 [T, H]; logits = sum_h w[t, h] relu(q[t, h] .
    k[s] * scale[s]). The paged cache is uint8 [blocks, 64, 1, D + 4] whose block stores its 64 keys' D
    bytes first, then their 64 float32 scales (not per token interleaved); ``context_lens`` [B, next_n].
DeepSelect (``deep_select.topk(input [b, n], k, sorted=False, ...)``)
    bf16 or float32 input whose row stride is a multiple of the library's alignment (bytes), 1 <= k <=
    4096, n < 2^23; unsorted (values, indices); ties and -inf entries are ordinary values.
"""

from __future__ import annotations

import attrs
import torch

from deepinfer_core.kv.formats import (
    E4M3_MAX,
    MXFP4Format,
    V32Format,
    e4m3_encode,
)

V32_BYTES = V32Format().bytes_per_token  # 656
FLASH_MLA_TOPK_ALIGN = 64
DG_BLOCK = 128  # DeepGEMM's SM90 scale granularity (K for A, N and K for B)
DG_M_ALIGN = 128  # DeepGEMM's contiguous-layout M alignment (its legacy default)
DG_PAGED_BLOCK = 64  # fp8_paged_mqa_logits' block_kv on SM90
DG_SCALE_FLOOR = 1e-4  # the floor on amax of DeepGEMM's and the checkpoint's quantisers


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_int_tensor(name: str, t: torch.Tensor, dim: int) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != dim
        or t.dtype.is_floating_point
        or t.dtype == torch.bool
    ):
        raise ValueError(
            f"{name}: must be an integer tensor of {dim} dims, got "
            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
        )


# --- FlashMLA: the V3.2 paged cache and the indexer's top-k --------------------------------------------


def flash_mla_kv_cache(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """Our V3.2 paged cache -> FlashMLA's ``k_cache`` [num_blocks, page, 1, 656], a view (no copy).

    ``cache``: uint8 [num_slots, 656] (slot = block * page + offset) or [num_blocks, page, 656], the bytes
    ``V32Format().quantize`` writes. The two layouts are the same bytes (checked against FlashMLA's own
    quantiser in the tests), so only the shape changes. Blocks must be contiguous (FlashMLA's check)."""
    if cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"cache: must be uint8 / int8 / float8_e4m3fn bytes, got {cache.dtype}")
    if cache.shape[-1] != V32_BYTES:
        raise ValueError(f"cache: last dim must be {V32_BYTES} bytes (v32 format), got {tuple(cache.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: must be >= 1")
    if cache.dim() == 2:
        if cache.shape[0] % page_size:
            raise ValueError(f"cache: {cache.shape[0]} slots is not a whole number of pages of {page_size}")
        cache = cache.view(cache.shape[0] // page_size, page_size, V32_BYTES)
    if cache.dim() != 3 or cache.shape[1] != page_size:
        raise ValueError(
            f"cache: must be [slots, 656] or [blocks, {page_size}, 656], got {tuple(cache.shape)}"
        )
    if cache.stride(2) != 1 or cache.stride(1) != V32_BYTES:
        raise ValueError("cache: each block must be contiguous (FlashMLA reads whole blocks)")
    return cache.unsqueeze(2)


def flash_mla_indices(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    seq_start: torch.Tensor | None = None,
    align: int = FLASH_MLA_TOPK_ALIGN,
) -> torch.Tensor:
    """The indexer's top-k -> FlashMLA's ``indices`` int32 [b, s_q, k'] (k' = k rounded up to ``align``).

    ``positions`` int [b, s_q, k] (or [b, k] for s_q = 1): token positions in sequence b (or, with
    ``seq_start`` [b], ids in a flat key space whose sequence b starts at ``seq_start[b]``); negative = none.
    ``block_table`` int [b, W]. Each valid position p becomes ``block_table[b, p // page] * page +
    p % page``; negative positions, positions past the table (p >= W * page) and table entries < 0 become
    -1, as do the padding columns (FlashMLA skips -1)."""
    _check_int_tensor("block_table", block_table, 2)
    if positions.dim() == 2:
        positions = positions.unsqueeze(1)
    _check_int_tensor("positions", positions, 3)
    b, w = block_table.shape
    if positions.shape[0] != b:
        raise ValueError(f"positions: batch {positions.shape[0]} != block_table's {b}")
    if page_size < 1 or align < 1:
        raise ValueError(f"page_size={page_size}, align={align}: must be >= 1")
    pos = positions.to(torch.int64)
    if seq_start is not None:
        _check_int_tensor("seq_start", seq_start, 1)
        pos = torch.where(pos >= 0, pos - seq_start.to(pos.device, torch.int64).view(b, 1, 1), pos)
    valid = (pos >= 0) & (pos < w * page_size)
    blk = torch.where(valid, pos // page_size, 0)
    table = block_table.to(pos.device, torch.int64)
    phys = torch.gather(table, 1, blk.view(b, -1)).view_as(blk)
    valid &= phys >= 0
    out = torch.where(valid, phys * page_size + pos % page_size, -1)
    k = out.shape[-1]
    pad = _ceil(max(k, 1), align) * align - k
    if pad:
        out = torch.nn.functional.pad(out, (0, pad), value=-1)
    return out.to(torch.int32)


def v32_rows(cache: torch.Tensor, flat_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised rows of a FlashMLA-layout cache at ``flat_indices`` (block * page + offset, -1 = none)
    -> (float32 [..., 576], valid bool [...]). The oracle side of the FlashMLA tests (our format's decoder)."""
    flat = cache.reshape(-1, V32_BYTES)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    idx = flat_indices.to(torch.int64)
    valid = (idx >= 0) & (idx < flat.shape[0])
    rows = V32Format().dequantize(flat[torch.where(valid, idx, 0)])
    return rows, valid


# --- DeepGEMM: FP8 blocks (weights), FP8 per-token (activations), the grouped layouts ------------------


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return e4m3_encode(x).view(torch.float8_e4m3fn)


def quantize_fp8_blocks(w: torch.Tensor, block: int = DG_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], float32 scales [..., ceil(N/128), ceil(K/128)]), the release
    checkpoint's rule (``weight_scale_inv``): scale = max(block amax, 1e-4) / 448, w ~ e4m3 x scale.
    Ragged edge blocks take the amax of their real elements."""
    if w.dim() < 2:
        raise ValueError(f"w: must be [..., N, K], got {tuple(w.shape)}")
    *lead, n, k = w.shape
    wf = w.float()
    pn, pk = _ceil(n, block) * block, _ceil(k, block) * block
    wp = torch.nn.functional.pad(wf, (0, pk - k, 0, pn - n))
    blocks = wp.reshape(*lead, pn // block, block, pk // block, block)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=DG_SCALE_FLOOR)
    scale = amax / torch.full((), E4M3_MAX, dtype=torch.float32, device=w.device)
    full = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
    return _e4m3(wf / full), scale.contiguous()


def check_fp8_block_weights(w8: torch.Tensor, scale: torch.Tensor, block: int = DG_BLOCK) -> None:
    """The checkpoint layout DeepGEMM's SM90 grouped GEMMs take: e4m3 [G, N, K] contiguous and float32
    [G, ceil(N/128), ceil(K/128)] contiguous. Raises ValueError naming the mismatch."""
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 3 or not w8.is_contiguous():
        raise ValueError(f"w8: must be contiguous float8_e4m3fn [G, N, K], got {w8.dtype} {tuple(w8.shape)}")
    g, n, k = w8.shape
    want = (g, _ceil(n, block), _ceil(k, block))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or not scale.is_contiguous():
        raise ValueError(f"scale: must be contiguous float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    if k % block:
        raise ValueError(f"w8: K={k} must be a multiple of {block} for DeepGEMM's FP8 kernels")


def dequantize_fp8_blocks(w8: torch.Tensor, scale: torch.Tensor, block: int = DG_BLOCK) -> torch.Tensor:
    """float32 [..., N, K]: e4m3 x its block's scale (the checkpoint's dequantisation)."""
    n, k = w8.shape[-2:]
    full = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
    return w8.float() * full


def quantize_fp8_tokens(x: torch.Tensor, group: int = DG_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 [M, ceil(K/128)]): one scale per token per 128 values,
    max(amax, 1e-4) / 448 (DeepGEMM's ``per_token_cast_to_fp8`` rule on SM90, divided once, RNE)."""
    if x.dim() != 2:
        raise ValueError(f"x: must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    pk = _ceil(k, group) * group
    xf = torch.nn.functional.pad(x.float(), (0, pk - k)).view(m, pk // group, group)
    sf = xf.abs().amax(dim=-1).clamp(min=DG_SCALE_FLOOR) / torch.full(
        (), E4M3_MAX, dtype=torch.float32, device=x.device
    )
    q = _e4m3(xf / sf.unsqueeze(-1)).view(m, pk)[:, :k].contiguous()
    return q, sf.contiguous()


def dequantize_fp8_tokens(x8: torch.Tensor, sf: torch.Tensor, group: int = DG_BLOCK) -> torch.Tensor:
    k = x8.shape[-1]
    return x8.float() * sf.repeat_interleave(group, -1)[..., :k]


@attrs.frozen
class GroupedRows:
    """Rows sorted by expert (our ``moe_grouped_gemm`` contract: expert e owns rows offs[e-1]..offs[e]) placed
    into one of DeepGEMM's layouts. ``x``: the placed rows (zeros elsewhere); ``groups``: the contiguous
    layout's ``m_indices`` [M] or the masked layout's ``masked_m`` [E]; ``rows`` int64 [R]: where input row
    r went (a row index of ``x.view(-1, K)``), -1 for rows past ``offs[-1]`` (their output is zero)."""

    x: torch.Tensor
    groups: torch.Tensor
    rows: torch.Tensor


def _expert_of_rows(offs: torch.Tensor, r: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    _check_int_tensor("offs", offs, 1)
    if offs.numel() == 0:
        raise ValueError("offs: needs at least one expert")
    ends = offs.to(device, torch.int64)
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    counts = (ends - starts).clamp(min=0)
    rows = torch.arange(r, device=device)
    expert = torch.searchsorted(ends, rows, right=True)  # rows past the last end get E (none)
    valid = expert < ends.numel()
    e = expert.clamp(max=ends.numel() - 1)
    return starts, counts, rows, e, valid


def contiguous_layout(
    x: torch.Tensor, offs: torch.Tensor, align: int = DG_M_ALIGN, static: bool = True
) -> GroupedRows:
    """Expert-sorted rows -> DeepGEMM's contiguous layout: expert e's rows start at a multiple of ``align``;
    ``groups`` = m_indices int32 (the expert of every row, -1 on padding rows).

    ``static`` (default): M = the bound R + min(E, R) (align - 1) rounded up to ``align`` (at most
    min(E, R) experts have rows, each padded by less than ``align``), computed without reading ``offs`` on
    the host (CUDA-graph safe; the trailing -1 blocks are skipped by the kernel). Otherwise M is the exact
    sum of the aligned segments (one host sync): prefer it when R is far below E x align (the bound pads
    a decode batch of R rows over many experts to ~R x align rows). Empty experts take no rows."""
    if x.dim() != 2:
        raise ValueError(f"x: must be [rows, K], got {tuple(x.shape)}")
    if align < 1:
        raise ValueError(f"align={align}: must be >= 1")
    r, k = x.shape
    starts, counts, rows, e, valid = _expert_of_rows(offs, r, x.device)
    padded = _ceil_t(counts, align) * align
    pstarts = torch.cumsum(padded, 0) - padded
    n_e = offs.numel()
    m = _ceil(r + min(n_e, r) * (align - 1), align) * align if static else int(padded.sum())
    pos = torch.where(valid, pstarts[e] + rows - starts[e], m)  # invalid rows go to a dummy row m
    xp = x.new_zeros(m + 1, k)
    xp[pos] = x
    mi = torch.full((m + 1,), -1, dtype=torch.int32, device=x.device)
    mi[pos] = torch.where(valid, e, -1).to(torch.int32)
    return GroupedRows(xp[:m], mi[:m], torch.where(valid, pos, -1))


def masked_layout(
    x: torch.Tensor, offs: torch.Tensor, max_m: int | None = None, check: bool | None = None
) -> GroupedRows:
    """Expert-sorted rows -> DeepGEMM's masked layout: x [E, max_m, K] (expert e's rows first, zeros after),
    ``groups`` = masked_m int32 [E] (rows of each expert). ``max_m`` defaults to R rounded up to 128 (a
    whole number of DeepGEMM's M blocks, as its own tests use), which no expert can exceed; a smaller one is checked on the host (``check``, default: when max_m < R) and an
    expert over it raises ValueError rather than losing rows. The layout holds E x max_m rows: for many
    experts pass the dispatch's bound on rows per expert (DeepEP's), as DeepGEMM's users do."""
    if x.dim() != 2:
        raise ValueError(f"x: must be [rows, K], got {tuple(x.shape)}")
    r, k = x.shape
    if max_m is None:
        max_m = max(_ceil(r, DG_M_ALIGN) * DG_M_ALIGN, DG_M_ALIGN)
    if max_m < 1:
        raise ValueError(f"max_m={max_m}: must be >= 1")
    starts, counts, rows, e, valid = _expert_of_rows(offs, r, x.device)
    n_e = offs.numel()
    if check if check is not None else max_m < r:
        worst = int(counts.max())
        if worst > max_m:
            raise ValueError(f"max_m={max_m}: an expert has {worst} rows; raise max_m to at least {worst}")
    local = rows - starts[e]
    valid = valid & (local < max_m)
    pos = torch.where(valid, e * max_m + local, n_e * max_m)
    xm = x.new_zeros(n_e * max_m + 1, k)
    xm[pos] = x
    masked = counts.clamp(max=max_m).to(torch.int32)
    return GroupedRows(xm[:-1].view(n_e, max_m, k), masked, torch.where(valid, pos, -1))


def _ceil_t(t: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(t + (b - 1), b, rounding_mode="floor")


def gather_rows(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The placed output ([M, N] or [E, max_m, N]) back in input row order [R, N]; zeros where rows == -1."""
    flat = out.reshape(-1, out.shape[-1])
    got = flat[rows.clamp(min=0)]
    return torch.where((rows >= 0)[:, None], got, torch.zeros((), dtype=got.dtype, device=got.device))


# --- DeepGEMM: the indexer's logits -------------------------------------------------------------------


def _pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= y (y > 0, float32), exactly (from the exponent, not a rounded log2)."""
    mant, exp = torch.frexp(y)
    e = torch.where(mant == 0.5, exp - 1, exp).clamp(-126, 127)
    return torch.ldexp(torch.ones_like(y), e)


def fold_q_scales(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [T, H, D] and head weights [T, H] -> (e4m3 q [T, H, D], float32 weights [T, H]).

    DeepGEMM's q has no scales: each (t, h) row is scaled by a power of two s = 2^ceil(log2(amax / 448))
    and s is folded into the head's weight (relu(s y) = s relu(y) for s > 0, and multiplying by a power of
    two is exact), so the logits are those of the e4m3-rounded q with the original weights."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(
            f"q [T, H, D] and weights [T, H] expected, got {tuple(q.shape)}, {tuple(weights.shape)}"
        )
    qf = q.float()
    amax = qf.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    s = _pow2_ceil(amax / torch.full((), E4M3_MAX, dtype=torch.float32, device=q.device))
    return _e4m3(qf / s.unsqueeze(-1)).contiguous(), (weights.float() * s).contiguous()


def fp8_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [..., D] (float / bf16) -> (e4m3 [..., D], float32 [...]): one power-of-two scale per key
    (2^ceil(log2(amax / 448))), the layout of ``fp8_mqa_logits``' kv pair."""
    kf = keys.float()
    amax = kf.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    s = _pow2_ceil(amax / torch.full((), E4M3_MAX, dtype=torch.float32, device=keys.device))
    return _e4m3(kf / s.unsqueeze(-1)).contiguous(), s.contiguous()


def mxfp4_keys_to_fp8(key_bytes: torch.Tensor, dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Our MXFP4 index keys (uint8 [..., dim/2 + dim/32]: e2m1 pairs, one ue8m0 scale per 32) -> DeepGEMM's
    (e4m3 [..., dim], float32 scale [...]), one power-of-two scale per key.

    Exact whenever a key's group exponents lie within 14 of its largest (an e2m1 value c 2^e with c in
    {0.5 .. 6} is an e4m3 value times 2^(emax - 6) down to 2^-9, e4m3's smallest subnormal); smaller
    groups are rounded to e4m3 (round to nearest even). All-zero keys get scale 1 and zero values."""
    fmt = MXFP4Format(dim=dim)
    vals = fmt.dequantize(key_bytes).to(torch.float64)  # exact: e2m1 x 2^e in float32 range
    amax = vals.abs().amax(dim=-1)
    # 2^(e_max - 6) keeps the largest |c| = 6 at 6 x 2^6 = 384 <= 448; zero keys take scale 1
    e_top = torch.frexp(amax)[1] - 1  # floor(log2 amax) for amax > 0
    e = torch.where(amax > 0, e_top - 6, torch.zeros_like(e_top)).clamp(-126, 127)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = _e4m3((vals / scale.unsqueeze(-1)).float())
    return q.contiguous(), scale.float().contiguous()


def deep_gemm_paged_cache(k8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 [blocks, 64, D], float32 [blocks, 64]) -> ``fp8_paged_mqa_logits``' kv_cache, uint8
    [blocks, 64, 1, D + 4]: each block's 64 x D value bytes, then its 64 float32 scales."""
    if k8.dim() != 3 or scale.shape != k8.shape[:2]:
        raise ValueError(
            f"k8 [blocks, page, D] and scale [blocks, page] expected, got {tuple(k8.shape)}, {tuple(scale.shape)}"
        )
    nb, page, d = k8.shape
    out = torch.empty(nb, page * (d + 4), dtype=torch.uint8, device=k8.device)
    out[:, : page * d] = k8.contiguous().view(torch.uint8).view(nb, page * d)
    out[:, page * d :] = scale.float().contiguous().view(torch.uint8).view(nb, page * 4)
    return out.view(nb, page, 1, d + 4)


def split_deep_gemm_paged_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`deep_gemm_paged_cache`: (float32 values [blocks, page, D], float32 scales)."""
    nb, page, _, dp = cache.shape
    d = dp - 4
    flat = cache.reshape(nb, page * dp)
    vals = flat[:, : page * d].contiguous().view(torch.float8_e4m3fn).float().view(nb, page, d)
    scale = flat[:, page * d :].contiguous().view(torch.float32).view(nb, page)
    return vals, scale


def mxfp4_pool_to_deep_gemm(
    pool: torch.Tensor, block_table: torch.Tensor, page_size: int, dim: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our paged MXFP4 index-key pool (uint8 [pages * page, 68] or [pages, page, 68]) and its block table
    [B, W] -> DeepGEMM's (kv_cache [pages * page / 64, 64, 1, dim + 4], block_table int32 [B, W * page / 64]).

    DeepGEMM's SM90 kernel reads 64-token blocks: a page of ``page_size`` (a multiple of 64) becomes
    page / 64 consecutive blocks, so the new table is arithmetic on the old (no gather); negative table
    entries stay negative. Values are converted by :func:`mxfp4_keys_to_fp8` (exact, see there)."""
    if page_size % DG_PAGED_BLOCK:
        raise ValueError(
            f"page_size={page_size}: DeepGEMM's paged indexer needs pages of a multiple of {DG_PAGED_BLOCK} tokens"
        )
    _check_int_tensor("block_table", block_table, 2)
    nbytes = dim // 2 + dim // 32
    flat = pool.reshape(-1, nbytes)
    if flat.shape[0] % page_size:
        raise ValueError(f"pool: {flat.shape[0]} slots is not a whole number of pages of {page_size}")
    k8, scale = mxfp4_keys_to_fp8(flat, dim)
    nb = flat.shape[0] // DG_PAGED_BLOCK
    cache = deep_gemm_paged_cache(k8.view(nb, DG_PAGED_BLOCK, dim), scale.view(nb, DG_PAGED_BLOCK))
    split = page_size // DG_PAGED_BLOCK
    bt = block_table.to(torch.int64)
    sub = torch.arange(split, device=bt.device)
    table = torch.where(bt[..., None] >= 0, bt[..., None] * split + sub, -1).flatten(1)
    return cache, table.to(torch.int32)


def context_lens_2d(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per-sequence key counts [B] (the last of its next_n query tokens included) -> DeepGEMM's 2-D
    ``context_lens`` [B, next_n]: token j sees ``context_len - next_n + 1 + j`` keys (causal), at least 0."""
    _check_int_tensor("context_lens", context_lens, 1)
    j = torch.arange(next_n, device=context_lens.device)
    return (context_lens.to(torch.int64)[:, None] - next_n + 1 + j).clamp(min=0).to(torch.int32).contiguous()


# --- DeepSelect ---------------------------------------------------------------------------------------


def aligned_rows(x: torch.Tensor, align_bytes: int) -> torch.Tensor:
    """``x`` [b, n] itself when its row stride is a multiple of ``align_bytes`` and rows are contiguous,
    else a copy into a buffer whose rows are padded to it (a view of the first n columns)."""
    if x.dim() != 2:
        raise ValueError(f"x: must be [rows, n], got {tuple(x.shape)}")
    item = x.element_size()
    if x.stride(1) == 1 and (x.stride(0) * item) % align_bytes == 0:
        return x
    per = max(align_bytes // item, 1)
    buf = x.new_empty(x.shape[0], _ceil(x.shape[1], per) * per)
    buf[:, : x.shape[1]] = x
    return buf[:, : x.shape[1]]


def topk_to_indices(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """DeepSelect's unsorted (values, indices) -> our ``indexer_topk`` indices int32 [b, k]: -1 for entries
    whose value is not finite (masked keys, ``-inf``) or whose index is outside [0, n) (its out-of-range
    fill), the valid ones first (a stable partition; their order is DeepSelect's)."""
    idx = indices.to(torch.int64)
    valid = torch.isfinite(values.float()) & (idx >= 0) & (idx < n)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    idx = torch.gather(torch.where(valid, idx, -1), 1, order)
    return idx.to(torch.int32)
