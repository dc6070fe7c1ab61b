"""TileLang prim_funcs of the KV cache kernels (built and dispatched by ``kv_store``): quantise + scatter
and gather + dequantise in the byte formats of ``deepinfer_core.kv.formats``; see ``kv_store`` for the
layouts, codecs and measurements.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import math

from deepinfer_kernels.cuda import _codecs as C
from deepinfer_kernels.cuda._tl import T

_THREADS = 128
# name -> (group, value bytes per group, kind); mxfp4's element max is 6 with a power-of-two scale.
_LAYOUT = {"fp8": (32, 32, "fp8"), "fp4": (16, 8, "fp4"), "mxfp4": (32, 16, "mxfp4")}
_FMAX = C.F32_MAX


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
    return T.if_then_else(
        e == -127, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret((e + 127) << 23, "float32")
    )


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
                                if (
                                    hw_fp8
                                ):  # the hardware cvt (RNE, satfinite); 2^-e is exact in float32 for e <= 126
                                    q = T.min(
                                        T.max(
                                            vals[j] * T.reinterpret((127 - e) << 23, "float32"),
                                            T.float32(-448.0),
                                        ),
                                        T.float32(448.0),
                                    )
                                    codes[j] = T.Cast(
                                        "uint32", T.reinterpret(T.Cast("float8_e4m3fn", q), "uint8")
                                    )
                                else:
                                    q = T.min(
                                        T.max(
                                            T.Cast("float32", T.Cast("float64", vals[j]) * inv),
                                            T.float32(-448.0),
                                        ),
                                        T.float32(448.0),
                                    )
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
                            sc = T.min(
                                T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0)
                            )
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
                                    codes[4 * w]
                                    | (codes[4 * w + 1] << T.uint32(8))
                                    | (codes[4 * w + 2] << T.uint32(16))
                                    | (codes[4 * w + 3] << T.uint32(24)),
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


def _build_store_fp4_bf16x2_interleaved(dim: int, gpt: int = 4):
    """fp4 store for bf16 input, two values an instruction, ``gpt`` groups a thread taken 32 apart
    (``variant="bf16x2i4"``, the fp4 default).

    The input is read as 32-bit words, each two bf16 values; the group max is a lane-wise bf16 max of the
    magnitudes (sign bits cleared; the input has no NaN). The seven thresholds ``mid * scale`` have <= 7
    significant bits, so they are exact in bf16 and the comparisons ``|x| > mid * scale`` (see
    ``_codecs.e2m1_thresholds``) run on both lanes at once; the binary search picks each lane's next
    threshold with bit masks instead of selects. Same bytes as the scalar path (tested).

    Groups are numbered across the batch (token * groups + group); warp w covers groups w * 32 * gpt ...
    and lane l takes l, l + 32, ...: each load and store instruction of a warp touches 32 consecutive
    groups (as with one group a thread) while every thread has ``gpt`` independent groups in flight (as
    with 4 contiguous groups a thread, whose 128 bytes a thread spread a warp's instruction over 4 KB:
    64.5% of copy bandwidth against 67.6% at 65,536 tokens on the H200, 71.8% against 75.3% at 262,144).
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
                            raw[k * ipg + j] = x32[
                                (base + 32 * k) // groups, ((base + 32 * k) % groups) * ipg + j
                            ]
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
                        sgn = (
                            (h | m1 | m2)
                            & (T.reinterpret(raw[k * ipg + j], "uint32") >> T.uint32(12))
                            & T.uint32(0x00080008)
                        )
                        m2 = (
                            (h & T.uint32(0x00040004))
                            | (m1 & T.uint32(0x00020002))
                            | (m2 & T.uint32(0x00010001))
                            | sgn
                        )
                        pairs[j] = (m2 & T.uint32(0xF)) | ((m2 >> T.uint32(12)) & T.uint32(0xF0))
                    for w in T.unroll(vw):
                        words[w] = T.reinterpret(
                            pairs[4 * w]
                            | (pairs[4 * w + 1] << T.uint32(8))
                            | (pairs[4 * w + 2] << T.uint32(16))
                            | (pairs[4 * w + 3] << T.uint32(24)),
                            "int32",
                        )
                    for w in T.vectorized(vw):
                        pool32[ss[k], ((base + 32 * k) % groups) * vw + w] = words[w]
                    pool8[ss[k], value_bytes + (base + 32 * k) % groups] = T.Cast("uint8", sb)

    return store


def _out_row(t, place):
    """Output row of slot t: t itself, or with ``place = (k, total, col)`` (slots [rows, k] written into
    columns col .. col + k of an [rows, total, dim] output) row (t // k) * total + col + t % k."""
    if place is None:
        return t
    k, total, col = place
    return (t // k) * total + col + t % k


def _build_gather(
    fmt: str,
    dim: int,
    out_dtype: str,
    hw: bool = False,
    gpt: int = 1,
    fast_e2m1: bool = True,
    place: tuple[int, int, int] | None = None,
):
    group, groups, value_bytes, bpt = _sizes(fmt, dim)
    vb = _LAYOUT[fmt][1]
    vw = vb // 4
    gpt = math.gcd(gpt, groups)
    tpt = groups // gpt
    wloop = _word_loop(bpt, gpt, vw)
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")
    n_out = n if place is None else T.dynamic("n_out")

    @T.prim_func
    def gather(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        slots: T.Tensor((n,), "int64"),
        out: T.Tensor((n_out, dim), out_dtype),
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
                r = _out_row(t, place)
                if s < 0:
                    for j in T.unroll(group):
                        res[j] = T.Cast(out_dtype, 0)
                    for gg in T.unroll(gpt):
                        for j in T.vectorized(group):
                            out[r, (g0 + gg) * group + j] = res[j]
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
                            sv = C.ue8m0_scale_f32_bits(code)
                            if code < 247:
                                for j in T.unroll(group):
                                    res[j] = T.Cast(
                                        out_dtype, C.fp8_times_scale(words[gg * vw + j // 4], j, sv, False)
                                    )
                            else:
                                for j in T.unroll(group):
                                    res[j] = T.Cast(
                                        out_dtype, C.fp8_times_scale(words[gg * vw + j // 4], j, sv, True)
                                    )
                        elif fmt == "fp8":
                            sc = C.pow2_f64(code - 127)
                            for j in T.unroll(group):
                                byte = (words[gg * vw + j // 4] >> (8 * (j % 4))) & 0xFF
                                v = T.Cast("float64", C.e4m3_signed_value(byte)) * sc
                                res[j] = T.Cast(
                                    out_dtype,
                                    T.Cast("float32", T.min(T.max(v, T.float64(-_FMAX)), T.float64(_FMAX))),
                                )
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
                                res[j] = T.Cast(
                                    out_dtype,
                                    T.Cast("float32", T.min(T.max(v, T.float64(-_FMAX)), T.float64(_FMAX))),
                                )
                        for j in T.vectorized(group):  # 16-byte stores of the group's outputs
                            out[r, (g0 + gg) * group + j] = res[j]

    return gather


def _build_gather_lanes(
    fmt: str, dim: int, out_dtype: str, vpt: int = 8, place: tuple[int, int, int] | None = None
):
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
    n_out = n if place is None else T.dynamic("n_out")

    @T.prim_func
    def gather(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        slots: T.Tensor((n,), "int64"),
        out: T.Tensor((n_out, dim), out_dtype),
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
                        sv = C.ue8m0_scale_f32_bits(code)
                        if code < 247:
                            for j in T.unroll(vpt):
                                res[j] = T.Cast(out_dtype, C.fp8_times_scale(words[j // 4], j, sv, False))
                        else:
                            for j in T.unroll(vpt):
                                res[j] = T.Cast(out_dtype, C.fp8_times_scale(words[j // 4], j, sv, True))
                    else:
                        sv = C.e4m3_value(code) * T.float32(2.0**14)
                        for j in T.unroll(vpt):
                            nib = (words[j // 8] >> (4 * (j % 8))) & 0xF
                            res[j] = T.Cast(out_dtype, T.Cast("float32", C.e2m1_as_half(nib)) * sv)
                for j in T.vectorized(vpt):
                    out[_out_row(t, place), k * vpt + j] = res[j]

    return gather
