"""TileLang KV cache kernels: quantise + scatter (``kv_store``, ``swa_ring_write``) and gather + dequantise
(``kv_load``, ``swa_ring_read``) in the byte formats of ``deepinfer_core.kv.formats``.

A thread owns ``gpt`` consecutive scale groups of one token (32 values for fp8 / mxfp4, 16 for fp4). It
issues all its loads first (16-byte vector loads of the inputs, or of the packed codes and the scale
bytes), then derives each group's scale exactly as the torch reference does, encodes or decodes, and
writes 32-bit words with 16-byte stores (through an int32 view of the pool: rows of 528 / 288 / 68 bytes
are 4-byte aligned). Several groups a thread put more bytes in flight per thread, which is what the
loads lacked (one fp4 group is 9 bytes read for 32 written). The bytes are identical to the reference
(tested bit for bit). Loads go through one generic "gather slots and dequantise" kernel; block tables
and ring positions are turned into flat slots by a few elementwise torch ops first.

Codecs (``_codecs``): fp8 encodes with the hardware e4m3 conversion (RNE, satfinite) and decodes with it
plus one float32 multiply; e2m1 (fp4, mxfp4) encodes by comparing ``|x|`` with the seven exact
thresholds ``mid * scale`` (no division; same codes, see ``_codecs.e2m1_thresholds``) and fp4 decodes
through float16 bits. Each has an integer-exact or float64 fallback kept as a switch for the tests.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import math

import torch

from deepinfer_kernels.cuda import _codecs as C
from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.ops import kv_store as ref
from deepinfer_kernels.registry import register

_THREADS = 128
# name -> (group, value bytes per group, kind); mxfp4's element max is 6 with a power-of-two scale.
_LAYOUT = {"fp8": (32, 32, "fp8"), "fp4": (16, 8, "fp4"), "mxfp4": (32, 16, "mxfp4")}
_FMAX = 3.4028234663852886e38


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


def _pow2_f32(e):
    """2.0**e as float32 for int32 e in [-127, 127] (2**-127 is the subnormal 0x00400000)."""
    return T.if_then_else(e == -127, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret((e + 127) << 23, "float32"))


def _word_loop(bpt: int, gpt: int, vw: int):
    """16-byte vector access where each thread's words are aligned to their size (68-byte mxfp4 rows and
    single 8-byte fp4 groups are not), else word by word."""
    return T.vectorized if bpt % 16 == 0 and (gpt * vw * 4) % 16 == 0 else T.unroll


def _build_store(
    fmt: str, dim: int, in_dtype: str, hw_fp8: bool = False, gpt: int = 1, fast_e2m1: bool = True
):
    group, groups, value_bytes, bpt = _sizes(fmt, dim)
    vb = _LAYOUT[fmt][1]
    vw = vb // 4  # value words (int32) per group
    gpt = math.gcd(gpt, groups)
    tpt = groups // gpt  # threads per token
    wloop = _word_loop(bpt, gpt, vw)
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    @T.prim_func
    def store(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),  # the same bytes, for 16-byte value stores
        x: T.Tensor((n, dim), in_dtype),
        slots: T.Tensor((n,), "int64"),
    ):
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            raw = T.alloc_local((gpt * group,), in_dtype)
            vals = T.alloc_local((group,), "float32")
            codes = T.alloc_local((group,), "uint32")
            words = T.alloc_local((gpt * vw,), "int32")
            sbs = T.alloc_local((gpt,), "uint8")
            th = T.alloc_local((7,), "float32")
            amax = T.alloc_var("float32")
            # Named scalars (not Python expressions) so the codec expressions are built once, not re-inlined.
            e = T.alloc_var("int32")
            inv = T.alloc_var("float64")
            sc = T.alloc_var("float32")
            sb = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            q = T.alloc_var("float32")
            tid = bx * _THREADS + tx
            if tid < n * tpt:
                t = tid // tpt
                g0 = (tid % tpt) * gpt
                s = slots[t]
                if s >= 0:
                    for j in T.vectorized(gpt * group):  # every load first: gpt * 64 bytes of bf16 in flight
                        raw[j] = x[t, g0 * group + j]
                    for gg in T.unroll(gpt):
                        amax = T.float32(0)
                        for j in T.unroll(group):
                            vals[j] = T.Cast("float32", raw[gg * group + j])
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
                            if fast_e2m1:
                                for k, v in enumerate(C.e2m1_thresholds(_pow2_f32(e))):
                                    th[k] = v
                                for j in T.unroll(group):
                                    codes[j] = T.Cast("uint32", C.e2m1_code_by_thresholds(vals[j], th))
                            else:
                                inv = C.pow2_f64(-e)
                                for j in T.unroll(group):
                                    q = T.Cast("float32", T.Cast("float64", vals[j]) * inv)
                                    codes[j] = T.Cast("uint32", C.e2m1_code(q))
                            sb = e + 127
                        else:  # fp4: e4m3 scale = amax / 6 rounded up to an e4m3 value
                            sc = T.min(T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0))
                            sb = C.e4m3_bits_hw(sc) if hw_fp8 else C.e4m3_bits(sc)
                            sv = C.e4m3_value_hw(sb) if hw_fp8 else C.e4m3_value(sb)
                            if (sv < sc) & (sb < 0x7E):
                                sb = sb + 1
                            sv = C.e4m3_value_hw(sb) if hw_fp8 else C.e4m3_value(sb)
                            if fast_e2m1:
                                for k, v in enumerate(C.e2m1_thresholds(sv)):
                                    th[k] = v
                                for j in T.unroll(group):
                                    codes[j] = T.Cast("uint32", C.e2m1_code_by_thresholds(vals[j], th))
                            else:
                                for j in T.unroll(group):
                                    q = T.ieee_fdiv(vals[j], sv)
                                    codes[j] = T.Cast("uint32", C.e2m1_code(q))
                        # Pack little-endian words: 4 bytes (fp8) or 8 nibbles (fp4 / mxfp4) per word.
                        for w in T.unroll(vw):
                            if fmt == "fp8":
                                words[gg * vw + w] = T.reinterpret(
                                    codes[4 * w] | (codes[4 * w + 1] << T.uint32(8)) | (codes[4 * w + 2] << T.uint32(16)) | (codes[4 * w + 3] << T.uint32(24)),
                                    "int32",
                                )
                            else:
                                words[gg * vw + w] = T.reinterpret(_pack_nibbles(codes, w), "int32")
                        sbs[gg] = T.Cast("uint8", sb)
                    for w in wloop(gpt * vw):
                        pool32[s, g0 * vw + w] = words[w]
                    for gg in T.unroll(gpt):
                        pool8[s, value_bytes + g0 + gg] = sbs[gg]

    return store


# Two-lane bf16 helpers for the fp4 store: ``set.gt.u32.bf16x2`` (sm_90) gives 0xFFFF in each 16-bit lane
# where a > b, ``max.bf16x2`` the lane-wise max; one instruction for two values each.
_BF16X2_SRC = """
__device__ __forceinline__ unsigned di_gt_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ unsigned di_max_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
"""


def _build_store_fp4_bf16x2(dim: int, gpt: int = 1):
    """fp4 store for bf16 input, two values per instruction (``variant="bf16x2"``).

    The input is read as 32-bit words, each two bf16 values; the group max is a lane-wise bf16 max of
    the magnitudes (sign bits cleared; the input has no NaN). The seven thresholds ``mid * scale`` have <= 7 significant bits, so they are exact in
    bf16 and the comparisons ``|x| > mid * scale`` (see ``_codecs.e2m1_thresholds``) run on both lanes at
    once; the binary search picks each lane's next threshold with bit masks instead of selects.
    Same bytes as the scalar path (tested).
    """
    group, groups, value_bytes, bpt = _sizes("fp4", dim)
    vw = 2  # code words per group: 16 nibbles
    gpt = math.gcd(gpt, groups)
    tpt = groups // gpt
    ipg = group // 2  # input words per group
    wloop = _word_loop(bpt, gpt, vw)
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    def gt(a, b):
        return T.call_extern("uint32", "di_gt_bf16x2", a, b)

    def pick(mask, yes, no):
        return (yes & mask) | (no & ~mask)

    @T.prim_func
    def store(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        x32: T.Tensor((n, dim // 2), "int32"),  # the bf16 input, two values a word
        slots: T.Tensor((n,), "int64"),
    ):
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            T.import_source(_BF16X2_SRC)
            tx = T.get_thread_binding(0)
            raw = T.alloc_local((gpt * ipg,), "int32")
            mag = T.alloc_local((ipg,), "uint32")
            th = T.alloc_local((7,), "uint32")
            pairs = T.alloc_local((ipg,), "uint32")
            words = T.alloc_local((gpt * vw,), "int32")
            sbs = T.alloc_local((gpt,), "uint8")
            m2 = T.alloc_var("uint32")
            amax = T.alloc_var("float32")
            sc = T.alloc_var("float32")
            sb = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            h = T.alloc_var("uint32")
            m1 = T.alloc_var("uint32")
            sgn = T.alloc_var("uint32")
            tid = bx * _THREADS + tx
            if tid < n * tpt:
                t = tid // tpt
                g0 = (tid % tpt) * gpt
                s = slots[t]
                if s >= 0:
                    for j in T.vectorized(gpt * ipg):
                        raw[j] = x32[t, g0 * ipg + j]
                    for gg in T.unroll(gpt):
                        m2 = T.uint32(0)
                        for j in T.unroll(ipg):
                            mag[j] = T.reinterpret(raw[gg * ipg + j], "uint32") & T.uint32(0x7FFF7FFF)
                            m2 = T.call_extern("uint32", "di_max_bf16x2", m2, mag[j])
                        m2 = T.max(m2 & T.uint32(0xFFFF), m2 >> T.uint32(16))
                        amax = T.reinterpret(m2 << T.uint32(16), "float32")
                        sc = T.min(T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0))
                        sb = C.e4m3_bits_hw(sc)
                        sv = C.e4m3_value_hw(sb)
                        if (sv < sc) & (sb < 0x7E):
                            sb = sb + 1
                        sv = C.e4m3_value_hw(sb)
                        for k, v in enumerate(C.e2m1_thresholds(sv)):
                            m2 = T.reinterpret(v, "uint32") >> T.uint32(16)  # exact: the low 16 bits are zero
                            th[k] = m2 | (m2 << T.uint32(16))
                        for j in T.unroll(ipg):
                            h = gt(mag[j], th[3])
                            m1 = gt(mag[j], pick(h, th[5], th[1]))
                            m2 = gt(mag[j], pick(h, pick(m1, th[6], th[4]), pick(m1, th[2], th[0])))
                            # sign to bit 3 of each lane whose code is non-zero: some comparison held (when
                            # neither h nor m1 did, the last one was against mid_0 * scale)
                            sgn = (h | m1 | m2) & (T.reinterpret(raw[gg * ipg + j], "uint32") >> T.uint32(12)) & T.uint32(0x00080008)
                            m2 = (h & T.uint32(0x00040004)) | (m1 & T.uint32(0x00020002)) | (m2 & T.uint32(0x00010001)) | sgn
                            pairs[j] = (m2 & T.uint32(0xF)) | ((m2 >> T.uint32(12)) & T.uint32(0xF0))  # two nibbles
                        for w in T.unroll(vw):
                            words[gg * vw + w] = T.reinterpret(
                                pairs[4 * w] | (pairs[4 * w + 1] << T.uint32(8)) | (pairs[4 * w + 2] << T.uint32(16)) | (pairs[4 * w + 3] << T.uint32(24)),
                                "int32",
                            )
                        sbs[gg] = T.Cast("uint8", sb)
                    for w in wloop(gpt * vw):
                        pool32[s, g0 * vw + w] = words[w]
                    for gg in T.unroll(gpt):
                        pool8[s, value_bytes + g0 + gg] = sbs[gg]

    return store


def _build_store_fp4_bf16x2_interleaved(dim: int, gpt: int = 4):
    """The bf16x2 fp4 store with ``gpt`` groups a thread taken 32 apart (``variant="bf16x2i4"``).

    Groups are numbered across the batch (token * groups + group); warp w covers groups w * 32 * gpt ...
    and lane l takes l, l + 32, ...: each load and store instruction of a warp touches 32 consecutive
    groups (as with one group a thread) while every thread has ``gpt`` independent groups in flight (as
    with ``bf16x2g4``, whose 128 contiguous bytes a thread spread a warp's instruction over 4 KB).
    """
    group, groups, value_bytes, bpt = _sizes("fp4", dim)
    vw, ipg = 2, group // 2  # code words, input words per group
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    def gt(a, b):
        return T.call_extern("uint32", "di_gt_bf16x2", a, b)

    def pick(mask, yes, no):
        return (yes & mask) | (no & ~mask)

    @T.prim_func
    def store(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        x32: T.Tensor((n, dim // 2), "int32"),
        slots: T.Tensor((n,), "int64"),
    ):
        with T.Kernel(T.ceildiv(n * groups, _THREADS * gpt), threads=_THREADS) as bx:
            T.import_source(_BF16X2_SRC)
            tx = T.get_thread_binding(0)
            raw = T.alloc_local((gpt * ipg,), "int32")
            ss = T.alloc_local((gpt,), "int64")
            mag = T.alloc_local((ipg,), "uint32")
            th = T.alloc_local((7,), "uint32")
            words = T.alloc_local((vw,), "int32")
            pairs = T.alloc_local((ipg,), "uint32")
            m2 = T.alloc_var("uint32")
            amax = T.alloc_var("float32")
            sc = T.alloc_var("float32")
            sb = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            h = T.alloc_var("uint32")
            m1 = T.alloc_var("uint32")
            sgn = T.alloc_var("uint32")
            base = (bx * _THREADS + (tx // 32) * 32) * gpt + tx % 32  # this lane's first group
            for k in T.unroll(gpt):  # every load first
                ss[k] = T.int64(-1)
                if base + 32 * k < n * groups:
                    ss[k] = slots[(base + 32 * k) // groups]
                    if ss[k] >= 0:
                        for j in T.vectorized(ipg):
                            raw[k * ipg + j] = x32[(base + 32 * k) // groups, ((base + 32 * k) % groups) * ipg + j]
            for k in T.unroll(gpt):
                if ss[k] >= 0:
                    m2 = T.uint32(0)
                    for j in T.unroll(ipg):
                        mag[j] = T.reinterpret(raw[k * ipg + j], "uint32") & T.uint32(0x7FFF7FFF)
                        m2 = T.call_extern("uint32", "di_max_bf16x2", m2, mag[j])
                    m2 = T.max(m2 & T.uint32(0xFFFF), m2 >> T.uint32(16))
                    amax = T.reinterpret(m2 << T.uint32(16), "float32")
                    sc = T.min(T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0))
                    sb = C.e4m3_bits_hw(sc)
                    sv = C.e4m3_value_hw(sb)
                    if (sv < sc) & (sb < 0x7E):
                        sb = sb + 1
                    sv = C.e4m3_value_hw(sb)
                    for i, v in enumerate(C.e2m1_thresholds(sv)):
                        th[i] = (T.reinterpret(v, "uint32") >> T.uint32(16)) * T.uint32(0x00010001)  # exact
                    for j in T.unroll(ipg):
                        h = gt(mag[j], th[3])
                        m1 = gt(mag[j], pick(h, th[5], th[1]))
                        m2 = gt(mag[j], pick(m1, pick(h, th[6], th[2]), pick(h, th[4], th[0])))
                        sgn = (h | m1 | m2) & (T.reinterpret(raw[k * ipg + j], "uint32") >> T.uint32(12)) & T.uint32(0x00080008)
                        m2 = (h & T.uint32(0x00040004)) | (m1 & T.uint32(0x00020002)) | (m2 & T.uint32(0x00010001)) | sgn
                        pairs[j] = (m2 & T.uint32(0xF)) | ((m2 >> T.uint32(12)) & T.uint32(0xF0))
                    for w in T.unroll(vw):
                        words[w] = T.reinterpret(
                            pairs[4 * w] | (pairs[4 * w + 1] << T.uint32(8)) | (pairs[4 * w + 2] << T.uint32(16)) | (pairs[4 * w + 3] << T.uint32(24)),
                            "int32",
                        )
                    for w in T.vectorized(vw):
                        pool32[ss[k], ((base + 32 * k) % groups) * vw + w] = words[w]
                    pool8[ss[k], value_bytes + (base + 32 * k) % groups] = T.Cast("uint8", sb)

    return store


def _build_gather(fmt: str, dim: int, out_dtype: str, hw: bool = False, gpt: int = 1, fast_e2m1: bool = True):
    group, groups, value_bytes, bpt = _sizes(fmt, dim)
    vb = _LAYOUT[fmt][1]
    vw = vb // 4
    gpt = math.gcd(gpt, groups)
    tpt = groups // gpt
    wloop = _word_loop(bpt, gpt, vw)
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    @T.prim_func
    def gather(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        slots: T.Tensor((n,), "int64"),
        out: T.Tensor((n, dim), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            words = T.alloc_local((gpt * vw,), "int32")
            sbs = T.alloc_local((gpt,), "int32")
            res = T.alloc_local((group,), out_dtype)
            code = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            sc = T.alloc_var("float64")
            tid = bx * _THREADS + tx
            if tid < n * tpt:
                t = tid // tpt
                g0 = (tid % tpt) * gpt
                s = slots[t]
                if s < 0:
                    for j in T.unroll(group):
                        res[j] = T.Cast(out_dtype, 0)
                    for gg in T.unroll(gpt):
                        for j in T.vectorized(group):
                            out[t, (g0 + gg) * group + j] = res[j]
                else:
                    for w in wloop(gpt * vw):  # every load first: the codes and scales of gpt groups
                        words[w] = pool32[s, g0 * vw + w]
                    for gg in T.unroll(gpt):
                        sbs[gg] = T.Cast("int32", pool8[s, value_bytes + g0 + gg])
                    for gg in T.unroll(gpt):
                        code = sbs[gg]
                        if fmt == "fp8" and hw:
                            # hardware e4m3 decode and one float32 multiply by 2^(code-127) (exact in float32 for
                            # every code a store writes, 0..254): the exact product (4 significant bits) rounded
                            # once, as the reference's float64 product rounded to float32. Codes >= 247 can
                            # overflow to +-inf where the reference saturates at +-max: they clamp (off the
                            # common path, so it pays nothing for them; float32 keeps the registers low).
                            sv = T.if_then_else(code == 0, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret(code << 23, "float32"))
                            if code < 247:
                                for j in T.unroll(group):
                                    byte = (words[gg * vw + j // 4] >> (8 * (j % 4))) & 0xFF
                                    res[j] = T.Cast(out_dtype, C.e4m3_value_hw(byte) * sv)
                            else:
                                for j in T.unroll(group):
                                    byte = (words[gg * vw + j // 4] >> (8 * (j % 4))) & 0xFF
                                    res[j] = T.Cast(out_dtype, T.min(T.max(C.e4m3_value_hw(byte) * sv, T.float32(-_FMAX)), T.float32(_FMAX)))
                        elif fmt == "fp8":
                            sc = C.pow2_f64(code - 127)
                            for j in T.unroll(group):
                                byte = (words[gg * vw + j // 4] >> (8 * (j % 4))) & 0xFF
                                v = T.Cast("float64", C.e4m3_signed_value(byte)) * sc
                                res[j] = T.Cast(out_dtype, T.Cast("float32", T.min(T.max(v, T.float64(-_FMAX)), T.float64(_FMAX))))
                        elif fmt == "fp4" and fast_e2m1:
                            # value = (e2m1 * 2^-14 as float16) * (scale * 2^14): both factors exact, so the
                            # float32 product is the reference's exact e2m1 * scale.
                            sv = C.e4m3_value(code) * T.float32(2.0**14)
                            for j in T.unroll(group):
                                nib = (words[gg * vw + j // 8] >> (4 * (j % 8))) & 0xF
                                res[j] = T.Cast(out_dtype, T.Cast("float32", C.e2m1_as_half(nib)) * sv)
                        elif fmt == "fp4":
                            sv = C.e4m3_value(code)
                            for j in T.unroll(group):
                                nib = (words[gg * vw + j // 8] >> (4 * (j % 8))) & 0xF
                                res[j] = T.Cast(out_dtype, C.e2m1_value(nib) * sv)
                        else:
                            sc = C.pow2_f64(code - 127)
                            for j in T.unroll(group):
                                nib = (words[gg * vw + j // 8] >> (4 * (j % 8))) & 0xF
                                v = T.Cast("float64", C.e2m1_value(nib)) * sc
                                res[j] = T.Cast(out_dtype, T.Cast("float32", T.min(T.max(v, T.float64(-_FMAX)), T.float64(_FMAX))))
                        for j in T.vectorized(group):  # 16-byte stores of the group's outputs
                            out[t, (g0 + gg) * group + j] = res[j]

    return gather


def _build_gather_lanes(fmt: str, dim: int, out_dtype: str, vpt: int = 8):
    """Gather with ``vpt`` values a thread (a slice of one scale group): a warp reads the codes of 256
    values contiguously and writes their 512 bytes of bf16 with one 16-byte store per thread, where the
    group layout's stores land 64 bytes apart. fp8 (hardware decode) and fp4 (float16-bit decode) only."""
    group, _, value_bytes, bpt = _sizes(fmt, dim)
    bits = 8 if fmt == "fp8" else 4
    tpg = group // vpt  # threads per scale group
    tpt = dim // vpt  # threads per token
    nw = vpt * bits // 32  # code words per thread (2 for fp8, 1 for fp4)
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    @T.prim_func
    def gather(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        slots: T.Tensor((n,), "int64"),
        out: T.Tensor((n, dim), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            words = T.alloc_local((nw,), "int32")
            res = T.alloc_local((vpt,), out_dtype)
            code = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            tid = bx * _THREADS + tx
            if tid < n * tpt:
                t = tid // tpt
                k = tid % tpt  # slice of the row: values k * vpt ...
                s = slots[t]
                if s < 0:
                    for j in T.unroll(vpt):
                        res[j] = T.Cast(out_dtype, 0)
                else:
                    for w in T.vectorized(nw):
                        words[w] = pool32[s, k * nw + w]
                    code = T.Cast("int32", pool8[s, value_bytes + k // tpg])
                    if fmt == "fp8":
                        sv = T.if_then_else(code == 0, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret(code << 23, "float32"))
                        if code < 247:
                            for j in T.unroll(vpt):
                                byte = (words[j // 4] >> (8 * (j % 4))) & 0xFF
                                res[j] = T.Cast(out_dtype, C.e4m3_value_hw(byte) * sv)
                        else:
                            for j in T.unroll(vpt):
                                byte = (words[j // 4] >> (8 * (j % 4))) & 0xFF
                                res[j] = T.Cast(out_dtype, T.min(T.max(C.e4m3_value_hw(byte) * sv, T.float32(-_FMAX)), T.float32(_FMAX)))
                    else:
                        sv = C.e4m3_value(code) * T.float32(2.0**14)
                        for j in T.unroll(vpt):
                            nib = (words[j // 8] >> (4 * (j % 8))) & 0xF
                            res[j] = T.Cast(out_dtype, T.Cast("float32", C.e2m1_as_half(nib)) * sv)
                for j in T.vectorized(vpt):
                    out[t, k * vpt + j] = res[j]

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

# e2m1 (fp4 / mxfp4) encoded by the seven exact thresholds and fp4 decoded through float16 bits, instead
# of a float32 division (fp4) / float64 multiply (mxfp4) per value and the select chain of ``e2m1_value``.
# Same bytes and values by construction (``_codecs.e2m1_thresholds``); the GPU tests run both paths.
FAST_E2M1 = True

# Kernel layouts, name -> (layout, scale groups a thread): "group*" (any format; fewer groups when a row has
# fewer), "lanes" (loads of fp8 / fp4 with the default codecs: 8 values a thread), "bf16x2*" (fp4 stores
# of bf16 input: two values an instruction). A layout that does not apply to a call takes "group" with
# the same groups a thread. Every variant is tested byte for byte against the reference and timed side
# by side in benchmarks/kernels.py; the defaults are what the H200 measured fastest.
_LAYOUTS = {
    "group": ("group", 1), "group2": ("group", 2), "group4": ("group", 4), "lanes": ("lanes", 1),
    "bf16x2": ("bf16x2", 1), "bf16x2g2": ("bf16x2", 2), "bf16x2g4": ("bf16x2", 4), "bf16x2i4": ("bf16x2i", 4),
}
VARIANTS = tuple(_LAYOUTS)
# Defaults per format (a plain name applies to every format): the fastest on the H200, 2026-11-30.
STORE_VARIANT: str | dict[str, str] = {"fp8": "group", "fp4": "bf16x2g4", "mxfp4": "group"}
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
    if layout.startswith("bf16x2") and name == "fp4" and dt == "bfloat16" and hw and fast:
        if layout == "bf16x2i":
            kern = compile_kernel(("kv_store_bf16x2i", gpt, dim), lambda: _build_store_fp4_bf16x2_interleaved(dim, gpt))
        else:
            kern = compile_kernel(("kv_store_bf16x2", gpt, dim), lambda: _build_store_fp4_bf16x2(dim, gpt))
        kern(pool, pool.view(torch.int32), x.contiguous().view(torch.int32), slots.contiguous())
        return
    kern = compile_kernel(("kv_store", gpt, name, dim, dt, hw, fast), lambda: _build_store(name, dim, dt, hw, gpt, fast))
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
) -> torch.Tensor:
    """Launch the gather kernel: rows ``slots`` (int64 [N], < 0 gives zeros) dequantised to [N, dim]."""
    layout, gpt = _variant(variant, LOAD_VARIANT, name)
    out = torch.empty(slots.shape[0], dim, dtype=out_dtype, device=pool.device)
    if slots.shape[0] == 0:
        return out
    dt = torch_dtype_name(out_dtype)
    hw = (HW_FP8_DECODE if hw is None else hw) and name == "fp8"
    fast = (FAST_E2M1 if fast_e2m1 is None else fast_e2m1) and name == "fp4"
    if layout == "lanes" and ((name == "fp8" and hw) or (name == "fp4" and fast)):
        kern = compile_kernel(("kv_gather_lanes", name, dim, dt), lambda: _build_gather_lanes(name, dim, dt))
    else:
        kern = compile_kernel(("kv_gather", gpt, name, dim, dt, hw, fast), lambda: _build_gather(name, dim, dt, hw, gpt, fast))
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
