"""TileLang ``spec_verify`` in counter mode: the speculative acceptance step, batch-invariant by construction.

One CTA per request, nothing shared between requests, fixed reduction order, so a request's outcome does
not depend on the batch. The randomness is the reference's counter mode (``ops/spec_verify.py``):

- acceptance of draft k: ``u * q(x) < p(x)`` in float64 (exact: a 24-bit uniform times a float32), with
  ``u`` from the stream (seed ^ ACCEPT_SALT, position + k), the same splitmix64 bits as the host;
  greedy rows instead compare the draft with the target's argmax at k (a block reduction per position);
- the correction / bonus token: one pass over the vocabulary at position ``num_accepted`` racing
  ``log(w) + gumbel`` for both weights at once (residual ``max(0, p - q)`` and ``p``), argmax keys packing
  the order-preserving score bits above the inverted token id (ties to the lowest id, like torch.argmax);
  the residual wins unless it is all zero (its best score is then -inf).

Block reductions: ``warp_reduce_max`` then one int64 per warp in shared memory, read back by every
thread, so the per-request scalars (accepted count, stop flag) are computed redundantly and uniformly by
all threads and every branch around a barrier is uniform across the CTA. The generator mode of the
reference has no kernel (a torch.Generator's stream cannot be reproduced): it runs the reference.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations of the prim_funcs.
import torch

from deepinfer_kernels.cuda._tl import HAVE_TILELANG, T, compile_kernel
from deepinfer_kernels.cuda.sampling import _argmax_key, _mix64
from deepinfer_kernels.ops import spec_verify as ref
from deepinfer_kernels.ops.sampling import mix64
from deepinfer_kernels.registry import register

_THREADS = 512
_WARPS = _THREADS // 32
_POS_MUL = 0xD1B54A32D192ED03
_INIT = -(2**63)


def _uniform(key, j):
    """float32 uniform of stream ``key`` (uint64) at index ``j``: the reference's counter_uniform bits."""
    h = _mix64(key ^ _mix64(T.Cast("uint64", j)))
    return (T.Cast("float32", T.Cast("int32", h >> T.uint64(40))) + T.float32(0.5)) * T.float32(2.0**-24)


def _key_id(key):
    return T.Cast("int64", T.uint64(0xFFFFFFFF) - (T.reinterpret(key, "uint64") & T.uint64(0xFFFFFFFF)))


def _build(D: int, V: int):
    r = T.dynamic("r")
    dq = T.dynamic("dq")
    per = (V + _THREADS - 1) // _THREADS
    dt = max(D, 1)

    @T.prim_func
    def verify(
        tok: T.Tensor((r, dt), "int64"),  # draft tokens clamped to [0, V)
        p: T.Tensor((r, D + 1, V), "float32"),
        q: T.Tensor((r, dq, V), "float32"),  # draft probs ([r, D, V]); any [r, *, V] when every row is greedy
        lengths: T.Tensor((r,), "int32"),
        greedy: T.Tensor((r,), "int32"),
        acc_key: T.Tensor((r,), "int64"),  # mix64(seed ^ ACCEPT_SALT)
        res_key: T.Tensor((r,), "int64"),  # mix64(seed ^ RESAMPLE_SALT)
        pos: T.Tensor((r,), "int64"),
        out_acc: T.Tensor((r,), "int64"),
        out_next: T.Tensor((r,), "int64"),
    ):
        with T.Kernel(r, threads=_THREADS) as bx:
            tx = T.get_thread_binding(0)
            red = T.alloc_shared((3, _WARPS), "int64")
            key = T.alloc_var("int64")
            key2 = T.alloc_var("int64")
            best = T.alloc_var("int64")
            best2 = T.alloc_var("int64")
            nacc = T.alloc_var("int32")
            go = T.alloc_var("int32")
            pv = T.alloc_var("float32")
            g = T.alloc_var("float32")
            u = T.alloc_var("float32")
            sc = T.alloc_var("float32")
            ln = lengths[bx]
            gr = greedy[bx]
            nacc = 0
            go = 1
            for k in T.serial(D):
                if gr != 0:  # uniform over the CTA: every thread takes the barriers or none
                    key = T.int64(_INIT)
                    if (k < ln) & (go != 0):
                        for i in T.serial(per):
                            v = i * _THREADS + tx
                            if v < V:
                                key = T.max(key, _argmax_key(p[bx, k, v], v))
                    key = T.warp_reduce_max(key)
                    if tx % 32 == 0:
                        red[0, tx // 32] = key
                    T.sync_threads()
                    best = red[0, 0]
                    for w in T.unroll(1, _WARPS):
                        best = T.max(best, red[0, w])
                    T.sync_threads()
                    if (k < ln) & (go != 0) & (tok[bx, k] == _key_id(best)):
                        nacc = nacc + 1
                    else:
                        go = 0
                else:
                    u = _uniform(
                        T.reinterpret(acc_key[bx], "uint64")
                        ^ (T.reinterpret(pos[bx] + k, "uint64") * T.uint64(_POS_MUL)),
                        0,
                    )
                    if (
                        (k < ln)
                        & (go != 0)
                        & (
                            T.Cast("float64", u) * T.Cast("float64", q[bx, k, tok[bx, k]])
                            < T.Cast("float64", p[bx, k, tok[bx, k]])
                        )
                    ):
                        nacc = nacc + 1
                    else:
                        go = 0
            # correction / bonus at position nacc
            rkey = T.reinterpret(res_key[bx], "uint64") ^ (
                T.reinterpret(pos[bx] + T.Cast("int64", nacc), "uint64") * T.uint64(_POS_MUL)
            )
            rej = nacc < ln
            key = T.int64(_INIT)
            key2 = T.int64(_INIT)
            for i in T.serial(per):
                v = i * _THREADS + tx
                if v < V:
                    pv = p[bx, nacc, v]
                    if gr != 0:
                        key = T.max(key, _argmax_key(pv, v))
                    else:
                        g = -T.log(-T.log(_uniform(rkey, v)))
                        sc = T.log(pv) + g
                        key = T.max(key, _argmax_key(sc, v))
                        if rej:
                            sc = T.log(T.max(pv - q[bx, nacc, v], T.float32(0.0))) + g
                            key2 = T.max(key2, _argmax_key(sc, v))
            key = T.warp_reduce_max(key)
            key2 = T.warp_reduce_max(key2)
            if tx % 32 == 0:
                red[1, tx // 32] = key
                red[2, tx // 32] = key2
            T.sync_threads()
            best = red[1, 0]
            best2 = red[2, 0]
            for w in T.unroll(1, _WARPS):
                best = T.max(best, red[1, w])
                best2 = T.max(best2, red[2, w])
            if tx == 0:
                out_acc[bx] = T.Cast("int64", nacc)
                # a residual that is zero everywhere has best score -inf: then draw from p (reference rule)
                use_res = rej & (gr == 0) & (best2 > _argmax_key(T.float32(float("-inf")), 0))
                out_next[bx] = _key_id(T.if_then_else(use_res, best2, best))

    return verify


@register("spec_verify", "cuda")
def spec_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    verify_lengths: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool | torch.Tensor = False,
    *,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference; counter mode (``seeds`` / ``positions``) on CUDA runs the kernel,
    generator mode (and CPU tensors) the reference."""
    if seeds is None or positions is None or not HAVE_TILELANG or target_probs.device.type != "cuda":
        return ref.spec_verify(
            draft_tokens,
            draft_probs,
            target_probs,
            verify_lengths,
            generator,
            greedy,
            seeds=seeds,
            positions=positions,
        )
    R, D, V = ref._check(draft_tokens, draft_probs, target_probs, verify_lengths)
    ref._check_counter(seeds, positions, R, generator)
    dev = target_probs.device
    g = torch.as_tensor(greedy, dtype=torch.bool, device=dev).expand(R)
    if draft_probs is None and R and not bool(g.all()):
        raise ValueError("draft_probs: required unless every row is greedy (temperature 0)")
    acc = torch.zeros(R, dtype=torch.int64, device=dev)
    nxt = torch.zeros(R, dtype=torch.int64, device=dev)
    if R == 0:
        return acc, nxt
    p = target_probs.float().contiguous()
    # no drafts (D = 0) or every row greedy: q is never read; pass p rather than an empty / missing tensor
    q = p if (draft_probs is None or D == 0) else draft_probs.to(dev, torch.float32).contiguous()
    tok = draft_tokens.to(dev, torch.int64).clamp(0, V - 1)
    if D == 0:
        tok = torch.zeros(R, 1, dtype=torch.int64, device=dev)
    s = seeds.to(dev, torch.int64)
    kern = compile_kernel(("spec_verify", D, V), lambda: _build(D, V))
    kern(
        tok.contiguous(),
        p,
        q,
        verify_lengths.to(dev, torch.int32).contiguous(),
        g.to(torch.int32).contiguous(),
        mix64(s ^ ref.ACCEPT_SALT),
        mix64(s ^ ref.RESAMPLE_SALT),
        positions.to(dev, torch.int64).contiguous(),
        acc,
        nxt,
    )
    return acc, nxt
