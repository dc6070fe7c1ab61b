"""Cooperative KV kernels (``variant="coop"``): several threads per scale group, coalesced 16-byte traffic.

The verified kernels in ``kv_store`` give one thread a whole scale group (32 values for fp8): a warp's
16-byte loads and stores then land 64 / 32 bytes apart, and each thread runs 32 codec evaluations in a
row with 100+ live registers. Here a thread owns 8 consecutive values (16 bytes of bf16 input), so a
warp reads 512 contiguous input bytes and writes 256 (fp8) or 128 (fp4) contiguous pool bytes per
instruction; the 4 (fp8, mxfp4) or 2 (fp4) threads of a scale group combine their absolute maxima with
``shfl_xor`` (max is exact and order-free, so every lane derives the same scale as the reference), and
the group's first lane writes the scale byte. The codec expressions are the verified ones (``_codecs``,
the hardware e4m3 cvt for ``hw_fp8``), so the bytes must equal the reference's: the GPU tests compare
both variants byte for byte.

Shuffles need every lane of the warp: the token index is clamped (the tail's spare lanes recompute the
last token) and only the store is guarded by the token range and the slot, never the arithmetic.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
from deepinfer_kernels.cuda import _codecs as C
from deepinfer_kernels.cuda._tl import T

_VPT = 8  # default values per thread: 16 bytes of bf16 input, 8 (fp8) or 4 (fp4) bytes of pool output
_THREADS = 256
# name -> (group, bits per value); mirrors kv_store._LAYOUT
_GROUP = {"fp8": (32, 8), "fp4": (16, 4), "mxfp4": (32, 4)}


def coop_sizes(fmt: str, dim: int, vpt: int = _VPT) -> tuple[int, int, int, int, int]:
    """(threads per token, threads per group, words per thread, value bytes, bytes per token)."""
    group, bits = _GROUP[fmt]
    if vpt not in (8, 16) or dim % group:
        raise ValueError(f"coop kernels: vpt must be 8 or 16 and dim a multiple of {group}, got vpt={vpt}, dim={dim}")
    groups = dim // group
    value_bytes = groups * group * bits // 8
    return dim // vpt, max(group // vpt, 1), vpt * bits // 32, value_bytes, value_bytes + groups


def _pack(codes, w: int, bits: int):
    per = 32 // bits
    acc = codes[per * w]
    for b in range(1, per):
        acc = acc | (codes[per * w + b] << T.uint32(bits * b))
    return T.reinterpret(acc, "int32")


def build_store_coop(fmt: str, dim: int, in_dtype: str, hw_fp8: bool = False, vpt: int = _VPT):
    """``vpt`` values a thread: 8 ("coop") or 16 ("coop16": 16-byte fp8 stores, fewer shuffles)."""
    tpt, lanes, wpt, value_bytes, bpt = coop_sizes(fmt, dim, vpt)
    bits = _GROUP[fmt][1]
    # vector word stores where every thread's chunk is aligned to its size (68-byte mxfp4 rows are not)
    wloop = T.vectorized if (bpt % (4 * wpt) == 0 and wpt > 1) else T.unroll
    n = T.dynamic("n")
    ns = T.dynamic("num_slots")

    @T.prim_func
    def store(
        pool8: T.Tensor((ns, bpt), "uint8"),
        pool32: T.Tensor((ns, bpt // 4), "int32"),
        x: T.Tensor((n, dim), in_dtype),
        slots: T.Tensor((n,), "int64"),
    ):
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            raw = T.alloc_local((vpt,), in_dtype)
            vals = T.alloc_local((vpt,), "float32")
            codes = T.alloc_local((vpt,), "uint32")
            words = T.alloc_local((wpt,), "int32")
            amax = T.alloc_var("float32")
            e = T.alloc_var("int32")
            inv = T.alloc_var("float64")
            sc = T.alloc_var("float32")
            sb = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            q = T.alloc_var("float32")
            s = T.alloc_var("int64")
            gid = bx * _THREADS + tx
            t = T.min(gid // tpt, n - 1)  # clamped: spare tail lanes still join the shuffles
            c = gid % tpt  # this thread's 8-value chunk of the token
            for j in T.vectorized(vpt):
                raw[j] = x[t, c * vpt + j]
            amax = T.float32(0)
            for j in T.unroll(vpt):
                vals[j] = T.Cast("float32", raw[j])
                amax = T.max(amax, T.abs(vals[j]))
            for d in (1, 2)[: lanes.bit_length() - 1]:  # lanes 1, 2 or 4: no shuffle, xor 1, xor 1 and 2
                amax = T.max(amax, T.shfl_xor(amax, d))
            if fmt == "fp8":
                e = C.pow2_exponent_f64(amax, 448.0)
                inv = C.pow2_f64(-e)
                for j in T.unroll(vpt):
                    if hw_fp8:
                        q = T.min(T.max(vals[j] * T.reinterpret((127 - e) << 23, "float32"), T.float32(-448.0)), T.float32(448.0))
                        codes[j] = T.Cast("uint32", T.reinterpret(T.Cast("float8_e4m3fn", q), "uint8"))
                    else:
                        q = T.min(T.max(T.Cast("float32", T.Cast("float64", vals[j]) * inv), T.float32(-448.0)), T.float32(448.0))
                        codes[j] = T.Cast("uint32", C.e4m3_bits(q))
                sb = e + 127
            elif fmt == "mxfp4":
                e = C.pow2_exponent_f64(amax, 6.0)
                inv = C.pow2_f64(-e)
                for j in T.unroll(vpt):
                    q = T.Cast("float32", T.Cast("float64", vals[j]) * inv)
                    codes[j] = T.Cast("uint32", C.e2m1_code(q))
                sb = e + 127
            else:
                sc = T.min(T.max(T.ieee_fdiv(amax, T.float32(6.0)), T.float32(2.0**-9)), T.float32(448.0))
                sb = C.e4m3_bits(sc)
                sv = C.e4m3_value(sb)
                if (sv < sc) & (sb < 0x7E):
                    sb = sb + 1
                sv = C.e4m3_value(sb)
                for j in T.unroll(vpt):
                    q = T.ieee_fdiv(vals[j], sv)
                    codes[j] = T.Cast("uint32", C.e2m1_code(q))
            for w in T.unroll(wpt):
                words[w] = _pack(codes, w, bits)
            s = slots[t]
            if (gid < n * tpt) & (s >= 0):
                for w in wloop(wpt):
                    pool32[s, c * wpt + w] = words[w]
                if c % lanes == 0:
                    pool8[s, value_bytes + c // lanes] = T.Cast("uint8", sb)

    return store


def build_gather_coop(fmt: str, dim: int, out_dtype: str, hw: bool = False, vpt: int = _VPT):
    tpt, lanes, wpt, value_bytes, bpt = coop_sizes(fmt, dim, vpt)
    wloop = T.vectorized if (bpt % (4 * wpt) == 0 and wpt > 1) else T.unroll
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
        with T.Kernel(T.ceildiv(n * tpt, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            words = T.alloc_local((wpt,), "int32")
            res = T.alloc_local((vpt,), out_dtype)
            code = T.alloc_var("int32")
            sv = T.alloc_var("float32")
            sc = T.alloc_var("float64")
            s = T.alloc_var("int64")
            gid = bx * _THREADS + tx
            if gid < n * tpt:
                t = gid // tpt
                c = gid % tpt
                s = slots[t]
                if s < 0:
                    for j in T.unroll(vpt):
                        res[j] = T.Cast(out_dtype, 0)
                else:
                    for w in wloop(wpt):
                        words[w] = pool32[s, c * wpt + w]
                    code = T.Cast("int32", pool8[s, value_bytes + c // lanes])
                    sc = C.pow2_f64(code - 127)
                    sv = T.if_then_else(code == 0, T.reinterpret(T.int32(0x00400000), "float32"), T.reinterpret(code << 23, "float32"))
                    for j in T.unroll(vpt):
                        if fmt == "fp8" and hw:  # see kv_store._build_gather: codes >= 247 take float64
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
                for j in T.vectorized(vpt):
                    out[t, c * vpt + j] = res[j]

    return gather
