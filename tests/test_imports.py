"""Import hygiene: no import cycle anywhere in src/, and the C++-backed components import without torch.

The cycle check reads every module's imports from its source (module level, ``TYPE_CHECKING`` blocks and
function-level lazy imports alike: a circle hidden behind a lazy import or a type annotation is still
two modules that each need the other) and fails on any strongly connected component of two or more
modules, printing the circle.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every .py file under ``src``."""
    out: dict[str, tuple[Path, bool]] = {}
    for p in src.rglob("*.py"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def import_graph(src: Path) -> dict[str, set[str]]:
    """Edges module -> the modules of ``src`` it imports (by any import statement in its source)."""
    mods = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    if node.level > 1:
                        base = base[: -(node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    # `from pkg import sub` imports the submodule; `from pkg import name` the package
                    if sub in mods:
                        deps.add(sub)
                    elif target in mods:
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_cycles(tmp_path: Path) -> None:
    # The checker itself: a planted 3-module circle (one leg lazy, one under TYPE_CHECKING) is found,
    # an acyclic package with a package-level re-export is not.
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from p.a import A\n")
    (pkg / "a.py").write_text("from p import b\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from p.c import C\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nC = 1\n"
    )
    (pkg / "d.py").write_text("import p.c\n")
    assert cycles(import_graph(tmp_path)) == [["p.a", "p.b", "p.c"]]
    (pkg / "c.py").write_text("C = 1\n")
    assert cycles(import_graph(tmp_path)) == []


def test_no_import_cycles_in_src() -> None:
    graph = import_graph(SRC)
    assert "deepinfer_core.scheduler" in graph and "deepinfer_kernels" in graph
    found = cycles(graph)
    assert not found, (
        "import cycles in src/ (move the shared piece to its own module, or type against a "
        "Protocol): " + "; ".join(" <-> ".join(c) for c in found)
    )


# The C++-backed / numpy components: importing them must not pull torch (or the optional libraries).
LIGHT = ("scheduler", "kv", "spec", "eplb", "structured", "protocols")


@pytest.mark.parametrize("component", LIGHT)
def test_light_components_import_without_torch_fast(component: str) -> None:
    # A fresh interpreter each time (torch already imported in this one); best of 3 tries for the time,
    # which is this shared machine's wall clock.
    code = (
        "import json, sys, time\n"
        "t = time.perf_counter()\n"
        f"import deepinfer_core.{component}\n"
        "dt = time.perf_counter() - t\n"
        "heavy = [m for m in ('torch', 'xgrammar', 'llguidance', 'matplotlib', 'tilelang') if m in sys.modules]\n"
        "print(json.dumps({'seconds': dt, 'heavy': heavy}))\n"
    )
    times = []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["heavy"] == [], f"import deepinfer_core.{component} imported {res['heavy']}"
        times.append(res["seconds"])
        if res["seconds"] < 0.3:
            break
    assert min(times) < 0.3, (
        f"import deepinfer_core.{component}: {min(times):.3f} s (limit 0.3 s), tries {times}"
    )


def test_lazy_names_still_resolve() -> None:
    # The lazy attributes of the light packages resolve to the real objects.
    from deepinfer_core import structured
    from deepinfer_core.structured.manager import BatchMask, StructuredOutputManager

    assert structured.StructuredOutputManager is StructuredOutputManager
    assert structured.BatchMask is BatchMask
    with pytest.raises(AttributeError):
        _ = structured.NoSuchThing
