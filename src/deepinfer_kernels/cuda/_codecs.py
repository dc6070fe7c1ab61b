"""Bit-exact element codecs as TileLang expressions (e4m3, e2m1, ue8m0), shared by the KV kernels.

Everything is integer arithmetic on the IEEE bit patterns, so the kernels produce the same bytes as
``deepinfer_core.kv.formats`` (torch) whatever the CUDA compiler does with floating point (no reliance
on the fp8 conversion intrinsics, fast-math flags or ``rint``). Each function takes and returns
``PrimExpr``; they are called while a ``T.prim_func`` is being built and inline into it.
"""

from deepinfer_core.kv.formats import _E2M1_MID as E2M1_MIDS  # round to nearest, ties to the lower code
from deepinfer_kernels.cuda._tl import T

F32_MAX = 3.4028234663852886e38  # the reference saturates dequantised values here


def _rne_shift(m, s):
    """Round-to-nearest-even of ``m / 2**s`` for non-negative int32 ``m`` and 1 <= s <= 30."""
    q = m >> s
    rem = m & ((T.int32(1) << s) - 1)
    half = T.int32(1) << (s - 1)
    up = T.if_then_else((rem > half) | ((rem == half) & ((q & 1) == 1)), 1, 0)
    return q + up


def e4m3_bits(v):
    """float32 ``v`` (|v| <= 448) -> e4m3fn byte (int32 0..255), round to nearest even, sign kept on 0."""
    bits = T.reinterpret(v, "int32")
    sign = T.if_then_else(bits < 0, 0x80, 0)
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    m = a & 0x7FFFFF
    normal = ((e + 7) << 3) + _rne_shift(m, T.int32(20))  # a carry out of the mantissa bumps the exponent
    # e4m3 subnormals are k * 2**-9: the full 24-bit significand shifted right by 14 - e (>= 21).
    shift = T.min(14 - e, 30)
    sub = T.if_then_else(a < 0x00800000, 0, _rne_shift(m | 0x800000, shift))
    code = T.if_then_else(e >= -6, normal, sub)
    return sign | T.min(code, 0x7E)


def e4m3_value(code):
    """Positive e4m3 byte (int32, < 0x80) -> float32 value (exact)."""
    ex = code >> 3
    man = code & 7
    sub = T.Cast("float32", man) * T.float32(2.0**-9)
    # (8 + man) * 2**(ex - 10), with the power of two built from its bits (ex - 10 in [-9, 5]).
    p2 = T.reinterpret((ex - 10 + 127) << 23, "float32")
    return T.if_then_else(ex == 0, sub, T.Cast("float32", 8 + man) * p2)


def e4m3_signed_value(code):
    v = e4m3_value(code & 0x7F)
    return T.if_then_else((code & 0x80) != 0, -v, v)


def e2m1_code(v):
    """float32 ``v`` (already divided by its scale) -> 4-bit e2m1 code, saturating at +-6."""
    mag = T.abs(v)
    code = T.int32(0)
    for mid in E2M1_MIDS:
        code = code + T.if_then_else(mag > T.float32(mid), 1, 0)
    return code | T.if_then_else((v < T.float32(0)) & (code > 0), 8, 0)


def e2m1_value(code):
    """4-bit e2m1 code -> float32: magnitude 0, .5, 1, 1.5, 2, 3, 4, 6 by the low 3 bits."""
    c = code & 7
    # For c >= 2: (2 + (c & 1)) * 2**((c >> 1) - 2), i.e. 1, 1.5, 2, 3, 4, 6; c = 1 is the subnormal 0.5.
    mag = T.if_then_else(
        c < 2,
        T.Cast("float32", c) * T.float32(0.5),
        T.Cast("float32", 2 + (c & 1)) * T.reinterpret(((c >> 1) - 2 + 127) << 23, "float32"),
    )
    return T.if_then_else((code & 8) != 0, -mag, mag)


def pow2_exponent_f64(amax, elem_max: float):
    """Smallest e with amax / 2**e <= elem_max, clamped to [-127, 127] (int32), as formats.pow2_scale_exponent."""
    y = T.Cast("float64", amax) / T.float64(elem_max)
    b = T.reinterpret(y, "int64")
    ex = T.Cast("int32", (b >> 52) & 0x7FF) - 1023
    e = ex + T.if_then_else((b & T.int64(0xFFFFFFFFFFFFF)) != 0, 1, 0)
    e = T.if_then_else(amax > T.float32(0), e, -127)
    return T.max(T.min(e, 127), -127)


def pow2_f64(k):
    """2.0**k as float64 for int32 k in [-1022, 1023] (exact)."""
    return T.reinterpret(T.Cast("int64", k + 1023) << 52, "float64")


def ue8m0_scale_f32(code):
    """ue8m0 byte -> 2**(code - 127) in float32 (code 0 gives 2**-127, a float32 subnormal)."""
    return T.Cast("float32", pow2_f64(code - 127))


def e2m1_thresholds(scale):
    """The seven e2m1 decision points ``mid_k * scale`` for a float32 ``scale`` (a list of PrimExpr).

    ``e2m1_code(x / scale)`` counts the mids below the rounded quotient. For an e4m3 scale (<= 4
    significant bits) or a power of two, ``mid_k * scale`` is exact in float32 (mids have <= 3 bits),
    and no float32 ``x`` lies strictly between ``mid_k * scale`` and the largest real whose quotient still
    rounds down to ``mid_k`` (that gap, half an ulp of ``mid_k`` times the scale, is below one ulp of
    ``mid_k * scale``). So ``fl(|x| / scale) > mid_k`` iff ``|x| > mid_k * scale``: the same codes without
    a division (``tests/deepinfer_kernels/test_e2m1_thresholds.py`` checks the identity on the CPU).
    """
    return [T.float32(mid) * scale for mid in E2M1_MIDS]


def e2m1_code_by_thresholds(v, th):
    """e2m1 code of ``v / scale`` from ``th = e2m1_thresholds(scale)`` (held in registers): a binary
    search over the sorted thresholds, 3 comparisons instead of 7 plus a division."""
    a = T.abs(v)
    hi = a > th[3]  # code >= 4
    m1 = a > T.if_then_else(hi, th[5], th[1])
    lo_t = T.if_then_else(m1, th[2], th[0])
    hi_t = T.if_then_else(m1, th[6], th[4])
    m2 = a > T.if_then_else(hi, hi_t, lo_t)
    code = T.if_then_else(hi, 4, 0) + T.if_then_else(m1, 2, 0) + T.if_then_else(m2, 1, 0)
    return code | T.if_then_else((v < T.float32(0)) & (code > 0), 8, 0)


def e2m1_as_half(code):
    """4-bit e2m1 code -> float16 equal to its value times 2**-14 (exact, subnormal 0.5 included).

    e2m1 is sign | 2-bit exponent (bias 1) | 1-bit mantissa; placed at float16's sign and at the low end of
    its exponent field (bias 15) the same bits read as the value scaled by 2**(1 - 15). One shift-and-or
    and the hardware half -> float conversion replace the select chain of ``e2m1_value``.
    """
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return T.reinterpret(T.Cast("uint16", bits), "float16")


def e4m3_bits_hw(v):
    """Non-negative float32 ``v`` (<= 448) -> e4m3 byte by the hardware conversion (RNE, satfinite): the
    same byte as ``e4m3_bits`` (the fp8 store path relies on the same equivalence, tested on the H200)."""
    return T.Cast("int32", T.reinterpret(T.Cast("float8_e4m3fn", v), "uint8"))


def e4m3_value_hw(code):
    """e4m3 byte (int32) -> float32 by the hardware conversion (exact)."""
    return T.Cast("float32", T.reinterpret(T.Cast("uint8", code), "float8_e4m3fn"))


def ue8m0_scale_f32_bits(code):
    """ue8m0 byte (int32 0..254) -> 2**(code - 127) in float32 built from its bits (code 0 is the
    subnormal 2**-127): exact, no float64."""
    return T.if_then_else(
        code == 0, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret(code << 23, "float32")
    )


def fp8_times_scale(word, j, sv, saturate: bool):
    """Byte ``j % 4`` of the int32 ``word`` decoded as e4m3 (hardware) times the float32 scale ``sv``:
    the exact product rounded once. ``saturate`` clamps to +-float32 max, as the reference's float64
    product does, for the scale codes (>= 247) where float32 can overflow."""
    v = e4m3_value_hw((word >> (8 * (j % 4))) & 0xFF) * sv
    return T.min(T.max(v, T.float32(-F32_MAX)), T.float32(F32_MAX)) if saturate else v
