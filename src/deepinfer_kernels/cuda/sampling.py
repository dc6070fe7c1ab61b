"""TileLang ``sample``: the counter-based RNG, Gumbel noise, survivor filter and argmax in one pass per row.

The survivor set of the reference (top-k then top-p over the stable descending sort, at least one token,
finite logits only) is a prefix of that sort, so it is described by its last member: a threshold value
``tv`` and id ``ti``; token ``i`` survives iff ``x_i > tv`` or (``x_i == tv`` and ``i <= ti``). That
threshold comes from the reference's own sort-free finder (``ops/sampling_filter.survivor_threshold``:
fixed-shape torch passes, no host synchronisation, so the whole op can be captured in a CUDA graph). The kernel
then makes one pass over the unsorted logits: ``x_i / T + gumbel(seed, position, i)`` for survivors, and
an argmax whose key packs the score (order-preserving bits) above ``~i``, so ties go to the lowest id.

Batch invariance: one CTA owns one row and reduces it in a fixed order; nothing depends on the other rows,
the batch size or the launch. The RNG is the reference's splitmix64 in unsigned 64-bit arithmetic (bit
identical), and ``logf`` / IEEE division match torch's CUDA kernels, so the token equals the reference
run on the same GPU. Against the CPU reference a last-bit difference of ``log`` could flip a near-tie
(scores within one ulp); tested on the GPU reference, where it is exact.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, KERNEL_DTYPES, T, compile_kernel, torch_dtype_name
from deepinfer_kernels.ops.sampling import _check, row_keys
from deepinfer_kernels.ops.sampling import sample as _reference
from deepinfer_kernels.ops.sampling_filter import survivor_threshold
from deepinfer_kernels.registry import register

__all__ = ["sample", "survivor_threshold"]

_THREADS = 512
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_POS_MUL = 0xD1B54A32D192ED03


def _mix64(x):
    x = x + T.uint64(_GOLDEN)
    x = (x ^ (x >> T.uint64(30))) * T.uint64(_M1)
    x = (x ^ (x >> T.uint64(27))) * T.uint64(_M2)
    return x ^ (x >> T.uint64(31))


def _argmax_key(score, v):
    """int64 key ordered like (score, -v): the score's order-preserving bits above the inverted token id."""
    bits = T.Cast("uint64", T.reinterpret(score, "uint32"))
    ordered = T.if_then_else(
        (bits & T.uint64(0x80000000)) != T.uint64(0), bits ^ T.uint64(0xFFFFFFFF), bits | T.uint64(0x80000000)
    )
    k = (ordered << T.uint64(32)) | (T.uint64(0xFFFFFFFF) - T.Cast("uint64", v))
    return T.reinterpret(k ^ T.uint64(1 << 63), "int64")


def _build(vocab: int, dtype: str):
    b = T.dynamic("b")
    per_thread = (vocab + _THREADS - 1) // _THREADS

    @T.prim_func
    def sample(
        logits: T.Tensor((b, vocab), dtype),
        temperature: T.Tensor((b,), "float32"),
        key: T.Tensor((b,), "int64"),  # mix64(seed) ^ position * POS_MUL, from the host formula
        thr_val: T.Tensor((b,), "float32"),
        thr_idx: T.Tensor((b,), "int32"),
        mode: T.Tensor((b,), "int32"),  # 0 greedy, 1 sample, 2 no finite logit (-1)
        out: T.Tensor((b,), "int64"),
    ):
        with T.Kernel(b, threads=_THREADS) as bx:
            keys = T.alloc_fragment((_THREADS,), "int64")
            best = T.alloc_fragment((1,), "int64")
            for tx in T.Parallel(_THREADS):
                keys[tx] = T.int64(-(2**63))
                for i in T.serial(per_thread):
                    v = i * _THREADS + tx
                    if v < vocab:
                        x = T.Cast("float32", logits[bx, v])
                        if mode[bx] == 0:
                            keys[tx] = T.max(keys[tx], _argmax_key(x, v))
                        else:
                            xs = T.ieee_fdiv(x, temperature[bx])
                            # Only survivors pay for the RNG (with top-k / top-p that is a few tokens a row).
                            if (xs > thr_val[bx]) | ((xs == thr_val[bx]) & (v <= thr_idx[bx])):
                                h = _mix64(T.reinterpret(key[bx], "uint64") ^ _mix64(T.Cast("uint64", v)))
                                u = (
                                    T.Cast("float32", T.Cast("int32", h >> T.uint64(40))) + T.float32(0.5)
                                ) * T.float32(2.0**-24)
                                g = -T.log(-T.log(u))
                                keys[tx] = T.max(keys[tx], _argmax_key(xs + g, v))
            T.reduce_max(keys, best, dim=0)
            for _ in T.Parallel(1):
                idx = T.Cast(
                    "int64", T.uint64(0xFFFFFFFF) - (T.reinterpret(best[0], "uint64") & T.uint64(0xFFFFFFFF))
                )
                out[bx] = T.if_then_else(mode[bx] == 2, T.int64(-1), idx)

    return sample


@register("sample", "cuda")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Same contract and tokens as the reference ``sample``; CUDA tensors."""
    if not HAVE_TILELANG or logits.device.type != "cuda" or logits.dtype not in KERNEL_DTYPES:
        return _reference(logits, temperature, top_k, top_p, seeds, positions)
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    b, vocab = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if vocab == 0:
        return out.fill_(-1)
    dev = logits.device
    t, thr_val, thr_idx, mode = survivor_threshold(logits, temperature.to(dev), top_k.to(dev), top_p.to(dev))
    keys = row_keys(seeds.to(dev), positions.to(dev))
    dt = torch_dtype_name(logits.dtype)
    kern = compile_kernel(("sample", vocab, dt), lambda: _build(vocab, dt))
    kern(logits.contiguous(), t.contiguous(), keys.contiguous(), thr_val.contiguous(), thr_idx, mode, out)
    return out
