"""Each concrete component satisfies its protocol (runtime_checkable isinstance), and every protocol has one.

The component folders test their own classes in detail; this file is the one list of (protocol, factory)
pairs across the library, so a protocol without any implementation shows up here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer_core import protocols as P


def _kv_pool() -> Any:
    from deepinfer_core.kv import PagedKVPool

    return PagedKVPool(16, 4)


def _state_pool() -> Any:
    from deepinfer_core.kv import StatePool

    return StatePool(2)


def _prefix_index() -> Any:
    from deepinfer_core.kv import PrefixIndex

    return PrefixIndex(_kv_pool())


def _kv_store() -> Any:
    from deepinfer_core.kvstore import InMemoryKVStore

    return InMemoryKVStore()


def _scheduler() -> Any:
    from deepinfer_core.scheduler import Scheduler

    return Scheduler(_kv_pool())


def _vote() -> Any:
    from deepinfer_core.scheduler import LocalVote

    return LocalVote()


def _placement() -> Any:
    from deepinfer_core.eplb import rebalance_experts

    return rebalance_experts


def _verify_scheduler() -> Any:
    from deepinfer_core.spec import MTPVarlen

    return MTPVarlen()


def _grammar_backend() -> Any:
    pytest.importorskip("xgrammar")
    from deepinfer_core.structured import XGrammarBackend
    from deepinfer_core.tokenizer import ByteTokenizer

    return XGrammarBackend(ByteTokenizer())


def _grammar_matcher() -> Any:
    from deepinfer_core.structured import GrammarSpec

    backend = _grammar_backend()
    return backend.matcher(backend.compile(GrammarSpec.from_so_args({"regex": "[ab]+"})))


def _engram_table() -> Any:
    from deepinfer_core.engram import LocalEngramTable

    return LocalEngramTable.from_values(torch.zeros(4, 32), "bf16")


def _executor() -> Any:
    from deepinfer_core.model.config import tiny_config
    from deepinfer_core.model.executor import ModelExecutor
    from deepinfer_core.model.model import DeepSeekV41

    return ModelExecutor(DeepSeekV41.from_config(tiny_config()), 8, 16, 2, quantize=False)


def _backend() -> Any:
    from deepinfer_kernels import get_backend

    return get_backend("reference")


def _engine() -> Any:
    from deepinfer_core.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig())


def _tokenizer() -> Any:
    from deepinfer_core.tokenizer import ByteTokenizer

    return ByteTokenizer()


CASES: list[tuple[str, Callable[[], Any]]] = [
    ("KVBlockPool", _kv_pool),
    ("StatePool", _state_pool),
    ("PrefixIndex", _prefix_index),
    ("KVBlockStore", _kv_store),
    ("Scheduler", _scheduler),
    ("StepVote", _vote),
    ("ExpertPlacementPolicy", _placement),
    ("VerifyScheduler", _verify_scheduler),
    ("GrammarBackend", _grammar_backend),
    ("GrammarMatcher", _grammar_matcher),
    ("EngramTable", _engram_table),
    ("ModelExecutor", _executor),
    ("Backend", _backend),
    ("Tokenizer", _tokenizer),
    ("Engine", _engine),
]


@pytest.mark.parametrize(("proto", "factory"), CASES, ids=[c[0] for c in CASES])
def test_component_satisfies_protocol(proto: str, factory: Callable[[], Any]) -> None:
    assert isinstance(factory(), getattr(P, proto))


def test_every_protocol_has_an_implementation_listed() -> None:
    assert {c[0] for c in CASES} == set(P.__all__)


def test_every_protocol_method_documented() -> None:
    for name in P.__all__:
        cls = getattr(P, name)
        assert cls.__doc__, name
        for attr, member in vars(cls).items():
            if attr.startswith("_") and attr != "__call__":
                continue
            fn = member.fget if isinstance(member, property) else member
            if inspect.isfunction(fn):
                assert fn.__doc__, f"{name}.{attr} has no contract docstring"
