"""The engine satisfies its protocol, and the components it wires satisfy theirs."""

from __future__ import annotations

from deepinfer_core import protocols as P
from deepinfer_core.engine import LLMEngine
from deepinfer_core.protocols.engine import Engine


def test_engine_and_its_components_satisfy_protocols() -> None:
    eng = LLMEngine()
    assert isinstance(eng, Engine)
    assert isinstance(eng.scheduler, P.Scheduler)
    assert isinstance(eng.kv_pool, P.KVBlockPool)
    assert isinstance(eng.state_pool, P.StatePool)
    assert isinstance(eng.executor, P.ModelExecutor)
    assert isinstance(eng.tokenizer, P.Tokenizer)
    assert isinstance(eng.backend, P.Backend)


def test_grammar_backend_satisfies_protocol() -> None:
    eng = LLMEngine()
    eng.add_request("r", "x", {"max_tokens": 2, "so_args": {"regex": "[a-z]"}})
    assert isinstance(eng.grammars.get()._backend, P.GrammarBackend)
    eng.abort("r")
    assert [o.finish_reason for o in eng.step() if o.finished] == ["abort"]
