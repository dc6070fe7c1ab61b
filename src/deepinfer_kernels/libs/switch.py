"""Which DeepSeek kernel libraries the cuda backend's ops use in place of their TileLang kernels.

``DEEPINFER_KERNEL_LIBS`` (read at each call through ``deepinfer_core.envs.kernel_libs``, so a test's
monkeypatch or a script's setting before its first step takes effect):

- ``auto`` (default): the libraries of :data:`AUTO_LIBRARIES` that are importable here;
- ``none``: the TileLang / torch paths only;
- a comma list (``deep_select,deep_gemm``): those libraries where importable (a named library that is not
  importable is reported once in the log and skipped: its op keeps the TileLang path).

What each switch changes (see docs/cuda_backend.md, "Kernel libraries"):

- ``deep_select``: ``indexer_topk`` (bf16 / fp32 scores) through ``deep_select.topk``;
- ``deep_gemm``: ``indexer_scores`` through ``fp8_mqa_logits`` (FP8 q and keys: within FP8 tolerance of
  the bf16 path, not equal) and ``moe_grouped_gemm`` through ``m_grouped_fp8_gemm_nt_masked`` (weights
  quantised once to 128 x 128 FP8 blocks, activations per token per 128);
- ``flash_mla``: its sparse decode reads the V3.2 656-byte cache, which this model's attention does not
  use: the switch only allows :func:`deepinfer_kernels.cuda.adapters.flash_mla_sparse_decode`.

:data:`AUTO_LIBRARIES` is empty until the H200 measurements of ``benchmarks/kernel_libs.py`` show a
library faster than the TileLang kernel on the engine's shapes (docs/performance.md); none has been
measured yet, so ``auto`` is the TileLang path.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

from deepinfer_core.envs import KERNEL_LIBS, kernel_libs

log = logging.getLogger(__name__)

SWITCHABLE = KERNEL_LIBS
# every library an adapter may call (DeepEP and tile_kernels are used directly, not switched)
LIBRARIES = ("flash_mla", "deep_gemm", "deep_ep", "deep_select", "tile_kernels")
AUTO_LIBRARIES: tuple[str, ...] = ()
_warned: set[str] = set()


def importable(lib: str) -> bool:
    """Whether ``lib`` can be imported here (checked without importing it)."""
    if lib not in SWITCHABLE:
        raise ValueError(f"lib={lib!r}: must be one of {SWITCHABLE}")
    return importlib.util.find_spec(lib) is not None


def require(lib: str) -> Any:
    """The imported library; RuntimeError naming it when it is not importable here."""
    if lib not in LIBRARIES:
        raise ValueError(f"lib={lib!r}: must be one of {LIBRARIES}")
    if importlib.util.find_spec(lib) is None:
        raise RuntimeError(
            f"{lib} is not importable here; build it with scripts/build_kernel_libs.sh or use the torch path"
        )
    return importlib.import_module(lib)


def selected() -> tuple[str, ...]:
    """The libraries ``DEEPINFER_KERNEL_LIBS`` asks for (``auto`` resolved to :data:`AUTO_LIBRARIES`)."""
    spec = kernel_libs()
    return AUTO_LIBRARIES if spec == "auto" else tuple(spec)


def enabled(lib: str) -> bool:
    """Whether the cuda backend's ops should call ``lib``: selected and importable."""
    if lib not in SWITCHABLE:
        raise ValueError(f"lib={lib!r}: must be one of {SWITCHABLE}")
    if lib not in selected():
        return False
    if importable(lib):
        return True
    if lib not in _warned:
        _warned.add(lib)
        log.warning(
            "DEEPINFER_KERNEL_LIBS names %s, which is not importable here: its ops keep TileLang", lib
        )
    return False
