"""Which grammar engines are installed, found without importing them (no torch, no engine import)."""

from __future__ import annotations

import importlib.util

from deepinfer_core.extras import EXTRAS, MissingExtraError
from deepinfer_core.structured.spec import ENGINES

__all__ = ["available_engines", "require_any_engine"]


def available_engines() -> tuple[str, ...]:
    """The grammar engines installed here, in :data:`~deepinfer_core.structured.spec.ENGINES` order,
    without importing them. The ``structured`` extra brings llguidance; xgrammar is its own extra
    (``xgrammar``: it pulls transformers and, on Linux, triton)."""
    out = []
    for name in ENGINES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or blocked install counts as missing
            found = False
        if found:
            out.append(name)
    return tuple(out)


def require_any_engine(what: str = "structured outputs") -> tuple[str, ...]:
    """:func:`available_engines`, or :class:`~deepinfer_core.extras.MissingExtraError` naming the
    ``structured`` extra when none is installed (checked before any work, e.g. before a model loads)."""
    found = available_engines()
    if not found:
        raise MissingExtraError("llguidance", EXTRAS["llguidance"], what)
    return found
