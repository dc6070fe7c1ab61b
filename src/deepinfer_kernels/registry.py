"""Op registry and the two backends.

An op module (``deepinfer_kernels/ops/<name>.py`` for references, ``deepinfer_kernels/cuda/<name>.py``
for kernels) registers implementations with :func:`register`. Modules are imported on first lookup, so
importing :mod:`deepinfer_kernels` costs nothing and never imports tilelang.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

BACKENDS = ("reference", "cuda")
_OPS: dict[str, dict[str, Callable[..., Any]]] = {}
_loaded: set[str] = set()

# Optional libraries an adapter may use; each is checked for importability, never imported here.
OPTIONAL_LIBRARIES = (
    "tilelang",
    "tile_kernels",
    "flash_mla",
    "deep_gemm",
    "deep_ep",
    "deep_select",
    "xgrammar",
)


def register(name: str, backend: str = "reference") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as op ``name`` for ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _OPS.setdefault(name, {})[backend] = fn
        return fn

    return deco


def _load(package: str) -> None:
    if package in _loaded:
        return
    _loaded.add(package)
    try:
        pkg = importlib.import_module(package)
    except ImportError as e:  # the cuda package needs tilelang; its absence is normal on CPU machines
        log.debug("op package %s not importable: %s", package, e)
        return
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"{package}.{info.name}")
        except ImportError as e:
            log.debug("op module %s.%s not importable: %s", package, info.name, e)


def get_op(name: str, backend: str = "reference") -> Callable[..., Any]:
    """Implementation of op ``name`` for ``backend``; the reference one where the backend has none."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    _load("deepinfer_kernels.ops")
    if backend == "cuda":
        _load("deepinfer_kernels.cuda")
    impls = _OPS.get(name)
    if not impls:
        raise KeyError(f"op {name!r} is not registered; known ops: {sorted(_OPS)}")
    return impls.get(backend) or impls["reference"]


def list_ops() -> dict[str, list[str]]:
    """Registered ops and the backends each has."""
    _load("deepinfer_kernels.ops")
    _load("deepinfer_kernels.cuda")
    return {k: sorted(v) for k, v in sorted(_OPS.items())}


def available_libraries() -> dict[str, bool]:
    """Which optional kernel libraries could be imported here (checked without importing them)."""
    return {lib: importlib.util.find_spec(lib) is not None for lib in OPTIONAL_LIBRARIES}


class ReferenceBackend:
    """Torch reference ops on any device (CPU included): the ground truth."""

    name = "reference"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def op(self, name: str) -> Callable[..., Any]:
        return get_op(name, "reference")


class CudaBackend:
    """TileLang kernels and DeepSeek library adapters where present, torch references elsewhere."""

    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda': no CUDA device is available; use backend='reference'")
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def op(self, name: str) -> Callable[..., Any]:
        return get_op(name, "cuda")


def get_backend(
    name: str = "reference", device: str | torch.device | None = None
) -> ReferenceBackend | CudaBackend:
    """Backend by name: ``"reference"`` (default device cpu) or ``"cuda"``."""
    if name == "reference":
        return ReferenceBackend(device or "cpu")
    if name == "cuda":
        return CudaBackend(device or "cuda")
    raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
