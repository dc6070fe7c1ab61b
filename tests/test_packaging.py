"""Packaging (issue #35): extras that match the features, metadata, and the type stubs of the C++ core.

- every extra named anywhere (``deepinfer_core.extras.EXTRAS``, any ``pip install "deepinfer-components[X]"``
  or ``install_hint("X")`` in the sources and benchmarks) exists in pyproject.toml, and the extra a
  module maps to really installs that module (checked against the installed distributions' metadata);
- the light ``structured`` extra: its whole dependency closure (read from the installed metadata) holds
  neither a GPU compiler (triton) nor transformers nor xgrammar;
- the package metadata carries classifiers, project URLs and authors;
- ``deepinfer_core._C`` has stubs (nanobind's stubgen) that are current and that mypy reads.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer_core.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OPTIONAL = PYPROJECT["project"]["optional-dependencies"]


def _name(req: str) -> tuple[str, set[str]]:
    """(normalised distribution name, its extras) of a requirement string."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", req)
    assert m, req
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), extras


def _closure(reqs: list[str]) -> set[str]:
    """Distribution names the requirements install, following the installed metadata (markers of extras
    honoured; other markers taken as true: an over-approximation on this platform)."""
    seen: set[str] = set()
    todo = [_name(r) for r in reqs]
    while todo:
        name, extras = todo.pop()
        if name in seen and not extras:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in requires:
            marker = r.split(";", 1)[1] if ";" in r else ""
            wants = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if wants and not (set(wants) & extras):
                continue
            todo.append(_name(r.split(";", 1)[0]))
    return seen


def test_every_extra_named_exists() -> None:
    named = set(EXTRAS.values())
    pat = re.compile(r"deepinfer-components\[([a-z0-9_,-]+)\]|install_hint\(\s*['\"]([a-z0-9_-]+)['\"]\s*\)")
    files = [
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "Makefile",
    ]
    for f in files:
        for m in pat.finditer(f.read_text(errors="replace")):
            named.update(x for x in (m.group(1) or m.group(2)).split(",") if x)
    missing = sorted(named - set(OPTIONAL))
    assert not missing, f"extras named but not in pyproject's optional-dependencies: {missing}"
    assert {"structured", "xgrammar", "kvstore", "plot", "cuda", "test"} <= set(OPTIONAL)


def test_each_module_is_installed_by_its_extra() -> None:
    dists_of = md.packages_distributions()
    for module, extra in EXTRAS.items():
        dists = {_name(d)[0] for d in dists_of.get(module, [])}
        if not dists:  # not installed here (e.g. cuda's tilelang): the name is checked by the test above
            continue
        closure = _closure(OPTIONAL[extra])
        assert dists & closure, f"{module} ({dists}) is mapped to [{extra}], which does not install it"


def test_structured_extra_is_light() -> None:
    closure = _closure(OPTIONAL["structured"])
    assert {"llguidance", "jsonschema", "rfc3339-validator"} <= closure  # the format checkers come along
    heavy = closure & {"triton", "transformers", "xgrammar"}
    assert not heavy, f"the structured extra pulls {heavy}"
    assert any(_name(r) == ("jsonschema", {"format-nongpl"}) for r in OPTIONAL["structured"])
    assert [_name(r)[0] for r in OPTIONAL["kvstore"]] == ["redis"]
    assert "xgrammar" in {_name(r)[0] for r in OPTIONAL["xgrammar"]}
    assert "matplotlib" in {_name(r)[0] for r in OPTIONAL["plot"]}


def test_metadata() -> None:
    project = PYPROJECT["project"]
    assert project["authors"] and project["urls"] and len(project["classifiers"]) >= 5
    assert all(u.startswith("https://") for u in project["urls"].values())
    assert "Typing :: Typed" in project["classifiers"]
    meta = md.metadata("deepinfer-components")  # what pip installed from it
    if not meta.get_all("Classifier"):
        pytest.skip("this environment's install predates the metadata (reinstall: make ext)")
    assert set(meta.get_all("Classifier")) == set(project["classifiers"])
    assert len(meta.get_all("Project-URL")) == len(project["urls"])


def test_stubs_are_current() -> None:
    nanobind = pytest.importorskip("nanobind")
    head = (ROOT / "src" / "deepinfer_core" / "_C" / "__init__.pyi").read_text().splitlines()[0]
    if f"(nanobind {nanobind.__version__} stubgen)" not in head:
        pytest.skip(f"stubs made by another nanobind ({head}); this one is {nanobind.__version__}")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_stubs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    stubs = ROOT / "src" / "deepinfer_core" / "_C"
    assert (stubs / "__init__.pyi").is_file() and (stubs / "kv.pyi").is_file()
    # shipped: the wheel takes every file under src/deepinfer_core (py.typed too)
    assert "src/deepinfer_core" in PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"]
    assert (ROOT / "src" / "deepinfer_core" / "py.typed").is_file()


def test_mypy_reads_the_stubs(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    snippet = tmp_path / "use_c.py"
    snippet.write_text(
        "from deepinfer_core import _C\n"
        "from deepinfer_core._C import kv, scheduler\n\n"
        "pool = kv.BlockPool(num_blocks=8, block_size=16)\n"
        "free: int = pool.num_free_blocks\n"
        "ok: bool = pool.allocate(1, 20)\n"
        "mods: list = _C.submodules\n"
        "wrong: str = pool.num_free_blocks\n"  # line 8: must be flagged, which only the stubs can tell
        "pool.allocate('one', 20)\n"  # line 9: a str seq_id
    )
    env = {"MYPYPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    errors = [ln for ln in out.splitlines() if ": error:" in ln]
    assert {int(ln.split(":")[1]) for ln in errors} == {8, 9}, out
    assert "import-not-found" not in out and "import-untyped" not in out, out


def test_missing_kvstore_extra_is_one_line() -> None:
    # a plain install (no redis): the Redis store says which extra to install; the other stores need nothing
    code = (
        "import importlib.abc, sys\n"
        "class _No(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'redis':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _No())\n"
        "from deepinfer_core.kvstore.redis_store import RedisKVStore\n"
        "try:\n"
        "    RedisKVStore(url='redis://127.0.0.1:1/0')\n"
        "except ModuleNotFoundError as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        'MissingExtraError | the Redis KV store needs redis: pip install "deepinfer-components[kvstore]"'
    )
