"""DeepInfer's ``DEEPINFER_*`` switches, parsed and validated in one place.

This is the only module in the library that reads environment variables. Components never read it
themselves: the engine (or the caller) reads :func:`get_envs` once and passes plain values down, so a
component can be used with explicit arguments and no environment at all.

=====================================  =========  ============================================================
variable                               default    meaning
=====================================  =========  ============================================================
``DEEPINFER_ENABLE_MTP_VARLEN``        1          verify a variable number of drafts per request (MTPVarlen)
``DEEPINFER_USE_NEXTN_DECODE``         5          maximum drafts per request; 0 turns speculation off
``DEEPINFER_MAX_BACKTRACKING_TOKENS``  drafts+1   extra SWA ring slots kept so rejected drafts can roll back
``DEEPINFER_BATCH_INVARIANT``          0          batch-invariant kernels and deterministic sampling
``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` 140        suffix recomputed by SWA bounded replay after a prefix hit
``DEEPINFER_CUDA_GRAPHS``              1          replay CUDA graphs for decode steps (cuda backend); 0 = eager
``DEEPINFER_FUSE_GLUE``                0          compile the decode step's small functions into fused kernels (cuda)
``DEEPINFER_FUSED_ATTENTION``          0          each decode layer's attention as one kernel (cuda, 64 x 512 heads)
``DEEPINFER_FUSED_MOE``                0          the decode step's expert products as one TileLang grouped GEMM (cuda)
``DEEPINFER_FUSED_HEAD``               0          the decode step's LM head through that kernel (cuda)
=====================================  =========  ============================================================

Three tool settings are read where they are used, each through its function here (read at the call, not
cached by :func:`get_envs`: a script that sets one before its first kernel, or a test's monkeypatch, still
takes effect, as when the modules read ``os.environ`` themselves):

=====================================  =========  ============================================================
``DEEPINFER_FUSE_BACKEND``             inductor   torch.compile backend of the fused glue (:func:`fuse_backend`)
``DEEPINFER_GG_CONFIGS``               unset      JSON file of tuned grouped-GEMM launches (:func:`gg_configs_path`)
``DEEPINFER_TL_ARCH``                  unset      TileLang target arch, e.g. sm_90a, to compile without a GPU
                                                  (:func:`tl_arch`)
``DEEPINFER_KERNEL_LIBS``              auto       DeepSeek kernel libraries the cuda backend may use: auto, none,
                                                  or a comma list of flash_mla, deep_gemm, deep_select
                                                  (:func:`kernel_libs`)
=====================================  =========  ============================================================
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

import attrs

__all__ = ["EnvError", "Envs", "fuse_backend", "get_envs", "gg_configs_path", "kernel_libs", "tl_arch"]

MAX_DRAFTS = 16  # a bound on the draft length that no drafter in the seeds approaches (DSpark uses 5)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class EnvError(ValueError):
    """A DEEPINFER_* variable holds a value outside what it allows; the message names the variable."""


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r}: expected one of 0/1/true/false/yes/no/on/off")


def _parse_int(name: str, raw: str, lo: int, hi: int | None) -> int:
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None
    if v < lo or (hi is not None and v > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise EnvError(f"{name}={v}: must be {allowed}")
    return v


@attrs.frozen(kw_only=True)
class Envs:
    """Validated switches. Construct directly for tests, or with :meth:`from_environ`."""

    enable_mtp_varlen: bool = True
    use_nextn_decode: int = 5
    max_backtracking_tokens: int = attrs.field()
    batch_invariant: bool = False
    yoco_prefill_keep_tokens: int = 140
    cuda_graphs: bool = True
    fuse_glue: bool = False
    # the one-kernel decode paths: None = the executor's default (on where the model's shapes run the
    # cuda backend's kernels, model.fused_kernels); True / False force them on / off
    fused_attention: bool | None = None
    fused_moe: bool | None = None
    fused_head: bool | None = None

    @max_backtracking_tokens.default
    def _default_backtracking(self) -> int:
        # One slot per draft that may be rolled back, plus the bonus token of the verify step.
        return self.use_nextn_decode + 1

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.use_nextn_decode <= MAX_DRAFTS:
            raise EnvError(
                f"DEEPINFER_USE_NEXTN_DECODE={self.use_nextn_decode}: must be in [0, {MAX_DRAFTS}]"
            )
        if self.max_backtracking_tokens < self.use_nextn_decode:
            raise EnvError(
                f"DEEPINFER_MAX_BACKTRACKING_TOKENS={self.max_backtracking_tokens}: must be >= "
                f"DEEPINFER_USE_NEXTN_DECODE={self.use_nextn_decode}, or a rejected draft could not be rolled back"
            )
        if self.yoco_prefill_keep_tokens < 1:
            raise EnvError(
                f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={self.yoco_prefill_keep_tokens}: must be >= 1"
            )

    @property
    def speculative(self) -> bool:
        """True when drafts are produced and verified at all."""
        return self.use_nextn_decode > 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Envs:
        """Parse the switches from ``environ`` (default ``os.environ``); unset variables take defaults."""
        env = os.environ if environ is None else environ
        kw: dict[str, object] = {}
        if (raw := env.get("DEEPINFER_ENABLE_MTP_VARLEN")) is not None:
            kw["enable_mtp_varlen"] = _parse_bool("DEEPINFER_ENABLE_MTP_VARLEN", raw)
        if (raw := env.get("DEEPINFER_USE_NEXTN_DECODE")) is not None:
            kw["use_nextn_decode"] = _parse_int("DEEPINFER_USE_NEXTN_DECODE", raw, 0, MAX_DRAFTS)
        if (raw := env.get("DEEPINFER_MAX_BACKTRACKING_TOKENS")) is not None:
            kw["max_backtracking_tokens"] = _parse_int("DEEPINFER_MAX_BACKTRACKING_TOKENS", raw, 0, None)
        if (raw := env.get("DEEPINFER_BATCH_INVARIANT")) is not None:
            kw["batch_invariant"] = _parse_bool("DEEPINFER_BATCH_INVARIANT", raw)
        if (raw := env.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")) is not None:
            kw["yoco_prefill_keep_tokens"] = _parse_int("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", raw, 1, None)
        if (raw := env.get("DEEPINFER_CUDA_GRAPHS")) is not None:
            kw["cuda_graphs"] = _parse_bool("DEEPINFER_CUDA_GRAPHS", raw)
        if (raw := env.get("DEEPINFER_FUSE_GLUE")) is not None:
            kw["fuse_glue"] = _parse_bool("DEEPINFER_FUSE_GLUE", raw)
        if (raw := env.get("DEEPINFER_FUSED_ATTENTION")) is not None:
            kw["fused_attention"] = _parse_bool("DEEPINFER_FUSED_ATTENTION", raw)
        if (raw := env.get("DEEPINFER_FUSED_MOE")) is not None:
            kw["fused_moe"] = _parse_bool("DEEPINFER_FUSED_MOE", raw)
        if (raw := env.get("DEEPINFER_FUSED_HEAD")) is not None:
            kw["fused_head"] = _parse_bool("DEEPINFER_FUSED_HEAD", raw)
        return cls(**kw)  # type: ignore[arg-type]


@functools.cache
def get_envs() -> Envs:
    """The process-wide switches, read from ``os.environ`` once on first call."""
    return Envs.from_environ()


def _read(name: str, environ: Mapping[str, str] | None) -> str | None:
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw.strip()


def fuse_backend(environ: Mapping[str, str] | None = None) -> str:
    """``DEEPINFER_FUSE_BACKEND``: the torch.compile backend name of the fused glue (default inductor)."""
    return _read("DEEPINFER_FUSE_BACKEND", environ) or "inductor"


def gg_configs_path(environ: Mapping[str, str] | None = None) -> str | None:
    """``DEEPINFER_GG_CONFIGS``: a JSON file of grouped-GEMM launch configurations, or None."""
    return _read("DEEPINFER_GG_CONFIGS", environ)


def tl_arch(environ: Mapping[str, str] | None = None) -> str | None:
    """``DEEPINFER_TL_ARCH``: the TileLang compile target's arch (``sm_90``, ``sm_90a``, ...), or None (detect)."""
    arch = _read("DEEPINFER_TL_ARCH", environ)
    if arch is not None and not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise EnvError(f"DEEPINFER_TL_ARCH={arch!r}: expected a CUDA arch such as sm_90 or sm_90a")
    return arch


KERNEL_LIBS = ("flash_mla", "deep_gemm", "deep_select")


def kernel_libs(environ: Mapping[str, str] | None = None) -> str | tuple[str, ...]:
    """``DEEPINFER_KERNEL_LIBS``: ``"auto"`` (unset; the measured defaults), ``()`` for ``none``, or the
    named libraries in the order given (each one of :data:`KERNEL_LIBS`)."""
    raw = _read("DEEPINFER_KERNEL_LIBS", environ)
    if raw is None or raw.strip().lower() == "auto":
        return "auto"
    if raw.strip().lower() in ("none", ""):
        return ()
    names = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    bad = [n for n in names if n not in KERNEL_LIBS]
    if bad:
        raise EnvError(
            f"DEEPINFER_KERNEL_LIBS={raw!r}: unknown {bad}; allowed: auto, none, or a comma list of "
            f"{', '.join(KERNEL_LIBS)}"
        )
    return names
