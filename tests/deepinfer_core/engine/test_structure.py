"""The engine's structure (issue #31): a step that reads as its stages, owned collaborators instead of
mixins, and one function that ends a request (function and file sizes: tests/test_structure.py, rule 4). Measured with ``ast`` on the
source (and, for base classes, on the imported classes), so a regression fails here, not in review."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import pytest

import deepinfer_core
from deepinfer_core.engine.engine import LLMEngine

SRC = Path(deepinfer_core.__file__).parent
ENGINE = SRC / "engine"
MAX_STEP_LINES = 20  # function and file sizes (engine/ and model/): tests/test_structure.py, rule 4


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) of every function in ``path``."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                out.append((f"{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return out


def _engine_files() -> list[Path]:
    return sorted(ENGINE.glob("*.py"))


def test_the_step_reads_as_its_stages() -> None:
    """``LLMEngine.step`` (the lock and the recovery) and ``_step`` (the stages) are each <= 20 lines."""
    lengths = dict(_functions(ENGINE / "engine.py"))
    assert lengths["LLMEngine.step"] <= MAX_STEP_LINES
    assert lengths["LLMEngine._step"] <= MAX_STEP_LINES


def _package_classes(package: str) -> list[type]:
    pkg = importlib.import_module(package)
    classes = []
    for info in pkgutil.walk_packages(pkg.__path__, f"{package}."):
        mod = importlib.import_module(info.name)
        classes += [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == info.name]
    return classes


def _mixed(package: str) -> list[tuple[str, list[str]]]:
    """Classes of ``package`` with more than one base class from this library that is not a Protocol."""
    out = []
    for cls in _package_classes(package):
        ours = [
            b.__name__
            for b in cls.__bases__
            if b.__module__.startswith("deepinfer_core") and not getattr(b, "_is_protocol", False)
        ]
        if len(ours) > 1:
            out.append((f"{cls.__module__}.{cls.__qualname__}", ours))
    return out


def test_no_mixin_classes_in_engine() -> None:
    assert not _mixed("deepinfer_core.engine")
    # and no engine class is built on another engine class: collaborators are owned, not inherited
    inherited = [
        (c.__qualname__, b.__qualname__)
        for c in _package_classes("deepinfer_core.engine")
        for b in c.__bases__
        if b.__module__.startswith("deepinfer_core.engine") and not getattr(b, "_is_protocol", False)
    ]
    assert not inherited


def test_no_mixin_classes_in_model() -> None:
    assert not _mixed("deepinfer_core.model")


def _store_targets(path: Path) -> list[tuple[str, int]]:
    """(what, line) of every write to a sequence's ``dead`` flag and to a request's ``reason`` / ``error``."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if (
                    isinstance(el, ast.Subscript)
                    and isinstance(el.value, ast.Attribute)
                    and el.value.attr == "dead"
                ):
                    hits.append(("dead[...]", el.lineno))
                if (
                    isinstance(el, ast.Attribute)
                    and el.attr in ("reason", "error")
                    and not (isinstance(el.value, ast.Name) and el.value.id == "self")
                ):
                    hits.append((f".{el.attr}", el.lineno))
    return hits


def test_one_function_ends_a_request() -> None:
    """Only ``RequestTable`` marks a sequence dead or sets a request's reason / error (``end``, and the
    release / reset paths beside it); every other module ends a request by calling ``end``."""
    stray = {
        p.name: h
        for p in _engine_files()
        if p.name not in ("request_table.py", "requests.py")
        if (h := _store_targets(p))
    }
    assert not stray, f"requests ended outside RequestTable.end: {stray}"
    src = (ENGINE / "request_table.py").read_text()
    assert src.count("def end(") == 1


def _self_attrs(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(attributes assigned in ``__init__``, attributes assigned anywhere else) on ``self``."""
    init: set[str] = set()
    other: set[str] = set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                (init if fn.name == "__init__" else other).add(node.attr)
    return init, other


def test_collaborators_declare_their_state_in_init() -> None:
    """No attribute appears from nowhere: every ``self.x = ...`` outside ``__init__`` is declared there
    (LLMEngine builds its per-run parts in ``_build``, called by ``__init__`` and ``reset``)."""
    undeclared = []
    for p in _engine_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                init, other = _self_attrs(node)
                if node.name == "LLMEngine":
                    build = next(
                        f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "_build"
                    )
                    init |= {
                        n.attr
                        for n in ast.walk(build)
                        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    }
                if init and other - init:
                    undeclared.append((p.name, node.name, sorted(other - init)))
    assert not undeclared


def test_collaborators_take_typed_arguments() -> None:
    """The engine's collaborators get explicit, typed constructor arguments: none typed ``Any``."""
    from deepinfer_core.engine import (
        output_builder,
        parallel_sampling,
        request_table,
        run,
        sample,
        spec_rows,
        step_order,
    )

    classes = [
        request_table.RequestTable,
        sample.TokenSampler,
        run.StepRunner,
        output_builder.OutputBuilder,
        step_order.SyncOrder,
        step_order.AsyncOrder,
        step_order.OverlapOrder,
        spec_rows.SpecRows,
        parallel_sampling.SampleGroups,
    ]
    for cls in classes:
        hints = typing.get_type_hints(cls.__init__)
        params = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
        assert params and all(n in hints for n in params), f"{cls.__name__}: untyped constructor arguments"
        loose = [n for n in params if hints[n] is typing.Any]
        assert not loose, f"{cls.__name__}: arguments typed Any: {loose}"


def test_the_engine_owns_one_step_order_per_mode() -> None:
    """sync / async / overlap are three classes behind one Protocol, chosen once, not flags in the step."""
    from deepinfer_core.engine import step_order

    for mode, cls in (
        ("sync", step_order.SyncOrder),
        ("async", step_order.AsyncOrder),
        ("overlap", step_order.OverlapOrder),
    ):
        assert cls.name == mode
        for name in ("land_before", "feed", "land_early", "land_after"):
            assert callable(getattr(cls, name))
    with pytest.raises(ValueError, match="step order"):
        step_order.make_step_order("fast", None, None)  # type: ignore[arg-type]
    assert "async_mode" not in inspect.getsource(LLMEngine._step)
