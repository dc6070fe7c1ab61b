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


def _spec_control() -> Any:
    spec = _executor_with_drafter().spec
    assert spec is not None
    return spec


def _executor_with_drafter() -> Any:
    from deepinfer_core.model.config import tiny_config
    from deepinfer_core.model.executor import ModelExecutor
    from deepinfer_core.model.model import DeepSeekV41

    model = DeepSeekV41.from_config(tiny_config())
    assert model.drafter is not None  # the tiny config has every feature on, DSpark included
    return ModelExecutor(model, 8, 16, 2, quantize=False)


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
    ("InvariantRows", _executor),  # the executor's optional batch-invariant products
    ("SpecControl", _spec_control),
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


def _params(fn: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _accepts(concrete: Any, proto: Any) -> str | None:
    """Why ``concrete`` cannot be called as ``proto`` declares (None: it can): every protocol parameter
    exists under its name and kind, optional where the protocol's is, and any extra parameter is optional."""
    have = {p.name: p for p in _params(concrete)}
    for p in _params(proto):
        q = have.pop(p.name, None)
        if q is None:
            return f"no parameter {p.name!r}"
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            return f"{p.name!r} is optional in the protocol, required here"
    extra = [
        q.name
        for q in have.values()
        if q.default is inspect.Parameter.empty
        and q.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return f"extra required parameters {extra}" if extra else None


@pytest.mark.parametrize(
    ("proto", "factory"),
    [c for c in CASES if c[0] in ("ModelExecutor", "Backend", "EngramTable")],
    ids=["ModelExecutor", "EngramTable", "Backend"],
)
def test_methods_callable_as_declared(proto: str, factory: Callable[[], Any]) -> None:
    """Beyond isinstance (which only sees names): each protocol method's signature is callable on the
    concrete component, and each protocol property is a value there."""
    obj, p = factory(), getattr(P, proto)
    for name, member in vars(p).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(member):
            why = _accepts(getattr(type(obj), name), member)
            assert why is None, f"{type(obj).__name__}.{name}: {why}"
        elif isinstance(member, property):
            getattr(obj, name)  # readable without arguments


def test_engine_uses_only_the_executor_protocol() -> None:
    """Every executor member engine/ reads or sets is declared by ``protocols.ModelExecutor`` (the seam is
    as wide as the real coupling), read from the source: ``<...>.executor.X``, ``self.ex.X`` / ``ex.X``
    (engine/prefix.py's handle) and the switches set through ``setattr``."""
    import ast
    from pathlib import Path

    engine = Path(P.__file__).resolve().parents[1] / "engine"
    # and the optional capability the engine checks with isinstance before use (InvariantRows)
    members = {
        n
        for proto in (P.ModelExecutor, P.InvariantRows)
        for n in (*getattr(proto, "__annotations__", {}), *vars(proto))
        if not n.startswith("_")
    }
    used: dict[str, str] = {}
    for path in sorted(engine.glob("*.py")):
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            # (``@executor.setter``: the engine's property, not a member)
            if (
                isinstance(n, ast.Attribute)
                and n.attr not in ("setter", "getter", "deleter")
                and (
                    (isinstance(n.value, ast.Name) and n.value.id in ("executor", "ex"))
                    or (isinstance(n.value, ast.Attribute) and n.value.attr in ("executor", "ex"))
                )
            ):
                used.setdefault(n.attr, path.name)
            # ``for switch in ("a", "b"): ... setattr(self.executor / ex, switch, ...)``: the loop's names
            if (
                isinstance(n, ast.For)
                and isinstance(n.iter, ast.Tuple)
                and any(
                    isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Name)
                    and c.func.id == "setattr"
                    and (
                        (isinstance(c.args[0], ast.Attribute) and c.args[0].attr == "executor")
                        or (isinstance(c.args[0], ast.Name) and c.args[0].id in ("executor", "ex"))
                    )
                    for c in ast.walk(n)
                )
            ):
                used.update({str(e.value): path.name for e in n.iter.elts if isinstance(e, ast.Constant)})
    assert {"execute", "validate", "spec", "fused_attention"} <= set(used)  # the scan sees the engine's calls
    missing = {a: f for a, f in used.items() if a not in members}
    assert not missing, f"engine/ uses executor members the protocol does not declare: {missing}"
