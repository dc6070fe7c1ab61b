"""TileLang KV cache kernels: quantise + scatter (``kv_store``, ``swa_ring_write``) and gather + dequantise
(``kv_load``, ``swa_ring_read``) in the byte formats of ``deepinfer_core.kv.formats``.

One thread per scale group (32 values for fp8 / mxfp4, 16 for fp4): it loads its values with 16-byte
loads, takes their absolute max, derives the scale exactly as the torch reference does (integer
arithmetic on the IEEE bits, see ``_codecs``), packs the codes into 32-bit words and writes them with
16-byte stores (through an int32 view of the pool: rows of 528 / 288 / 68 bytes are 4-byte aligned), then
its scale byte. Byte-wide stores were 5% of copy bandwidth on the H200; word stores fix that. The bytes are identical to the reference
(tested bit for bit). Loads go through one generic "gather slots and dequantise" kernel; block tables and
ring positions are turned into flat slots by a few elementwise torch ops first (8 bytes of index per
token against 2 KB of output, so that extra pass costs well under 1% of the traffic).
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda import _codecs as C
from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.cuda.kv_coop import build_gather_coop, build_store_coop
from deepinfer_kernels.ops import kv_store as ref
from deepinfer_kernels.registry import register

_THREADS = 128
# name -> (group, value bytes per group, kind); mxfp4's element max is 6 with a power-of-two scale.
_LAYOUT = {"fp8": (32, 32, "fp8"), "fp4": (16, 8, "fp4"), "mxfp4": (32, 16, "mxfp4")}


def _sizes(fmt: str, dim: int) -> tuple[int, int, int, int]:
    group, vbytes, _ = _LAYOUT[fmt]
    groups = dim // group
    value_bytes = groups * vbytes
    return group, groups, value_bytes, value_bytes + groups


def _pack_nibbles(codes, w):
    acc = codes[8 * w]
    for b in range(1, 8):
        acc = acc | (codes[8 * w + b] << T.uint32(4 * b))
    return acc


def _build_store(fmt: str, dim: int, in_dtype: str, hw_fp8: bool = False):
    group, groups, value_bytes, bpt = _sizes(fmt, dim)
    vb = _LAYOUT[fmt][1]
    vw = vb // 4  # value words (int32) per group
    # 68-byte mxfp4 rows are only 4-byte aligned: vector (16 B) word access only where rows are 16-byte aligned.
    wloop = T.vectorized if bpt % 16 == 0 else T.unroll
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    @T.prim_func
    def store(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),  # the same bytes, for 16-byte value stores
        x: T.Tensor((n, dim), in_dtype),
        slots: T.Tensor((n,), "int64"),
    ):
        with T.Kernel(T.ceildiv(n * groups, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            raw = T.alloc_local((group,), in_dtype)
            vals = T.alloc_local((group,), "float32")
            codes = T.alloc_local((group,), "uint32")
            words = T.alloc_local((vw,), "int32")
            amax = T.alloc_var("float32")
            # Named scalars (not Python expressions) so the codec expressions are built once, not re-inlined.
            e = T.alloc_var("int32")
            inv = T.alloc_var("float64")
            sc = T.alloc_var("float32")
            sb = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            q = T.alloc_var("float32")
            gid = bx * _THREADS + tx
            if gid < n * groups:
                t = gid // groups
                g = gid % groups
                s = slots[t]
                if s >= 0:
                    for j in T.vectorized(group):  # 16-byte loads of the group's inputs
                        raw[j] = x[t, g * group + j]
                    amax = T.float32(0)
                    for j in T.unroll(group):
                        vals[j] = T.Cast("float32", raw[j])
                        amax = T.max(amax, T.abs(vals[j]))
                    if fmt == "fp8":
                        e = C.pow2_exponent_f64(amax, 448.0)
                        inv = C.pow2_f64(-e)
                        for j in T.unroll(group):
                            if hw_fp8:  # the hardware cvt (RNE, satfinite); 2^-e is exact in float32 for e <= 126
                                q = T.min(T.max(vals[j] * T.reinterpret((127 - e) << 23, "float32"), T.float32(-448.0)), T.float32(448.0))
                                codes[j] = T.Cast("uint32", T.reinterpret(T.Cast("float8_e4m3fn", q), "uint8"))
                            else:
                                q = T.min(T.max(T.Cast("float32", T.Cast("float64", vals[j]) * inv), T.float32(-448.0)), T.float32(448.0))
                                codes[j] = T.Cast("uint32", C.e4m3_bits(q))
                        sb = e + 127
                    elif fmt == "mxfp4":
                        e = C.pow2_exponent_f64(amax, 6.0)
                        inv = C.pow2_f64(-e)
                        for j in T.unroll(group):
                            q = T.Cast("float32", T.Cast("float64", vals[j]) * inv)
                            codes[j] = T.Cast("uint32", C.e2m1_code(q))
                        sb = e + 127
                    else:  # fp4: e4m3 scale = amax / 6 rounded up to an e4m3 value
                        sc = T.min(T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0))
                        sb = C.e4m3_bits(sc)
                        sv = C.e4m3_value(sb)
                        if (sv < sc) & (sb < 0x7E):
                            sb = sb + 1
                        sv = C.e4m3_value(sb)
                        for j in T.unroll(group):
                            q = T.ieee_fdiv(vals[j], sv)
                            codes[j] = T.Cast("uint32", C.e2m1_code(q))
                    # Pack little-endian words: 4 bytes (fp8) or 8 nibbles (fp4 / mxfp4) per word.
                    for w in T.unroll(vw):
                        if fmt == "fp8":
                            words[w] = T.reinterpret(
                                codes[4 * w] | (codes[4 * w + 1] << T.uint32(8)) | (codes[4 * w + 2] << T.uint32(16)) | (codes[4 * w + 3] << T.uint32(24)),
                                "int32",
                            )
                        else:
                            words[w] = T.reinterpret(_pack_nibbles(codes, w), "int32")
                    for w in wloop(vw):
                        pool32[s, g * vw + w] = words[w]
                    pool8[s, value_bytes + g] = T.Cast("uint8", sb)

    return store


def _build_gather(fmt: str, dim: int, out_dtype: str, hw: bool = False):
    group, groups, value_bytes, bpt = _sizes(fmt, dim)
    vb = _LAYOUT[fmt][1]
    vw = vb // 4
    wloop = T.vectorized if bpt % 16 == 0 else T.unroll
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")
    fmax = 3.4028234663852886e38

    @T.prim_func
    def gather(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        slots: T.Tensor((n,), "int64"),
        out: T.Tensor((n, dim), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n * groups, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            words = T.alloc_local((vw,), "int32")
            res = T.alloc_local((group,), out_dtype)
            code = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            sc = T.alloc_var("float64")
            gid = bx * _THREADS + tx
            if gid < n * groups:
                t = gid // groups
                g = gid % groups
                s = slots[t]
                if s < 0:
                    for j in T.unroll(group):
                        res[j] = T.Cast(out_dtype, 0)
                else:
                    for w in wloop(vw):
                        words[w] = pool32[s, g * vw + w]
                    code = T.Cast("int32", pool8[s, value_bytes + g])
                    sc = C.pow2_f64(code - 127)
                    # float32 scale 2^(code-127): exact for codes 1..254; code 0 is 2^-127 (a float32 subnormal)
                    sv = T.if_then_else(code == 0, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret(code << 23, "float32"))
                    for j in T.unroll(group):
                        if fmt == "fp8" and hw:
                            # hardware e4m3 decode, one float32 multiply: the exact product rounded once, as
                            # the reference's float64 product rounded to float32; codes >= 247 could overflow
                            # float32 (448 * 2^120 > max) where the reference saturates, so they take float64
                            byte = (words[j // 4] >> (8 * (j % 4))) & 0xFF
                            e4 = T.Cast("float32", T.reinterpret(T.Cast("uint8", byte), "float8_e4m3fn"))
                            v = T.Cast("float64", e4) * sc
                            res[j] = T.Cast(
                                out_dtype,
                                T.if_then_else(code < 247, e4 * sv, T.Cast("float32", T.min(T.max(v, T.float64(-fmax)), T.float64(fmax)))),
                            )
                        elif fmt == "fp8":
                            byte = (words[j // 4] >> (8 * (j % 4))) & 0xFF
                            v = T.Cast("float64", C.e4m3_signed_value(byte)) * sc
                            res[j] = T.Cast(out_dtype, T.Cast("float32", T.min(T.max(v, T.float64(-fmax)), T.float64(fmax))))
                        else:
                            nib = (words[j // 8] >> (4 * (j % 8))) & 0xF
                            if fmt == "fp4":
                                res[j] = T.Cast(out_dtype, C.e2m1_value(nib) * C.e4m3_value(code))
                            else:
                                v = T.Cast("float64", C.e2m1_value(nib)) * sc
                                res[j] = T.Cast(out_dtype, T.Cast("float32", T.min(T.max(v, T.float64(-fmax)), T.float64(fmax))))
                for j in T.vectorized(group):  # 16-byte stores of the group's outputs
                    out[t, g * group + j] = res[j]

    return gather


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

# Kernel layout: "group" (one thread per scale group, verified on the H200) or "coop" / "coop16" (8 / 16
# values a thread, shuffles for the group max, coalesced stores: ``kv_coop``; not yet run on a GPU). Both are tested byte
# for byte against the reference and timed side by side in benchmarks/kernels.py; flip after a GPU run.
VARIANTS = ("group", "coop", "coop16")  # coop16: the coop layout with 16 values a thread
_VPT = {"coop": 8, "coop16": 16}
STORE_VARIANT = "group"
LOAD_VARIANT = "group"


def _variant(v: str | None, default: str) -> str:
    v = default if v is None else v
    if v not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {v!r}")
    return v


def store_slots(
    pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, name: str, hw_fp8: bool | None = None, variant: str | None = None
) -> None:
    """Launch the store kernel (no checks): x [T, dim] -> pool rows ``slots`` (int64, < 0 skipped)."""
    v = _variant(variant, STORE_VARIANT)
    if x.shape[0] == 0:
        return
    dim = x.shape[1]
    dt = torch_dtype_name(x.dtype)
    hw = HW_FP8 if hw_fp8 is None else hw_fp8
    hw = hw and name == "fp8"
    if v == "group":
        kern = compile_kernel(("kv_store", v, name, dim, dt, hw), lambda: _build_store(name, dim, dt, hw))
    else:
        kern = compile_kernel(("kv_store", v, name, dim, dt, hw), lambda: build_store_coop(name, dim, dt, hw, _VPT[v]))
    kern(pool, pool.view(torch.int32), x.contiguous(), slots.contiguous())


# fp8 loads decoded by the hardware e4m3 conversion and one float32 multiply instead of the float64 path
# (1.27x faster on the H200: 62.6 vs 79.8 us for 64 x 1,024 tokens). Scale codes >= 247, where the float32
# product would overflow while the reference saturates, take the float64 path (the ``code < 247`` guard in
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
) -> torch.Tensor:
    """Launch the gather kernel: rows ``slots`` (int64 [N], < 0 gives zeros) dequantised to [N, dim]."""
    v = _variant(variant, LOAD_VARIANT)
    out = torch.empty(slots.shape[0], dim, dtype=out_dtype, device=pool.device)
    if slots.shape[0] == 0:
        return out
    dt = torch_dtype_name(out_dtype)
    hw = (HW_FP8_DECODE if hw is None else hw) and name == "fp8"
    if v == "group":
        kern = compile_kernel(("kv_gather", v, name, dim, dt, hw), lambda: _build_gather(name, dim, dt, hw))
    else:
        kern = compile_kernel(("kv_gather", v, name, dim, dt, hw), lambda: build_gather_coop(name, dim, dt, hw, _VPT[v]))
    kern(pool, pool.view(torch.int32), slots.contiguous(), out)
    return out


@register("kv_store", "cuda")
def kv_store(pool: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, fmt: str = "fp8", check: bool = True) -> torch.Tensor:
    """Same contract and bytes as the reference ``kv_store``; fp8 / fp4 / mxfp4 run the TileLang kernel.

    ``check=False`` skips the two device-synchronising value checks (slot range, NaN in ``x``): for the
    engine's hot path, whose slot mappings come from its own block tables. Shapes are always checked.
    """
    if x.dim() != 2:
        raise ValueError(f"x: must be [tokens, dim], got shape {tuple(x.shape)}")
    name = _usable(fmt, x.shape[1], pool, x)
    if name is None:
        return ref.kv_store(pool, x, slot_mapping, fmt)
    f = ref.resolve_format(fmt, x.shape[1])
    flat = ref.flat_pool(pool, f.bytes_per_token)
    if check:
        slots = ref.check_slots("slot_mapping", slot_mapping, x.shape[0], flat.shape[0]).to(pool.device)
        if x.shape[0] and bool(torch.isnan(x).any()):
            raise ValueError(f"{f.name}.quantize: x contains NaN (cannot be saturated)")
    else:
        if slot_mapping.shape != (x.shape[0],):
            raise ValueError(f"slot_mapping: must have shape ({x.shape[0]},), got {tuple(slot_mapping.shape)}")
        slots = slot_mapping.to(pool.device, torch.int64)
    store_slots(flat, x, slots, name)
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
        raise ValueError(f"block_table: must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
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
    ring: torch.Tensor, x: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, fmt: str = "fp8", check: bool = True
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
