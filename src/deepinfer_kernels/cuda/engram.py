"""TileLang ``engram_hash`` and ``engram_gather``; tile_kernels' ``engram_hash`` is used when importable.

``engram_hash``: one thread per (layer, token). The running XOR of ``id_k * m_k`` is formed in unsigned
64-bit arithmetic (the same bits as the reference's wrapping int64, without signed-overflow UB), then
read as signed and reduced with a floor modulo (``torch.remainder``: never negative) per prime table.
tile_kernels.engram_hash takes the same tensors (int32 ids / sizes / offsets, int64 multipliers) and is
preferred when importable: it is DeepSeek's own kernel; tests check both against the reference.

``engram_gather``: one CTA per ``_ROWS`` looked-up rows, each thread copies / dequantises a contiguous
chunk of a row (bf16 / fp32 tables, or fp8 e4m3 with one ue8m0 scale per block). Pure data movement.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import importlib.util

import torch

from deepinfer_kernels.cuda import _codecs as C
from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.ops import engram as ref
from deepinfer_kernels.registry import register

_THREADS = 128
_HAVE_TILE_KERNELS = importlib.util.find_spec("tile_kernels") is not None


def _build_hash(n: int, heads: int, layers: int):
    t_dyn = T.dynamic("t")
    cols = (n - 1) * heads

    @T.prim_func
    def ngram_hash(
        ids: T.Tensor((t_dyn, n), "int64"),
        mult: T.Tensor((layers, n), "int64"),
        sizes: T.Tensor((layers, n - 1, heads), "int64"),
        offsets: T.Tensor((layers, cols), "int64"),
        out: T.Tensor((layers, t_dyn, cols), "int32"),
    ):
        with T.Kernel(T.ceildiv(t_dyn, _THREADS), layers, threads=_THREADS) as (bx, layer):
            tx = T.get_thread_binding(0)
            h = T.alloc_var("uint64")
            hs = T.alloc_var("int64")
            r = T.alloc_var("int64")
            t = bx * _THREADS + tx
            if t < t_dyn:
                h = T.reinterpret(ids[t, 0], "uint64") * T.reinterpret(mult[layer, 0], "uint64")
                for k in T.unroll(1, n):
                    h = h ^ (T.reinterpret(ids[t, k], "uint64") * T.reinterpret(mult[layer, k], "uint64"))
                    hs = T.reinterpret(h, "int64")
                    for j in T.unroll(heads):
                        r = hs % sizes[layer, k - 1, j]
                        if r < 0:
                            r = r + sizes[layer, k - 1, j]
                        out[layer, t, (k - 1) * heads + j] = T.Cast(
                            "int32", r + offsets[layer, (k - 1) * heads + j]
                        )

    return ngram_hash


@register("engram_hash", "cuda")
def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    check: bool = True,
) -> torch.Tensor:
    """Same contract as the reference (int32 [L, T, (N-1)*H], ``check`` included); tile_kernels when
    importable, else TileLang."""
    if not HAVE_TILELANG or ngram_token_ids.device.type != "cuda":
        return ref.engram_hash(ngram_token_ids, multipliers, vocab_sizes, offsets, check=check)
    if _HAVE_TILE_KERNELS and ngram_token_ids.shape[0] > 0:
        return engram_hash_tile_kernels(ngram_token_ids, multipliers, vocab_sizes, offsets, check=check)
    return engram_hash_tilelang(ngram_token_ids, multipliers, vocab_sizes, offsets, check=check)


def _validate(
    ids: torch.Tensor, mult: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, check: bool = True
) -> tuple[int, int, int, int]:
    # The reference's checks on shapes and dtypes; its table-size check (a read back) only with ``check``.
    ref._check_int("ngram_token_ids", ids, 2)
    ref._check_int("multipliers", mult, 2)
    ref._check_int("vocab_sizes", sizes, 3)
    ref._check_int("offsets", offsets, 2)
    t, n = ids.shape
    layers, heads = sizes.shape[0], sizes.shape[2]
    if n < 2 or tuple(mult.shape) != (layers, n) or tuple(sizes.shape) != (layers, n - 1, heads):
        raise ValueError(
            f"engram_hash: inconsistent shapes ids {tuple(ids.shape)}, multipliers {tuple(mult.shape)}, vocab_sizes {tuple(sizes.shape)}"
        )
    if tuple(offsets.shape) != (layers, (n - 1) * heads):
        raise ValueError(
            f"offsets: shape {tuple(offsets.shape)}, expected [L={layers}, (N-1)*H={(n - 1) * heads}]"
        )
    if check and sizes.numel() and int(sizes.min()) <= 0:
        raise ValueError("vocab_sizes: table sizes must be positive")
    return t, n, layers, heads


def engram_hash_tilelang(
    ids: torch.Tensor, mult: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """The TileLang hash kernel (always; used when tile_kernels is absent, and tested on its own)."""
    t, n, layers, heads = _validate(ids, mult, sizes, offsets, check)
    dev = ids.device
    out = torch.empty(layers, t, (n - 1) * heads, dtype=torch.int32, device=dev)
    if t == 0 or layers == 0 or heads == 0:
        return out
    kern = compile_kernel(("engram_hash", n, heads, layers), lambda: _build_hash(n, heads, layers))
    kern(
        ids.to(torch.int64).contiguous(),
        mult.to(dev, torch.int64).contiguous(),
        sizes.to(dev, torch.int64).contiguous(),
        offsets.to(dev, torch.int64).contiguous(),
        out,
    )
    return out


def engram_hash_tile_kernels(
    ids: torch.Tensor, mult: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """Adapter to ``tile_kernels.engram_hash`` (int32 ids / sizes / offsets, int64 multipliers, same layout)."""
    _validate(ids, mult, sizes, offsets, check)
    from tile_kernels.engram.engram_hash_kernel import engram_hash as tk_hash

    dev = ids.device
    return tk_hash(
        ids.to(torch.int32).contiguous(),
        mult.to(dev, torch.int64).contiguous(),
        sizes.to(dev, torch.int32).contiguous(),
        offsets.to(dev, torch.int32).contiguous(),
    )


_ROWS = 16  # rows per CTA: 16 x 256 bf16 = 8 KB in flight per CTA (4 rows reached 49% of copy)


def _build_gather(dim: int, table_dtype: str, out_dtype: str, blocks: int):
    r_dyn = T.dynamic("r")
    n_dyn = T.dynamic("n")
    fp8 = blocks > 0
    per = dim // blocks if fp8 else 1
    sc_shape = (r_dyn, max(blocks, 1))

    @T.prim_func
    def gather(
        table: T.Tensor((r_dyn, dim), table_dtype),
        scales: T.Tensor(sc_shape, "uint8"),
        ids: T.Tensor((n_dyn,), "int64"),
        out: T.Tensor((n_dyn, dim), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n_dyn, _ROWS), threads=_THREADS) as bx:
            for i, j in T.Parallel(_ROWS, dim):
                n = bx * _ROWS + i
                if n < n_dyn:
                    row = ids[n]
                    if fp8:
                        v = T.Cast("float32", table[row, j]) * C.ue8m0_scale_f32(
                            T.Cast("int32", scales[row, j // per])
                        )
                        out[n, j] = T.Cast(out_dtype, v)
                    else:
                        out[n, j] = T.Cast(out_dtype, table[row, j])

    return gather


_VPT = 8  # "vec" variant: 8 elements a thread (16 bytes of bf16 out), 256 threads, one chunk per thread


def _build_gather_vec(dim: int, table_dtype: str, out_dtype: str, blocks: int):
    """One thread per 8-element chunk of a looked-up row: a warp moves 256 contiguous elements with 16-byte
    (bf16) vector loads and stores, whatever the row count; the index is read once per chunk."""
    r_dyn = T.dynamic("r")
    n_dyn = T.dynamic("n")
    fp8 = blocks > 0
    per = dim // blocks if fp8 else 1
    sc_shape = (r_dyn, max(blocks, 1))
    tpr = dim // _VPT
    threads = 256

    @T.prim_func
    def gather(
        table: T.Tensor((r_dyn, dim), table_dtype),
        scales: T.Tensor(sc_shape, "uint8"),
        ids: T.Tensor((n_dyn,), "int64"),
        out: T.Tensor((n_dyn, dim), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n_dyn * tpr, threads), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            buf = T.alloc_local((_VPT,), table_dtype)
            res = T.alloc_local((_VPT,), out_dtype)
            row = T.alloc_var("int64")
            gid = bx * threads + tx
            if gid < n_dyn * tpr:
                n = gid // tpr
                c = gid % tpr
                row = ids[n]
                for j in T.vectorized(_VPT):
                    buf[j] = table[row, c * _VPT + j]
                for j in T.unroll(_VPT):
                    if fp8:
                        sc = C.ue8m0_scale_f32(T.Cast("int32", scales[row, (c * _VPT + j) // per]))
                        res[j] = T.Cast(out_dtype, T.Cast("float32", buf[j]) * sc)
                    else:
                        res[j] = T.Cast(out_dtype, buf[j])
                for j in T.vectorized(_VPT):
                    out[n, c * _VPT + j] = res[j]

    return gather


# "rows" (T.Parallel over 16 rows a CTA; verified on the H200, 47 % of copy end to end) or "vec" (above;
# not yet run on a GPU). Tests compare both with the reference; benchmarks/kernels.py times both.
GATHER_VARIANTS = ("rows", "vec")
GATHER_VARIANT = "rows"


def gather_rows(
    table: torch.Tensor,
    scales: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    blocks: int,
    variant: str | None = None,
) -> None:
    """Launch a gather kernel (no checks): ``out[i] = dequant(table[ids[i]])``; ids int64 [N], out [N, dim]."""
    v = GATHER_VARIANT if variant is None else variant
    if v not in GATHER_VARIANTS:
        raise ValueError(f"variant: must be one of {GATHER_VARIANTS}, got {v!r}")
    dim = table.shape[1]
    if ids.numel() == 0 or dim == 0:
        return
    if v == "vec" and dim % _VPT:
        v = "rows"  # rows that are not whole 8-element chunks
    tname = "float8_e4m3fn" if table.dtype == torch.float8_e4m3fn else torch_dtype_name(table.dtype)
    oname = torch_dtype_name(out.dtype)
    build = _build_gather_vec if v == "vec" else _build_gather
    kern = compile_kernel(
        ("engram_gather", v, dim, tname, oname, blocks), lambda: build(dim, tname, oname, blocks)
    )
    kern(table, scales, ids, out)


@register("engram_gather", "cuda")
def engram_gather(
    table: torch.Tensor,
    row_ids: torch.Tensor,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    check: bool = True,
) -> torch.Tensor:
    """Same contract as the reference ``engram_gather`` (``check`` included); one TileLang gather (+ fp8
    dequantisation) kernel."""
    fp8 = table.dtype == torch.float8_e4m3fn
    if (
        not HAVE_TILELANG
        or table.device.type != "cuda"
        or not (fp8 or table.dtype in (torch.bfloat16, torch.float32, torch.float16))
    ):
        return ref.engram_gather(table, row_ids, scales, out_dtype, check=check)
    if table.dim() != 2:
        raise ValueError(f"table: must be 2-D [rows, dim], got shape {tuple(table.shape)}")
    if row_ids.dtype not in ref._INT_DTYPES:
        raise TypeError(f"row_ids: must be an integer tensor, got {row_ids.dtype}")
    rows, dim = table.shape
    flat = row_ids.reshape(-1).to(table.device, torch.int64)
    if check and flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= rows:
            raise IndexError(
                f"row_ids: id {int(lo) if int(lo) < 0 else int(hi)} is outside [0, num_rows={rows})"
            )
    if fp8:
        if scales is None:
            raise ValueError("scales: required for an fp8 table")
        if scales.dim() != 2 or scales.shape[0] != rows or scales.shape[1] == 0 or dim % scales.shape[1]:
            raise ValueError(f"scales: shape {tuple(scales.shape)}, expected [{rows}, blocks dividing {dim}]")
        blocks, sc = scales.shape[1], scales.to(table.device, torch.uint8).contiguous()
    else:
        if scales is not None:
            raise ValueError(f"scales: only fp8 tables take scales, table is {table.dtype}")
        blocks, sc = 0, torch.empty(rows, 1, dtype=torch.uint8, device=table.device)
        torch_dtype_name(table.dtype)  # raises for unsupported dtypes, naming them
    out = torch.empty(flat.numel(), dim, dtype=out_dtype, device=table.device)
    gather_rows(table.contiguous(), sc, flat.contiguous(), out, blocks)
    return out.reshape(*row_ids.shape, dim)
