"""Fused glue for the cuda decode path: the model's small per-token functions compiled into few kernels.

A decode step of the wide config is ~2,000 kernel launches, most of them 1-3 us elementwise ops and
reductions (the 20 Sinkhorn iterations of mHC, norms, RoPE, masks, the routing maths); replayed from a
CUDA graph the launch cost is gone but each still occupies the GPU for its minimum time. The functions
marked :func:`fusable` are pure tensor functions (no module state, no host reads); inside
:func:`fused_glue` they run compiled by ``torch.compile`` (TorchInductor, Triton kernels on CUDA), which
fuses each into one or a few kernels (reductions over <= 8 elements, such as the mHC stream dims, become
elementwise code and fuse too). Outside the block, or nested inside another compiled function, the plain
torch code runs: the reference path is untouched, and that plain code is the oracle of the tests.

Compilation happens on a function's first call for new shapes (every shape its own static variant:
batch buckets and widths are few), so in the executor it happens in the eager warm-up run that
precedes each CUDA graph capture, never inside a capture. ``DEEPINFER_FUSE_BACKEND`` picks the
``torch.compile`` backend (default ``inductor``; ``aot_eager`` traces without generating code, which is
how the CPU tests check that every marked function compiles whole: ``fullgraph=True``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from deepinfer_core.envs import fuse_backend

__all__ = ["compiled_count", "fusable", "fused_glue", "glue_on", "reset", "set_backend"]

log = logging.getLogger(__name__)

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("fused_glue", default=False)
F = TypeVar("F", bound=Callable[..., Any])
_COMPILED: dict[str, Callable[..., Any]] = {}
# the torch.compile backend (a name or a callable backend); None: $DEEPINFER_FUSE_BACKEND or "inductor"
_BACKEND: list[str | Callable[..., Any] | None] = [None]


def set_backend(backend: str | Callable[..., Any] | None) -> None:
    """Compile with this ``torch.compile`` backend from now on (None: the environment's / inductor);
    forgets what was compiled."""
    _BACKEND[0] = backend
    reset()


def reset() -> None:
    """Forget every compiled function (the next call in :func:`fused_glue` compiles again)."""
    _COMPILED.clear()


@contextlib.contextmanager
def fused_glue(on: bool = True) -> Iterator[None]:
    """Functions marked :func:`fusable` run compiled inside this block (``on`` False: plain torch)."""
    tok = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(tok)


def glue_on() -> bool:
    """Whether :func:`fusable` functions run compiled here (False while being traced by a compiler)."""
    return not torch.compiler.is_compiling() and _ON.get()


def compiled_count() -> int:
    """How many marked functions have been compiled in this process (the benchmark reports it)."""
    return len(_COMPILED)


def fusable(fn: F) -> F:
    """Mark a pure tensor function: compiled (``fullgraph=True``) when called inside :func:`fused_glue`.

    The function must not read tensors back to the host, mutate its inputs or depend on Python state
    other than its arguments; non-tensor arguments (ints, floats, flags) become compile-time constants.
    """
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not glue_on():
            return fn(*args, **kwargs)
        c = _COMPILED.get(name)
        if c is None:
            backend = _BACKEND[0] or fuse_backend()
            log.info("fused glue: compiling %s (backend %s)", name, backend)
            # each call site's shapes are one more compiled variant of the function (batch buckets, widths):
            # room for all of them, not dynamo's default 8. Static shapes (dynamic=False): a dim that varied
            # once would otherwise turn symbolic, and on the H200 the symbolic variant's guard
            # (can_use_32bit_indexing) failed to build after a B = 64 capture, so the B = 1 step recompiled
            # on every call and its graph capture failed (2026-12-04: 79 ms a step instead of ~3 ms)
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, 64)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
            c = _COMPILED[name] = torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)
        return c(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
