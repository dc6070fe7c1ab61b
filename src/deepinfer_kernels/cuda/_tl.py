"""TileLang plumbing shared by the cuda op modules: lazy import, compile cache, launch guards.

Kernels are specialised on their static sizes (vocab, dim, words, ...) and compiled on first use; the
batch dimension is symbolic so one compiled kernel serves every batch size. ``compile_kernel`` caches by
a key the caller builds from those static sizes, and logs the (several-second) JIT time once per key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.envs import tl_arch

log = logging.getLogger(__name__)

try:  # tilelang is optional: without it every cuda op falls back to its reference
    import tilelang
    import tilelang.language as T

    HAVE_TILELANG = True
except ImportError as _e:  # pragma: no cover - depends on the machine
    tilelang = None
    T = None
    HAVE_TILELANG = False
    log.debug("tilelang not importable: %s", _e)

_CACHE: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()


def target() -> dict[str, str] | str:
    """The compile target: ``DEEPINFER_TL_ARCH`` (e.g. sm_90, to compile without a GPU) or auto-detect."""
    arch = tl_arch()
    return {"kind": "cuda", "arch": arch} if arch else "cuda"


def compile_kernel(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """Compiled kernel for ``key``; ``build()`` returns the ``T.prim_func`` (called only on a miss)."""
    k = _CACHE.get(key)
    if k is not None:
        return k
    with _LOCK:
        k = _CACHE.get(key)
        if k is None:
            if not HAVE_TILELANG:
                raise RuntimeError("tilelang is not importable; use backend='reference'")
            t0 = time.perf_counter()
            k = tilelang.compile(build(), target=target())
            log.info("tilelang compiled %s in %.1f s", key, time.perf_counter() - t0)
            _CACHE[key] = k
    return k


def kernel_source(key: tuple[Any, ...]) -> str:
    """Generated CUDA source of a compiled kernel (for docs and debugging)."""
    return _CACHE[key].get_kernel_source()


# Dtypes the kernels are built for; other dtypes (float64 precision runs) take the torch reference, which
# is the same contract, so the cuda backend accepts whatever the reference accepts.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def torch_dtype_name(dt: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dt not in names:
        raise ValueError(f"dtype {dt}: must be one of float32, bfloat16, float16")
    return names[dt]


def require_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: the cuda backend needs a CUDA tensor, got one on {t.device}")
