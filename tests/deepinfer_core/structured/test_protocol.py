"""The concrete structured-output classes satisfy their protocols (runtime isinstance)."""

from __future__ import annotations

import pytest

from deepinfer_core import protocols as P
from deepinfer_core.structured import GrammarSpec, LLGuidanceBackend, XGrammarBackend


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_backends_and_matchers_satisfy_protocols(name: str, backend_for) -> None:
    backend = backend_for(name, "byte")
    assert isinstance(backend, P.GrammarBackend)
    assert isinstance(backend, XGrammarBackend if name == "xgrammar" else LLGuidanceBackend)
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "[ab]+")))
    assert isinstance(matcher, P.GrammarMatcher)
    assert backend.vocab_size == 512


def test_protocol_rejects_non_backend() -> None:
    assert not isinstance(object(), P.GrammarBackend)
    assert not isinstance(object(), P.GrammarMatcher)
