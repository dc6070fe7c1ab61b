"""mHC (manifold-constrained hyper-connections): the residual as ``hc_mult`` streams.

The state is ``[T, n, D]``. Before each sublayer (attention, MoE) the coefficients are computed from the
token's own streams (dynamic hyper-connections): ``x = RMSNorm(state.flatten())`` (no weight), then
``raw = x @ phi^T`` split into

- ``pre``  [n]:    ``sigmoid(a_pre * raw + b_pre)``: the sublayer input is ``sum_j pre_j state_j``;
- ``post`` [n]:    ``2 sigmoid(a_post * raw + b_post)``: how much of the sublayer output each stream gets;
- ``res``  [n, n]: ``Sinkhorn(exp(a_res * raw + b_res))``: stream-to-stream mixing, made doubly
  stochastic by ``hc_sinkhorn_iters`` alternating row / column normalisations (20).

and ``state' = res @ state + post * out``. Everything is per token, so caching and chunking cannot
change it. ``hc_single_pass`` (V4.1's variant, our reading; docs/model.md) computes the coefficients of
*both* sublayers of a layer in one pass from the layer's input streams (one norm and one matmul per
layer instead of two); the default paper form recomputes them from the state entering each sublayer.
``begin`` copies the embedding into every stream; ``end`` sums the streams (the final RMSNorm follows).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.fusion import fusable, glue_on
from deepinfer_core.model.layers.norm import RMSNorm, rms_norm

__all__ = ["MHCResidual", "sinkhorn", "sinkhorn_impl", "split_bf16"]

# The fused glue's coefficient GEMM for a bfloat16 state (a switch for the tests): the bf16 state times phi
# as bf16 parts (:func:`split_bf16`, cached per layer: phi itself in a bf16 model, exact; hi + lo for a
# float32 phi), on bf16 tensor cores with float32 accumulation, the norm applied after. The reference form normalises the state into a float32 copy and
# multiplies by the float32 phi: cuBLAS has no tensor-core kernel for that (no TF32 here), and the wide
# B = 64 decode step's H200 profile shows it as a SIMT sgemm plus a split-K reduce, 18 us per layer
# ([64, 20480] x [20480, 48], reading ~14 MB); the split form reads the bf16 state and the parts (2 MB per
# part). Its error against the exact product is float32 accumulation only for a bf16 phi (bf16 products are
# exact in float32), plus <= 2**-16 of sum |x_c phi_c| for a float32 phi: the order of the float32 GEMM's
# own (tested against float64). The reference path (no glue) is unchanged.
SPLIT_GEMM = True

# the Sinkhorn used by MHCResidual in this context: None = :func:`sinkhorn`; the executor's sync-free
# decode path may set a fused kernel (the ``mhc_sinkhorn`` op, same contract) with :func:`sinkhorn_impl`
_SINKHORN: contextvars.ContextVar[Callable[[torch.Tensor, int], torch.Tensor] | None] = (
    contextvars.ContextVar("mhc_sinkhorn", default=None)
)


@contextlib.contextmanager
def sinkhorn_impl(fn: Callable[[torch.Tensor, int], torch.Tensor] | None) -> Iterator[None]:
    """MHCResidual computes its Sinkhorn with ``fn(logits, iters)`` inside this block (None: the torch loop)."""
    tok = _SINKHORN.set(fn)
    try:
        yield
    finally:
        _SINKHORN.reset(tok)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly stochastic [..., n, n] from ``exp(logits)`` by ``iters`` row-then-column normalisations.

    Each row's max is subtracted first (a per-row factor, which the first row normalisation cancels
    exactly) so ``exp`` can neither overflow nor underflow a whole row to zero: with the per-matrix max, a
    row ~88 below it in float32 became 0 / 0 (NaN), which killed a training run. Sums are floored at the
    dtype's smallest normal for the same reason (a column can still underflow). The last step normalises
    columns: columns sum to 1 exactly, rows to within the iteration's convergence (tested).
    """
    m = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    tiny = torch.finfo(m.dtype).tiny
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp_min(tiny)
        m = m / m.sum(-2, keepdim=True).clamp_min(tiny)
    return m


def split_bf16(phi: torch.Tensor) -> torch.Tensor:
    """``phi`` as [h, *phi.shape] bfloat16 parts summing to it: h = 1 (phi itself, exact) for a bfloat16
    ``phi`` (a bf16 model's), else h = 2 (hi, lo) with ``hi + lo`` = ``phi`` to 2**-16 relative.

    hi = bf16(phi) is within 2**-8 |phi| (bf16 keeps 8 significant bits, round to nearest); ``phi - hi``
    is exact in float32 and lo = bf16(phi - hi) is within 2**-8 of it, so |phi - hi - lo| <= 2**-16 |phi|
    (float32's own rounding is 2**-24; TF32, what DeepSeek's mHC kernels feed their GEMM, is 2**-11).
    """
    if phi.dtype == torch.bfloat16:
        return phi[None].contiguous()
    p = phi.to(torch.float32)
    hi = p.to(torch.bfloat16)
    return torch.stack((hi, (p - hi.to(torch.float32)).to(torch.bfloat16)))


def _raw(
    state: torch.Tensor, phi: torch.Tensor | None, split: torch.Tensor | None, cd: torch.dtype, eps: float
) -> torch.Tensor:
    """``RMSNorm(state.flatten()) @ phi^T`` per sublayer, [T, S, k] in ``cd``: from ``phi`` [S, k, C] (the
    reference form: normalise, then a ``cd`` product), or, for a bfloat16 ``state``, from ``split`` =
    :func:`split_bf16` (phi) [h, S, k, C] (the decode graph's form, see :data:`SPLIT_GEMM`)."""
    t = state.shape[0]
    if split is None:
        x = state.reshape(t, -1).to(cd)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return torch.einsum("tc,skc->tsk", x, phi.to(cd))  # type: ignore[union-attr]
    # the norm is one factor per token, so it is applied after the product: the product's left operand is
    # the bf16 state itself (no float32 copy of it is written), products of bf16 values are exact in float32
    # and accumulate in float32; one GEMM of N = h S k (the parts side by side; S k = 48 for n = 4, S = 2)
    h, sub, k, c = split.shape
    s = state.reshape(t, c)
    w = split.reshape(h * sub * k, c)
    if s.is_cuda:
        # cuBLAS bf16 tensor cores, float32 accumulate and out
        y = torch.mm(s, w.t(), out_dtype=torch.float32)
    else:  # the same products (exact in float32) through a float32 GEMM: how the CPU tests run this form
        y = s.to(torch.float32) @ w.to(torch.float32).t()
    y = y.view(t, h, sub, k)
    r = torch.rsqrt(s.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    return (y[:, 0] if h == 1 else y[:, 0] + y[:, 1]) * r[:, :, None]


def _logits(
    state: torch.Tensor,
    phi: torch.Tensor | None,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    eps: float,
    split: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, S, n], post [T, S, n]) in the state's dtype and the Sinkhorn logits [T, S, n, n] in the
    coefficient dtype, for the S sublayers whose ``phi`` [S, k, n * D], ``alpha`` [S, 3], ``bias`` [S, k]
    are given (``split``: phi as :func:`split_bf16`, used instead of ``phi`` for a bfloat16 state)."""
    # coefficients in >= float32 (a bf16 Sinkhorn drifts); the stream update stays in the model dtype
    cd = torch.float64 if state.dtype == torch.float64 else torch.float32
    a, b = alpha.to(cd), bias.to(cd)
    raw = _raw(state, phi, split, cd, eps)  # [T, S, k]
    pre = torch.sigmoid(a[None, :, 0:1] * raw[..., :n] + b[None, :, :n])
    post = 2 * torch.sigmoid(a[None, :, 1:2] * raw[..., n : 2 * n] + b[None, :, n : 2 * n])
    logits = (a[None, :, 2:3] * raw[..., 2 * n :] + b[None, :, 2 * n :]).view(*raw.shape[:2], n, n)
    dt = state.dtype
    return pre.to(dt), post.to(dt), logits


_mhc_logits = fusable(_logits)  # fused glue around a Sinkhorn kernel


@fusable
def _mhc_coefficients(
    state: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    iters: int,
    eps: float,
    sk: Callable[[torch.Tensor, int], torch.Tensor] | None,
    split: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_logits` then the Sinkhorn (``sk``, None: :func:`sinkhorn`): (pre, post, res [T, S, n, n]),
    all in the state's dtype."""
    pre, post, logits = _logits(state, phi, alpha, bias, n, eps, split)
    # one Sinkhorn over every sublayer at once: the loop is op-count bound on small n
    return pre, post, (sk or sinkhorn)(logits, iters).to(state.dtype)


# Traced for the fused glue (torch.compile), the two stream mixes are written as broadcast products summed
# over the n streams, which Inductor fuses into one kernel with the update around them; as einsums they
# lower to batched GEMMs with K = n = 4, which cuBLAS serves with small-tile kernels (the wide decode
# step's H200 profile has 12 calls a step of a 16x16 WMMA kernel at ~19 us each and a 12-a-step gemv,
# which match these two products' count and shapes; one read of the streams is ~2 us). Eagerly the einsum
# is the faster form (no [T, n, n, D] temporary), and it is the oracle the compiled form is tested against.


@fusable
def _mix_in(pre: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j state_j: [T, n] x [T, n, D] -> [T, D]."""
    if torch.compiler.is_compiling():
        return (pre[:, :, None] * state).sum(1)
    return torch.einsum("tn,tnd->td", pre, state)


@fusable
def _mix_out(res: torch.Tensor, state: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """res @ state + post * out: the streams after a sublayer, [T, n, D] (``res`` cast to the state's dtype)."""
    r = res.to(state.dtype)
    if torch.compiler.is_compiling():
        return (r[:, :, :, None] * state[:, None, :, :]).sum(2) + post[:, :, None] * out[:, None, :]
    return torch.einsum("tij,tjd->tid", r, state) + post[:, :, None] * out[:, None, :]


# The residual's hand-over between sublayers as one compiled function each (one or two kernels under the
# glue, where the separate functions were a mix, a norm and, after a sublayer, the update before them):
# the sublayer input normalised, and a sublayer's update followed by the next sublayer's normalised input
# (single pass: its coefficients were computed with the layer's first). Eagerly the same calls in order.


@fusable
def _mix_in_norm(pre: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(sum_j pre_j state_j, weight): the normalised input of a sublayer, [T, D]."""
    return rms_norm(_mix_in(pre, state), weight, eps)


@fusable
def _mix_out_in_norm(
    res: torch.Tensor,
    state: torch.Tensor,
    post: torch.Tensor,
    out: torch.Tensor,
    pre: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`_mix_out`, the next sublayer's :func:`_mix_in_norm` of it)."""
    new = _mix_out(res, state, post, out)
    return new, rms_norm(_mix_in(pre, new), weight, eps)


class MHCResidual(nn.Module):
    """Drop-in for ``PlainResidual`` (the ``model.Residual`` protocol)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n, d, layers = cfg.hc_mult, cfg.hidden_size, cfg.num_hidden_layers
        self.n, self.iters, self.single_pass = n, cfg.hc_sinkhorn_iters, cfg.hc_single_pass
        self.eps = cfg.rms_norm_eps
        k = 2 * n + n * n
        # [layer, sublayer (0 attention, 1 MoE), coefficient, n * D]
        self.phi = nn.Parameter(torch.empty(layers, 2, k, n * d))
        self.alpha = nn.Parameter(torch.empty(layers, 2, 3))  # scales of pre / post / res
        self.bias = nn.Parameter(torch.empty(layers, 2, k))
        # coefficients computed by sublayer_input, consumed by the matching sublayer_output
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # split_bf16 of phi[layer, subs] for the glue's GEMM, keyed by (layer, first, last sublayer), valid
        # while phi's storage and version are those recorded (a load or a move makes a new split)
        self._splits: dict[tuple[int, int, int], tuple[tuple[int, int], torch.Tensor]] = {}

    def _split(self, state: torch.Tensor, layer: int, idx: slice) -> torch.Tensor | None:
        """:func:`split_bf16` of ``phi[layer, idx]`` where the glue's split GEMM applies (a bfloat16 state
        under the fused glue, inference, :data:`SPLIT_GEMM`), else None (the float32 product)."""
        if not (SPLIT_GEMM and state.dtype == torch.bfloat16 and glue_on() and not torch.is_grad_enabled()):
            return None
        key = (layer, idx.start, idx.stop)
        stamp = (self.phi.data_ptr(), self.phi._version)
        got = self._splits.get(key)
        if got is not None and got[0] == stamp:
            return got[1]
        split = split_bf16(self.phi[layer, idx].detach())
        # made on the eager warm-up step before a CUDA graph capture; a split made inside a capture is
        # recomputed by each replay (correct, slower) and not kept, its memory being the graph's
        if not (state.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._splits[key] = (stamp, split)
        return split

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        dev = gen.device
        self.phi.copy_(torch.randn(self.phi.shape, generator=gen, device=dev) / math.sqrt(self.phi.shape[-1]))
        self.alpha.copy_(0.5 + 0.5 * torch.rand(self.alpha.shape, generator=gen, device=dev))
        # random biases make the mixing far from uniform, so tests see streams that really differ
        self.bias.copy_(torch.randn(self.bias.shape, generator=gen, device=dev))

    def _coefficients(self, state: torch.Tensor, layer: int, subs: tuple[int, ...]) -> None:
        # subs are consecutive ((0, 1) or (s,)): a slice, not a list index (which would copy the index to
        # the device and synchronise, and cannot be captured in a CUDA graph)
        idx = slice(subs[0], subs[-1] + 1)
        phi, alpha, bias = self.phi[layer, idx], self.alpha[layer, idx], self.bias[layer, idx]
        split = self._split(state, layer, idx)
        sk = _SINKHORN.get()
        if sk is not None and glue_on():
            # fused glue with a Sinkhorn kernel: compiled maths around it (Inductor would split the 20
            # iterations into 40 kernels; the kernel keeps the matrix in registers); res stays in the
            # coefficient dtype and is cast inside the compiled stream mix
            pre, post, logits = _mhc_logits(state, phi, alpha, bias, self.n, self.eps, split)
            res = sk(logits, self.iters)
        else:
            pre, post, res = _mhc_coefficients(
                state, phi, alpha, bias, self.n, self.iters, self.eps, sk, split
            )
        for i, sub in enumerate(subs):
            self._pending[(layer, sub)] = (pre[:, i], post[:, i], res[:, i])

    def coefficients(
        self, state: torch.Tensor, layer: int, sub: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, n], post [T, n], res [T, n, n]) of one sublayer for streams ``state`` (tests, docs)."""
        self._coefficients(state, layer, (sub,))
        return self._pending.pop((layer, sub))

    # ---------------------------------------------------------------- the residual protocol
    def begin(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, None, :].expand(-1, self.n, -1).contiguous()

    def _pre(self, state: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor:
        """The ``pre`` coefficients of a sublayer (computed now unless pending)."""
        if (layer_id, sub) not in self._pending:
            subs = (0, 1) if self.single_pass and sub == 0 else (sub,)
            self._coefficients(state, layer_id, subs)
        return self._pending[(layer_id, sub)][0]

    def sublayer_input(self, state: torch.Tensor, layer_id: int, sub: int) -> torch.Tensor:
        return _mix_in(self._pre(state, layer_id, sub), state)

    def sublayer_output(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int
    ) -> torch.Tensor:
        _, post, res = self._pending.pop((layer_id, sub))
        return _mix_out(res, state, post, out)

    def sublayer_input_normed(
        self, state: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> torch.Tensor:
        """``norm(sublayer_input(...))``, one compiled function under the fused glue."""
        return _mix_in_norm(self._pre(state, layer_id, sub), state, norm.weight, norm.eps)

    def handover(
        self, state: torch.Tensor, out: torch.Tensor, layer_id: int, sub: int, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``sublayer_output`` of ``sub``, ``sublayer_input_normed`` of ``sub + 1`` of the new state):
        one compiled function when the next sublayer's coefficients are already known (single pass)."""
        nxt = (layer_id, sub + 1)
        if nxt not in self._pending:  # the paper form: the next coefficients come from the new state
            new = self.sublayer_output(state, out, layer_id, sub)
            return new, self.sublayer_input_normed(new, layer_id, sub + 1, norm)
        _, post, res = self._pending.pop((layer_id, sub))
        return _mix_out_in_norm(res, state, post, out, self._pending[nxt][0], norm.weight, norm.eps)

    def collapse(self, state: torch.Tensor) -> torch.Tensor:
        """Streams summed, [T, D] (what ``end`` returns; also the captured per-layer state)."""
        return state.sum(1)

    def end(self, state: torch.Tensor) -> torch.Tensor:
        self._pending.clear()  # a stopped loop (encoder-only prefill) may leave coefficients behind
        return self.collapse(state)
