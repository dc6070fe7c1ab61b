"""TileLang KV cache ops: quantise + scatter (``kv_store``, ``swa_ring_write``) and gather + dequantise
(``kv_load``, ``swa_ring_read``) in the byte formats of ``deepinfer_core.kv.formats``; the prim_funcs are
in ``kv_kernels``, this module holds the switches, the launchers and the registered ops.

Layouts (``VARIANTS``, defaults per format in ``STORE_VARIANT`` / ``LOAD_VARIANT``): ``group`` gives a
thread whole scale groups (32 values for fp8 / mxfp4, 16 for fp4; ``group2`` / ``group4`` several,
contiguous, which spreads a warp's accesses and measured slower), ``lanes`` gives a thread 8 values of a
group for loads (a warp writes 512 contiguous bytes), ``bf16x2i4`` stores fp4 from bf16 input two values
an instruction with 4 groups a thread taken 32 apart. Values go through 32-bit words of an int32 view of
the pool (rows of 528 / 288 / 68 bytes are 4-byte aligned). Bytes are identical to the reference (tested
bit for bit). Loads go through one "gather slots and dequantise" kernel; block tables and ring positions
become flat slots by a few elementwise torch ops first.

Codecs (``_codecs``): fp8 encodes with the hardware e4m3 conversion (RNE, satfinite) and decodes with it
plus one float32 multiply; e2m1 (fp4, mxfp4) encodes by comparing ``|x|`` with the seven exact
thresholds ``mid * scale`` (no division; same codes, see ``_codecs.e2m1_thresholds``) and fp4 decodes
through float16 bits. Each has an integer-exact or float64 fallback kept as a switch for the tests.
Measurements: docs/performance.md ("CUDA kernels on the H200, third round").
"""

import torch

from deepinfer_core.kv.formats import nan_check
from deepinfer_kernels.cuda._tl import HAVE_TILELANG, compile_kernel, torch_dtype_name
from deepinfer_kernels.cuda.kv_kernels import (
    _LAYOUT,
    _build_gather,
    _build_gather_lanes,
    _build_store,
    _build_store_fp4_bf16x2_interleaved,
    _sizes,
)
from deepinfer_kernels.ops import kv_store as ref
from deepinfer_kernels.registry import register


def _fmt_name(fmt: object) -> str | None:
    name = fmt if isinstance(fmt, str) else getattr(fmt, "name", None)
    return name if name in _LAYOUT else None


def _usable(fmt: object, dim: int, *tensors: torch.Tensor) -> str | None:
    """The kernel format name when the TileLang path applies, else None (reference fallback).

    The kernels move 32-bit words, so a row must be a whole number of words: fp8 at dim 64 (66 B, the
    tiny test model's ring) takes the reference, as do dims the format itself rejects.
    """
    name = _fmt_name(fmt)
    if not HAVE_TILELANG or name is None or any(t.device.type != "cuda" for t in tensors):
        return None
    group = _LAYOUT[name][0]
    if dim <= 0 or dim % group or _sizes(name, dim)[3] % 4:
        return None
    return name


# fp8 codes by the hardware conversion (cvt.rn.satfinite) instead of integer arithmetic: byte-identical
# to torch on the H200 (tested, both paths) and 1.5x faster there (51 vs 75 us for 65,536 tokens).
HW_FP8 = True

# e2m1 (fp4 / mxfp4) encoded by the seven exact thresholds and fp4 decoded through float16 bits, instead
# of a float32 division (fp4) / float64 multiply (mxfp4) per value and the select chain of ``e2m1_value``.
# Same bytes and values by construction (``_codecs.e2m1_thresholds``); the GPU tests run both paths.
FAST_E2M1 = True

# Kernel layouts, name -> (layout, scale groups a thread): "group*" (any format; fewer groups when a row has
# fewer), "lanes" (loads of fp8 / fp4 with the default codecs: 8 values a thread), "bf16x2i4" (fp4 stores
# of bf16 input: two values an instruction). A layout that does not apply to a call takes "group" with
# the same groups a thread. Every variant is tested byte for byte against the reference and timed side
# by side in benchmarks/kernels.py; the defaults are what the H200 measured fastest.
_LAYOUTS = {
    "group": ("group", 1),
    "group2": ("group", 2),
    "group4": ("group", 4),
    "lanes": ("lanes", 1),
    "bf16x2i4": ("bf16x2i", 4),
}
VARIANTS = tuple(_LAYOUTS)
# Defaults per format (a plain name applies to every format): the fastest on the H200, 2026-11-30.
STORE_VARIANT: str | dict[str, str] = {"fp8": "group", "fp4": "bf16x2i4", "mxfp4": "group"}
LOAD_VARIANT: str | dict[str, str] = {"fp8": "lanes", "fp4": "group", "mxfp4": "group"}


def _variant(v: str | None, default: str | dict[str, str], name: str) -> tuple[str, int]:
    """(layout, groups a thread) of variant ``v`` (None: the module default for format ``name``)."""
    if v is None:
        v = default if isinstance(default, str) else default.get(name, "group")
    if v not in _LAYOUTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {v!r}")
    return _LAYOUTS[v]


def store_slots(
    pool: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    name: str,
    hw_fp8: bool | None = None,
    variant: str | None = None,
    fast_e2m1: bool | None = None,
) -> None:
    """Launch the store kernel (no checks): x [T, dim] -> pool rows ``slots`` (int64, < 0 skipped).

    ``hw_fp8``: hardware e4m3 conversion for fp8 codes and the fp4 scale byte; the other switches are
    the module flags above (None: the flag)."""
    layout, gpt = _variant(variant, STORE_VARIANT, name)
    if x.shape[0] == 0:
        return
    dim = x.shape[1]
    dt = torch_dtype_name(x.dtype)
    hw = (HW_FP8 if hw_fp8 is None else hw_fp8) and name in ("fp8", "fp4")
    fast = (FAST_E2M1 if fast_e2m1 is None else fast_e2m1) and name != "fp8"
    if layout == "bf16x2i" and name == "fp4" and dt == "bfloat16" and hw and fast:
        kern = compile_kernel(
            ("kv_store_bf16x2i", gpt, dim), lambda: _build_store_fp4_bf16x2_interleaved(dim, gpt)
        )
        kern(pool, pool.view(torch.int32), x.contiguous().view(torch.int32), slots.contiguous())
        return
    kern = compile_kernel(
        ("kv_store", gpt, name, dim, dt, hw, fast), lambda: _build_store(name, dim, dt, hw, gpt, fast)
    )
    kern(pool, pool.view(torch.int32), x.contiguous(), slots.contiguous())


# fp8 loads decoded by the hardware e4m3 conversion and one float32 multiply instead of the float64 path
# (1.27x faster on the H200: 62.6 vs 79.8 us for 64 x 1,024 tokens). Scale codes >= 247, where the float32
# product would overflow while the reference saturates, take the float64 path (the ``code < 247`` branch in
# ``_build_gather``). Default since the H200 run of 2026-11-30, where every e4m3 byte under every scale
# code matched the reference bit for bit (test_fp8_decoders_every_byte_every_scale, all variants).
HW_FP8_DECODE = True


def gather_slots(
    pool: torch.Tensor,
    slots: torch.Tensor,
    name: str,
    dim: int,
    out_dtype: torch.dtype,
    hw: bool | None = None,
    variant: str | None = None,
    fast_e2m1: bool | None = None,
    into: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Launch the gather kernel: rows ``slots`` (int64 [N], < 0 gives zeros) dequantised to [N, dim]; with
    ``into = (out, k, col)`` (``out`` contiguous [rows, total, dim], N = rows * k) slot i of row r lands in
    ``out[r, col + i]`` instead, and ``out`` is returned (two gathers filling one key buffer)."""
    layout, gpt = _variant(variant, LOAD_VARIANT, name)
    place = None
    if into is None:
        out = torch.empty(slots.shape[0], dim, dtype=out_dtype, device=pool.device)
    else:
        full, k, col = into
        place = (k, full.shape[1], col)
        out = full.view(-1, dim)
    if slots.shape[0] == 0:
        return out if into is None else into[0]
    dt = torch_dtype_name(out_dtype)
    hw = (HW_FP8_DECODE if hw is None else hw) and name == "fp8"
    fast = (FAST_E2M1 if fast_e2m1 is None else fast_e2m1) and name == "fp4"
    if layout == "lanes" and ((name == "fp8" and hw) or (name == "fp4" and fast)):
        kern = compile_kernel(
            ("kv_gather_lanes", name, dim, dt, place), lambda: _build_gather_lanes(name, dim, dt, place=place)
        )
    else:
        kern = compile_kernel(
            ("kv_gather", gpt, name, dim, dt, hw, fast, place),
            lambda: _build_gather(name, dim, dt, hw, gpt, fast, place),
        )
    kern(pool, pool.view(torch.int32), slots.contiguous(), out)
    return out if into is None else into[0]


@register("kv_store", "cuda")
def kv_store(
    pool: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, fmt: str = "fp8", check: bool = True
) -> torch.Tensor:
    """Same contract and bytes as the reference ``kv_store``; fp8 / fp4 / mxfp4 run the TileLang kernel.

    ``check=False`` skips the two device-synchronising value checks (slot range, NaN in ``x``): for the
    engine's hot path, whose slot mappings come from its own block tables. Shapes are always checked.
    """
    if x.dim() != 2:
        raise ValueError(f"x: must be [tokens, dim], got shape {tuple(x.shape)}")
    name = _usable(fmt, x.shape[1], pool, x)
    if name is None:
        if not check and pool.device.type == "cuda":
            return _store_static(pool, x, slot_mapping, fmt)
        return ref.kv_store(pool, x, slot_mapping, fmt)
    f = ref.resolve_format(fmt, x.shape[1])
    flat = ref.flat_pool(pool, f.bytes_per_token)
    if check:
        slots = ref.check_slots("slot_mapping", slot_mapping, x.shape[0], flat.shape[0]).to(pool.device)
        if x.shape[0] and bool(torch.isnan(x).any()):
            raise ValueError(f"{f.name}.quantize: x contains NaN (cannot be saturated)")
    else:
        if slot_mapping.shape != (x.shape[0],):
            raise ValueError(
                f"slot_mapping: must have shape ({x.shape[0]},), got {tuple(slot_mapping.shape)}"
            )
        slots = slot_mapping.to(pool.device, torch.int64)
    store_slots(flat, x, slots, name)
    return pool


def _store_static(
    pool: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, fmt: object
) -> torch.Tensor:
    """The reference store's bytes with fixed shapes and no host synchronisation (for formats / dims the
    kernels do not take, e.g. the tiny model's 66-byte fp8 rows, inside a CUDA graph): a skipped row (slot
    < 0) repeats the first kept row's write (same slot, same bytes: no race); with none kept, slot 0
    gets its own bytes back."""
    if slot_mapping.shape != (x.shape[0],):
        raise ValueError(f"slot_mapping: must have shape ({x.shape[0]},), got {tuple(slot_mapping.shape)}")
    f = ref.resolve_format(fmt, x.shape[1])  # type: ignore[arg-type]
    flat = ref.flat_pool(pool, f.bytes_per_token)
    if x.shape[0] == 0:
        return pool
    slots = slot_mapping.to(pool.device, torch.int64)
    keep = slots >= 0
    first = torch.argmax(keep.to(torch.int8))
    src = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), first)
    tgt = slots[src].clamp(min=0)
    with nan_check(False):  # the check would synchronise (and fail a graph capture)
        val = f.quantize(x).to(pool.device)[src]
    flat[tgt] = torch.where(keep.any(), val, flat[tgt])
    return pool


@register("kv_load", "cuda")
def kv_load(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """Same contract as the reference ``kv_load``; the gather and dequantisation are one TileLang kernel.

    ``check=False`` skips the device-synchronising range checks of ``block_table`` and ``seq_lens``."""
    name = _usable(fmt, dim, pool)
    if name is None or pool.dim() != 3:
        return ref.kv_load(pool, block_table, seq_lens, fmt, dim, out_dtype)
    f = ref.resolve_format(fmt, dim)
    num_blocks, bs, _ = pool.shape
    flat = ref.flat_pool(pool, f.bytes_per_token)
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table: must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    b, m = block_table.shape
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens: must have shape ({b},), got {tuple(seq_lens.shape)}")
    if check and b and m:
        lo, hi = torch.aminmax(block_table)
        if int(lo) < 0 or int(hi) >= num_blocks:
            raise IndexError(f"block_table: block ids must be in [0, {num_blocks})")
    if check and b:
        lo, hi = torch.aminmax(seq_lens)
        if int(lo) < 0 or int(hi) > m * bs:
            raise ValueError(f"seq_lens: must be in [0, max_blocks * block_size = {m * bs}]")
    t = torch.arange(m * bs, device=pool.device)
    slots = block_table.to(pool.device, torch.int64)[:, t // bs] * bs + t % bs
    slots = torch.where(t[None, :] < seq_lens.to(pool.device)[:, None], slots, -1)
    return gather_slots(flat, slots.reshape(-1), name, dim, out_dtype).view(b, m * bs, dim)


@register("swa_ring_write", "cuda")
def swa_ring_write(
    ring: torch.Tensor,
    x: torch.Tensor,
    states: torch.Tensor,
    positions: torch.Tensor,
    fmt: str = "fp8",
    check: bool = True,
) -> torch.Tensor:
    """Same contract as the reference: the ring slots feed the ``kv_store`` kernel."""
    return kv_store(ring, x, ref.last_writer_only(ref.ring_slots(ring, states, positions)), fmt, check)


@register("swa_ring_read", "cuda")
def swa_ring_read(
    ring: torch.Tensor,
    states: torch.Tensor,
    lengths: torch.Tensor,
    window: int = 128,
    fmt: str = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """Same contract as the reference ``swa_ring_read``; one TileLang gather + dequantise."""
    name = _usable(fmt, dim, ring)
    if name is None:
        return ref.swa_ring_read(ring, states, lengths, window, fmt, dim, out_dtype)
    f = ref.resolve_format(fmt, dim)
    flat = ref.flat_pool(ring, f.bytes_per_token)
    slots, valid = ref.ring_window_slots(ring, states, lengths, window)
    slots = torch.where(valid, slots, -1)
    return gather_slots(flat, slots.reshape(-1), name, dim, out_dtype).view(*slots.shape, dim)


@register("kv_gather", "cuda")
def kv_gather(
    pool: torch.Tensor,
    slots: torch.Tensor,
    fmt: str = "fp8",
    dim: int = 512,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    col: int = 0,
) -> torch.Tensor:
    """Same contract as the reference ``kv_gather`` (``out`` / ``col`` included): one TileLang gather +
    dequantise, no checks (fixed shapes, no host synchronisation: capturable in a CUDA graph)."""
    name = _usable(fmt, dim, pool)
    if (
        name is None
        or out_dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or (
            out is not None
            and not (out.is_contiguous() and out.dtype == out_dtype and out.device == pool.device)
        )
    ):
        return ref.kv_gather(pool, slots, fmt, dim, out_dtype, out, col)
    f = ref.resolve_format(fmt, dim)
    flat = ref.flat_pool(pool, f.bytes_per_token)
    s = slots.reshape(-1).to(pool.device, torch.int64)
    if out is not None:
        ref.check_gather_out(out, slots, dim, col)
        return gather_slots(flat, s, name, dim, out_dtype, into=(out, slots.shape[1], col))
    return gather_slots(flat, s, name, dim, out_dtype).view(*slots.shape, dim)
