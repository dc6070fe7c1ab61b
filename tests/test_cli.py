"""The ``deepinfer`` command, the demo's section selection and summary, the optional-extras errors, and
printing model text safely.

Missing extras are simulated in a fresh interpreter by a meta-path finder that refuses the optional
packages, the way a plain ``pip install deepinfer-components`` (no extras) leaves them.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core import cli, demo
from deepinfer_core.display import is_safe, printable
from deepinfer_core.extras import EXTRAS, MissingExtraError, missing_extra, require

ROOT = Path(__file__).resolve().parents[1]

BLOCK = """
import importlib.abc, sys
class _NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NoExtras())
for m in list(sys.modules):
    if m.split('.')[0] in {blocked!r}:
        del sys.modules[m]
"""


def _run(code: str, blocked: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess[str]:
    prelude = BLOCK.format(blocked=set(blocked)) if blocked else ""
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


# ------------------------------------------------------------------------------------------ printable
@given(st.text())
def test_printable_escapes_exactly_the_unsafe_characters(text: str) -> None:
    out = printable(text)
    assert is_safe(out)
    if is_safe(text):
        assert out == text
    # Undo the escapes (no backslash in the input, so every one in the output is an escape): the input back.
    if "\\" not in text:
        back = re.sub(
            r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})", lambda m: chr(int(m.group(1)[1:], 16)), out
        )
        assert back == text


def test_printable_examples() -> None:
    assert printable("a\x00b\x07c\x1b[2Jd\r\n\té中") == "a\\x00b\\x07c\\x1b[2Jd\\x0d\n\té中"
    assert printable("\u200b\U0001f600") == "\\u200b\U0001f600"  # zero-width space escaped, emoji kept


# ------------------------------------------------------------------------------------------ extras
def test_require_names_the_extra_on_one_line() -> None:
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy")
    r = _run(
        "from deepinfer_core.extras import require\n"
        "try:\n    require('xgrammar', 'the xgrammar grammar backend')\n"
        "except ModuleNotFoundError as e:\n    print(type(e).__name__, e.name, '|', e)\n",
        blocked=("xgrammar",),
    )
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line
    assert line == (
        "MissingExtraError xgrammar | the xgrammar grammar backend needs xgrammar: "
        'pip install "deepinfer-components[xgrammar]"'
    )


def test_missing_extra_classifies() -> None:
    e = MissingExtraError("matplotlib", "plot")
    assert missing_extra(e) is e and e.name == "matplotlib" and isinstance(e, ModuleNotFoundError)
    bare = missing_extra(ModuleNotFoundError("No module named 'llguidance.x'", name="llguidance.x"))
    assert (
        bare is not None and bare.extra == "structured" and '"deepinfer-components[structured]"' in str(bare)
    )
    assert missing_extra(ModuleNotFoundError("x", name="deepinfer_core._C")) is None
    assert missing_extra(ValueError("x")) is None
    # every extra named exists in pyproject.toml
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) <= set(extras)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_grammar_backend_without_structured_extra(backend: str) -> None:
    r = _run(
        "from deepinfer_core.structured import make_backend\n"
        "from deepinfer_core.tokenizer import ByteTokenizer\n"
        "from deepinfer_core.extras import MissingExtraError\n"
        "try:\n"
        f"    make_backend({backend!r}, ByteTokenizer())\n"
        "except MissingExtraError as e:\n    print('ERR', e)\n",
        blocked=("xgrammar", "llguidance"),
    )
    assert r.returncode == 0, r.stderr
    extra = {"xgrammar": "xgrammar", "llguidance": "structured"}[backend]
    assert r.stdout.strip() == (
        f'ERR the {backend} grammar backend needs {backend}: pip install "deepinfer-components[{extra}]"'
    )


def test_engine_so_args_without_structured_extra() -> None:
    # The constrained request fails alone with the one-line hint; the plain one runs.
    r = _run(
        "from deepinfer_core.engine import LLM\n"
        "from deepinfer_core.sampling_params import SamplingParams as S\n"
        "outs = LLM(num_blocks=32, max_num_seqs=2).generate(['a', 'b'], [S(max_tokens=3, so_args={'regex': 'x+'}),"
        " S(max_tokens=3, ignore_eos=True)], use_tqdm=False)\n"
        "print(outs[0].error)\nprint(outs[1].ok, len(outs[1].token_ids))\n",
        blocked=("xgrammar", "llguidance"),
    )
    assert r.returncode == 0, r.stderr
    err, plain = r.stdout.strip().splitlines()
    assert err == (
        "SamplingParams.so_args: the auto grammar backend needs llguidance: "
        'pip install "deepinfer-components[structured]"'
    )
    assert plain == "True 3"


def test_demo_skips_sections_whose_extra_is_missing() -> None:
    # The whole main job on a plain install (no structured extra): exit 0, the grammar section skipped
    # with the pip line, the engine section without its constrained requests.
    r = _run(
        "from deepinfer_core.demo import main\nraise SystemExit(main([]))\n",
        blocked=("xgrammar", "llguidance"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        'skipped: the structured outputs demo needs llguidance: pip install "deepinfer-components[structured]"'
        in r.stdout
    )
    assert (
        'the regex and choice requests are left out: pip install "deepinfer-components[structured]"'
        in r.stdout
    )
    assert f"{len(demo.NAMES) - 1} ran, 1 skipped" in r.stdout and "Traceback" not in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ demo / cli
def test_demo_selection() -> None:
    assert [s.name for s in demo.select(None)] == list(demo.NAMES)
    assert [s.name for s in demo.select(["eplb,kv", "kv"])] == ["kv", "eplb"]  # tour order, no repeats
    assert [s.name for s in demo.select(["KV"])] == ["kv"]
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['nonexistent'\]; choose from"):
        demo.select(["kv,nonexistent"])


def test_demo_run_summary_counts_failures(capsys: pytest.CaptureFixture[str]) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    def needs_plot() -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    secs = [
        demo.Section("a", "A", "what a shows", lambda: print("  hello")),
        demo.Section("b", "B", "b", boom),
        demo.Section("c", "C", "c", needs_plot),
    ]
    assert demo.run(secs) == 1
    out = capsys.readouterr().out
    assert "== [a] A" in out and "  hello" in out
    assert 'skipped: matplotlib is not installed: pip install "deepinfer-components[plot]"' in out
    assert "1 ran, 1 skipped (optional extra not installed), 1 failed" in out
    assert demo.run(secs[:1]) == 0


@pytest.mark.parametrize(
    "argv", [["demo", "--only", "nonexistent"], ["bench", "nonexistent"], ["frobnicate"], ["generate"]]
)
def test_cli_unknown_names_are_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_help_and_console_script(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["generate", "--help"], ["demo", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "--only" in out and "COMPONENT" in out
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    mod, fn = scripts["deepinfer"].split(":")
    assert mod == "deepinfer_core.cli" and fn == "main"
    # every benchmark script of the tree is reachable
    assert set(cli.bench_scripts()) == {
        p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")
    }


def test_console_script_installed() -> None:
    # pip writes the console script from [project.scripts]; `make test` / `make demo` install it.
    from importlib.metadata import entry_points

    (ep,) = entry_points(group="console_scripts", name="deepinfer")
    assert ep.value == "deepinfer_core.cli:main"
    exe = Path(sys.executable).parent / "deepinfer"
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("deepinfer-components "), r.stderr


def test_cli_demo_list_and_python_m() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_core", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()] == list(demo.NAMES)
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_core", "demo", "--only", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "unknown section" in r.stderr


def test_cli_generate_prints_readable_text() -> None:
    # Whatever the built-in weights, the printed completion holds no raw control bytes.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer_core",
            "generate",
            "Hello",
            "\x1b[31mred",
            "--max-tokens",
            "8",
            "-v",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert is_safe(r.stdout) and r.stdout.count("== ") == 2
    assert "8 tokens" in r.stderr or "finish_reason=stop" in r.stderr


def test_cli_bench_outside_a_checkout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "scheduler"])
    assert e.value.code == 2 and "not in the installed package" in capsys.readouterr().err


def test_cli_bench_runs_a_benchmark() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_core", "bench", "mtp_varlen", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout
