"""Batch-invariant products: every weight GEMM of a step in fixed-shape row chunks.

A matrix product's library kernel (MKL / oneDNN on the CPU, cuBLAS on a GPU) is chosen by its shape, and
with it the order in which each output's K-sum is accumulated: the same row multiplied alone (M = 1, a
GEMV), with 7 others or with 63 others can come out different in the last bit (measured on this repo's
CPU: float32 rows differ between M = 1, 2, 3, ..., 16; bf16 rows between M = 16 and M = 80 at K = 1,024).
A last-bit difference can flip a near-tie of the sampler, so a request's tokens would depend on its batch.

Inside :func:`row_chunked` every product of a stack of rows with one matrix (``x @ W``, ``mm``,
``linear``, a row-led ``einsum`` whose other operands lack the row index) runs as calls of exactly ``rows`` rows: the rows are
padded with zeros up to a multiple of ``rows`` and each chunk is its own call. Every call then has the same
shape whatever the batch, so the same kernel with the same reduction order computes every row, and a
row's result does not depend on its position inside the chunk either (checked by
``scripts/probe_batch_invariance.py`` and tests/deepinfer_core/model/test_invariant.py). This is the
batched form of DeepInfer's batch-invariant mode (SGLang and Thinking Machines fix the kernel instead:
split-K off, one tile shape); norms, softmaxes and batched per-row products (the attention's) are
row-wise already (probed bitwise on the CPU; a GPU test checks the cuda backend).

The mode is a ``TorchFunctionMode``, so the model code keeps its plain ``@`` and the products of every
path (the row path, prefill, the MoE's grouped loop over an expert's rows, the drafter) are covered without
touching them; on a GPU the chunk calls have fixed shapes (graph-capturable, no host synchronisation).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# the default chunk: 64 rows on a GPU (decode GEMMs up to 64 rows stream the weights once: a padded chunk
# costs what the real rows do), 32 on the CPU (the reference model's products are compute-bound there)
DEFAULT_ROWS = {"cuda": 64, "cpu": 32}
# prefill steps (the per-request path; a request takes the same path alone and in any batch, see
# engine/run.py StepRunner._parts): their row counts are prompt chunks, so their products use chunks this
# many times the decode chunk (a chunk is fixed per path: invariant all the same)
PREFILL_FACTOR = 4
# the MoE loop's expert products (an expert gets a few of the step's rows) use a quarter of the chunk
EXPERT_DIVISOR = 4
# the chunk rows of the innermost active row_chunked (0: none)
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("row_chunked", default=0)


# the chunk divisor of one call site (smaller_chunks), 0: the mode's own chunk
_SITE: contextvars.ContextVar[int] = contextvars.ContextVar("row_chunked_site", default=0)


@contextlib.contextmanager
def smaller_chunks(divisor: int) -> Iterator[None]:
    """Inside :func:`row_chunked`, the products here run in chunks of ``max(the mode's // divisor, 1)``
    rows: for a site whose calls get a few of the step's rows each (the MoE's loop over an expert's rows,
    each call padded to a whole chunk). Any fixed chunk is invariant; this one is fixed per site and
    path. Outside the mode nothing changes."""
    token = _SITE.set(max(int(divisor), 0))
    try:
        yield
    finally:
        _SITE.reset(token)


def active() -> int:
    """The chunk rows of the :func:`row_chunked` the caller runs in (0: none): for the few call sites
    that must pick an invariant form themselves (a product written through ``out=``)."""
    return _ACTIVE.get()


def default_rows(device: torch.device) -> int:
    """The chunk rows :func:`row_chunked` uses on ``device`` by default."""
    return DEFAULT_ROWS.get(device.type, 64)


def _pad_rows(t: torch.Tensor, total: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``total`` rows, contiguous (so every chunk call sees the same
    layout, padded or not)."""
    n = t.shape[0]
    if n == total:
        return t.contiguous()
    return torch.cat((t, t.new_zeros((total - n, *t.shape[1:]))))


def _chunked(
    rows: int, fn: Callable[..., torch.Tensor], args: list[Any], which: Sequence[int], kwargs: dict
) -> torch.Tensor:
    """``fn(*args, **kwargs)`` computed ``rows`` rows at a time over dim 0 of the args at ``which``."""
    n = args[which[0]].shape[0]
    total = -(-n // rows) * rows
    if total == rows == n:  # one whole chunk: the call itself (on contiguous rows)
        part = list(args)
        for i in which:
            part[i] = args[i].contiguous()
        return fn(*part, **kwargs)
    padded = {i: _pad_rows(args[i], total) for i in which}
    outs = []
    for lo in range(0, total, rows):
        part = list(args)
        for i, t in padded.items():
            part[i] = t[lo : lo + rows]
        outs.append(fn(*part, **kwargs))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if total == n else out[:n]


def _is_t(x: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(x, torch.Tensor)


def _matmul(rows: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    if not (_is_t(a) and _is_t(b)) or a.dim() < 2 or a.shape[0] == 0 or kwargs.get("out") is not None:
        return NotImplemented
    if b.dim() == 2:  # rows (or [rows, ..., K]) times a weight
        return _chunked(rows, fn, list(args), (0,), kwargs)
    # a batched product (a GEMM per batch item, e.g. per row: the attention's scores): each item's shape is
    # its own, whatever the batch count (probed on the CPU; a GPU's decode graphs fix the count anyway),
    # and padding a few items (the prefill's per-request attention tiles) to a whole chunk costs ~C x
    return NotImplemented


def _linear(rows: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else kwargs.get("input")
    if not _is_t(x) or x.dim() < 2 or x.shape[0] == 0 or not args:
        return NotImplemented
    return _chunked(rows, fn, list(args), (0,), kwargs)


def _einsum(rows: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """A row-led equation whose other operands lack the row index (the first operand's first index leads
    the output, e.g. the mHC's ``tc,skc->tsk``, the output projection's ``ngk,grk->ngr``): the first
    operand is chunked over it, the others (weights) kept whole."""
    if kwargs or len(args) < 2 or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return NotImplemented
    ops = list(args[1:])
    lhs, out = args[0].replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(ops) or not all(_is_t(t) for t in ops) or not terms[0] or not out:
        return NotImplemented
    r = terms[0][0]
    if out[0] != r or ops[0].shape[0] == 0:
        return NotImplemented
    which = [i for i, t in enumerate(terms) if t.startswith(r)]
    if len(which) > 1 or any(r in t for t in terms[1:]):
        return NotImplemented  # a batched product per row (see _matmul), or not a per-row product

    def run(*o: torch.Tensor) -> torch.Tensor:
        return fn(args[0], *o)

    return _chunked(rows, run, ops, which, {})


# CPU: torch's vectorised elementwise loop computes the last (numel % vector width) elements of a call with
# the scalar form of the function, whose last bit can differ from the SIMD form for transcendental
# functions (measured: sigmoid on the mHC coefficients; a lone row of 24 values has a tail, 64 rows do
# not). Padding each call's flat input to a multiple of _VEC_PAD sends every element through the SIMD
# form whatever the batch. (Exact arithmetic (+, *, /, sqrt) is the same in both forms; a GPU kernel runs
# one form for every element.)
_VEC_PAD = 64


def _elementwise(rows: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else None
    if (
        not _is_t(x)
        or x.device.type != "cpu"
        or not x.is_floating_point()
        or x.numel() == 0
        or kwargs.get("out") is not None
        or any(_is_t(a) and a.dim() > 0 for a in args[1:])
    ):
        return NotImplemented
    n = x.numel()
    pad = (-n) % _VEC_PAD
    if not pad and x.is_contiguous():
        return NotImplemented  # whole vectors already: the plain call
    flat = x.reshape(-1)
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    y = fn(flat.contiguous(), *args[1:], **kwargs)
    return (y[:n] if pad else y).view(x.shape)


_TRANSCENDENTAL = (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid", "tanh", "sin", "cos", "erf", "rsqrt",
)  # fmt: skip
_ELEMENTWISE: list[Any] = [getattr(torch, n) for n in _TRANSCENDENTAL]
_ELEMENTWISE += [getattr(torch.Tensor, n) for n in _TRANSCENDENTAL]
_ELEMENTWISE += [F.silu, F.softplus, F.gelu, torch.special.expit]

_HANDLERS: dict[Any, Callable[[int, Callable, tuple, dict], Any]] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.mm: _matmul,
    torch.Tensor.mm: _matmul,
    F.linear: _linear,
    torch.einsum: _einsum,
}


class RowChunkedProducts(TorchFunctionMode):
    """The torch-function mode of :func:`row_chunked` (the handlers above; everything else passes)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.calls = 0  # products chunked (a test's evidence that the mode ran)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        h = _HANDLERS.get(func)
        kwargs = kwargs or {}
        if h is not None:
            site = _SITE.get()
            out = h(max(self.rows // site, 1) if site else self.rows, func, args, kwargs)
            if out is not NotImplemented:
                self.calls += 1
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def row_chunked(rows: int) -> Iterator[RowChunkedProducts | None]:
    """Every row product inside runs in fixed chunks of ``rows`` rows (0: off, nothing changes)."""
    if rows <= 0:
        yield None
        return
    mode = RowChunkedProducts(rows)
    token = _ACTIVE.set(rows)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.reset(token)
