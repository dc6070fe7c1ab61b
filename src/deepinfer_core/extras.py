"""Optional dependencies: one place that imports them and, when one is missing, says which extra to install.

The package's own dependencies (torch, numpy, the C++ core, tokenizers) cover the engine, the components
and the demo; the rest is in extras (pyproject.toml's ``[project.optional-dependencies]``):
``structured`` (llguidance, the default grammar engine, and jsonschema with its format checkers for the
post-hoc document check), ``xgrammar`` (the second grammar engine; it pulls transformers and, on Linux,
triton), ``kvstore`` (redis, for the Redis KV block store), ``plot`` (matplotlib, the benchmarks'
``--plot``), ``cuda`` (tilelang, tile-kernels) and ``test``. :func:`require` imports a module of one of
them and turns the bare ``ModuleNotFoundError`` into a :class:`MissingExtraError` whose message is one
line naming the extra::

    the llguidance grammar backend needs llguidance: pip install "deepinfer-components[structured]"

It subclasses ``ModuleNotFoundError`` (``.name`` is the missing module), so existing handlers still work.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "install_hint", "missing_extra", "require"]

PACKAGE = "deepinfer-components"

# top-level module -> the extra of pyproject.toml that installs it
# (tests/test_packaging.py checks each extra exists and lists a distribution of that module)
EXTRAS: dict[str, str] = {
    "llguidance": "structured",
    "jsonschema": "structured",
    "rfc3339_validator": "structured",
    "tokenizers": "structured",
    "xgrammar": "xgrammar",
    "redis": "kvstore",
    "matplotlib": "plot",
    "tilelang": "cuda",
    "tile_kernels": "cuda",
    "pytest": "test",
    "hypothesis": "test",
    "fastapi": "serve",
    "uvicorn": "serve",
    "openai": "test",
}


def install_hint(extra: str) -> str:
    return f'pip install "{PACKAGE}[{extra}]"'


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, what: str | None = None) -> None:
        self.extra = extra
        needs = f"{what} needs {module}" if what else f"{module} is not installed"
        super().__init__(f"{needs}: {install_hint(extra)}", name=module)


def require(module: str, what: str | None = None) -> ModuleType:
    """``import module`` (a module of an extra, or a submodule of one); on a missing top-level package,
    :class:`MissingExtraError` naming the extra. ``what`` says what needed it (for the message)."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        raise ValueError(f"module={module!r}: not an optional dependency; known: {sorted(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Only the optional package itself missing is the user's install; a broken install (one of its own
        # dependencies missing) keeps its original error.
        if e.name != top:
            raise
        raise MissingExtraError(top, extra, what) from None


def missing_extra(exc: BaseException) -> MissingExtraError | None:
    """The :class:`MissingExtraError` an exception is or stands for (a bare ``ModuleNotFoundError`` of a
    known optional package counts), else None. For callers that report and go on (the demo)."""
    if isinstance(exc, MissingExtraError):
        return exc
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top in EXTRAS:
            return MissingExtraError(top, EXTRAS[top])
    return None
