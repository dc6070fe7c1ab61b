"""Structured outputs: regex, JSON-schema, EBNF and choice constraints as per-token bitmasks.

``GrammarSpec`` says what a request wants; a :class:`~deepinfer_core.protocols.GrammarBackend`
(``XGrammarBackend``, ``LLGuidanceBackend``, or ``AutoBackend`` over both, the engine's default) compiles it against the library's tokenizer;
``StructuredOutputManager`` keeps one matcher per request, compiles in the background, and fills batch
bitmasks including one row per speculative draft. The engines are imported lazily, only when a backend
is built, so importing this package needs neither xgrammar nor llguidance; the manager (its bitmasks are
torch tensors) is imported on first use, so importing the package does not import torch either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_core.structured.engines import available_engines, require_any_engine
from deepinfer_core.structured.spec import KINDS, FinishReason, GrammarSpec
from deepinfer_core.structured.vocab import GrammarVocab, grammar_vocab

if TYPE_CHECKING:
    from deepinfer_core.structured.manager import BatchMask, StructuredOutputManager

BACKENDS = ("xgrammar", "llguidance", "auto")

__all__ = [
    "BACKENDS",
    "KINDS",
    "BatchMask",
    "FinishReason",
    "GrammarSpec",
    "GrammarVocab",
    "LLGuidanceBackend",
    "StructuredOutputManager",
    "XGrammarBackend",
    "available_engines",
    "grammar_vocab",
    "make_backend",
    "require_any_engine",
]


def make_backend(name: str, tokenizer: Any, **kwargs: Any) -> Any:
    """``"xgrammar"``, ``"llguidance"`` or ``"auto"`` (the engine's default: the installed engines,
    chosen per spec with fallback: :mod:`deepinfer_core.structured.auto_backend`), bound to ``tokenizer``."""
    if name == "xgrammar":
        from deepinfer_core.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, **kwargs)
    if name == "llguidance":
        from deepinfer_core.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, **kwargs)
    if name == "auto":
        from deepinfer_core.structured.auto_backend import AutoBackend

        return AutoBackend(tokenizer, **kwargs)
    raise ValueError(f"backend={name!r}: must be one of {list(BACKENDS)}")


def __getattr__(name: str) -> Any:
    # Lazy: the manager imports torch, the backend classes their engine; each only when asked for.
    if name in ("BatchMask", "StructuredOutputManager"):
        from deepinfer_core.structured import manager

        return getattr(manager, name)
    if name == "XGrammarBackend":
        from deepinfer_core.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    if name == "LLGuidanceBackend":
        from deepinfer_core.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
