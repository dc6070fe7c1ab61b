"""The ``deepinfer`` command end to end (issue #35): every subcommand and option with good and bad input.

The contract: a bad command line exits 2, a failure while running exits 1; either prints exactly one line
on stderr (``deepinfer[ SUBCOMMAND]: error: ...``), never a traceback unless ``--debug``, never the same
error twice; printed model text holds no U+FFFD and no raw control bytes.

Oracles: the constraint itself (``re.fullmatch``, ``jsonschema``, membership) for constrained outputs;
exit codes and line counts for errors. Usage errors run in-process (fast); the rest run the real command
in a fresh interpreter. Missing extras are simulated with a ``sitecustomize`` on PYTHONPATH that refuses
the optional packages, so child processes (``deepinfer bench`` runs a script) see the same install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import cli
from deepinfer_core.display import is_safe, printable_completion
from deepinfer_core.model.checkpoint import TINY_DIR

ROOT = Path(__file__).resolve().parents[1]
TRACE = "Traceback (most recent call last)"

SITE = """
import importlib.abc, sys
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Refuse())
"""


def run(
    *argv: str, blocked: tuple[str, ...] = (), tmp: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if blocked:
        assert tmp is not None
        (tmp / "sitecustomize.py").write_text(SITE.format(blocked=set(blocked)))
        env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "deepinfer_core", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def one_error_line(err: str, prog: str = "deepinfer generate") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert TRACE not in err
    return lines[0]


# ------------------------------------------------------------------------------ usage errors: exit 2
BAD_USAGE = [
    (["--bogus"], "deepinfer", "unknown option --bogus"),
    ([], "deepinfer", "a COMMAND is required"),
    (["frobnicate"], "deepinfer", "invalid choice: 'frobnicate'"),
    (["generate"], "deepinfer generate", "required: PROMPT"),
    (["generate", ""], "deepinfer generate", "PROMPT 1 is empty"),
    (["generate", "a", ""], "deepinfer generate", "PROMPT 2 is empty"),
    (["generate", "x", "--bogus"], "deepinfer generate", "unknown option --bogus"),
    (["generate", "x", "--max-tokens", "0"], "deepinfer generate", "--max-tokens: 0 must be in [1, "),
    (
        ["generate", "x", "--max-tokens", "many"],
        "deepinfer generate",
        "--max-tokens: invalid int value: 'many'",
    ),
    (["generate", "x", "--temperature", "-1"], "deepinfer generate", "--temperature: -1.0 must be >= 0"),
    (["generate", "x", "--temperature", "nan"], "deepinfer generate", "--temperature: nan must be finite"),
    (["generate", "x", "--top-p", "1.5"], "deepinfer generate", "--top-p: 1.5 must be in (0, 1]"),
    (["generate", "x", "--seed", "-3"], "deepinfer generate", "--seed: -3 must be in [0, "),
    (["generate", "x", "--threads", "0"], "deepinfer generate", "--threads: 0 must be >= 1"),
    (["generate", "x", "--json-schema", "{bad"], "deepinfer generate", "--json-schema: not valid JSON"),
    (["generate", "x", "--json-schema", "[1, 2]"], "deepinfer generate", "--json-schema: "),
    (["generate", "x", "--regex", ""], "deepinfer generate", "--regex: must not be empty"),
    (["generate", "x", "--regex", "a", "--choice", "b"], "deepinfer generate", "at most one of"),
    (["generate", "x", "--choice", ",,"], "deepinfer generate", "--choice: give one or more"),
    (
        ["generate", "x", "--model", "/nonexistent/path"],
        "deepinfer generate",
        "--model: '/nonexistent/path': not a built-in model",
    ),
    (["demo", "--only", "nope"], "deepinfer demo", "--only: unknown section(s) ['nope']"),
    (["demo", "--bogus"], "deepinfer demo", "unknown option --bogus"),
    (["bench"], "deepinfer bench", "required: COMPONENT"),
    (["bench", "nope"], "deepinfer bench", "unknown benchmark 'nope'"),
]


@pytest.mark.parametrize(
    ("argv", "prog", "msg"), BAD_USAGE, ids=[" ".join(a) or "(none)" for a, _, _ in BAD_USAGE]
)
def test_bad_command_lines_exit_2_with_one_line(
    argv: list[str], prog: str, msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    line = one_error_line(err, prog)
    assert msg in line, line
    assert line.endswith(f"(see '{prog} --help')") and out == ""


def test_checkpoint_dir_lacking_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "x", "--model", str(tmp_path)])
    assert e.value.code == 2
    assert f"--model: tokenizer.json: missing from checkpoint directory {tmp_path}" in one_error_line(
        capsys.readouterr().err
    )


def test_usage_errors_end_to_end() -> None:
    # the real command, as a user types it: exit code and stderr as in-process
    for argv, msg in (
        (["--bogus"], "deepinfer: error: unknown option --bogus"),
        (["generate", ""], "deepinfer generate: error: PROMPT 1 is empty"),
        (["generate", "x", "--model", "/nonexistent/path"], "--model: '/nonexistent/path'"),
    ):
        r = run(*argv)
        assert r.returncode == 2, r.stderr
        line = one_error_line(r.stderr, "deepinfer generate" if argv[0] == "generate" else "deepinfer")
        assert msg in line and r.stdout == ""


# ------------------------------------------------------------------------------ generate: each option
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("option", ["--json-schema", "--regex", "--choice"])
def test_generate_each_constraint(option: str) -> None:
    import jsonschema

    value = {
        "--json-schema": json.dumps(SCHEMA),
        "--regex": r"[0-9]{3}-[a-z]{2,4}",
        "--choice": "cat,dog,axolotl",
    }[option]
    r = run(
        "generate",
        "Answer: ",
        option,
        value,
        "--max-tokens",
        "60",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "-v",
    )
    assert r.returncode == 0, r.stderr
    text = r.stdout.rstrip("\n")
    assert "finish_reason=stop" in r.stderr and TRACE not in r.stderr
    if option == "--json-schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif option == "--regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value.split(","), text


def test_generate_plain_options_and_several_prompts() -> None:
    r = run(
        "generate",
        "def add(a, b):",
        "class Stack:",
        "--max-tokens",
        "6",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--threads",
        "2",
        "--echo",
        "-v",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("== ") == 2 and "== def add(a, b):\ndef add(a, b):" in r.stdout  # --echo repeats it
    assert r.stderr.count("finish_reason=") == 2 and is_safe(r.stdout)


def test_tiny_random_never_prints_a_replacement_character() -> None:
    # random weights over a byte vocabulary: bytes that are not UTF-8 come out; they print as \xNN
    prompts = ["Hello", "\u4e2d\u6587", "\x1b[31mred", "x"]
    r = run(
        "generate",
        *prompts,
        "--model",
        "tiny-random",
        "--max-tokens",
        "48",
        "--temperature",
        "1.0",
        "--seed",
        "5",
    )
    assert r.returncode == 0, r.stderr
    assert "\ufffd" not in r.stdout + r.stderr and is_safe(r.stdout)
    assert re.search(r"\\x[89a-f][0-9a-f]", r.stdout), r.stdout  # an undecodable byte, shown as its value


def test_printable_completion_shows_the_bytes() -> None:
    tb = [bytes([i]) for i in range(256)]
    ids = [*"héllo".encode(), 0xE4, 0xB8]  # ends inside a 3-byte sequence
    text = bytes(ids).decode("utf-8", errors="replace")
    assert printable_completion(text, ids, tb) == "héllo\\xe4\\xb8"
    # text that is not the tokens' bytes (a stop string cut it): U+FFFD escaped, never printed
    assert printable_completion("a\ufffd", [ord("a")], tb) == "a\\ufffd"


# ------------------------------------------------------------------------------ runtime errors: exit 1
def test_a_failed_request_is_one_line_exit_1() -> None:
    r = run("generate", "x", "--regex", "[unclosed")
    assert r.returncode == 1
    line = one_error_line(r.stderr)  # once: not also as the engine's warning log line
    assert "could not compile the regex" in line and r.stdout == ""
    r = run("generate", "ok", "x", "--regex", "[unclosed", "--max-tokens", "4")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2 and TRACE not in r.stderr
    assert lines[0].startswith("deepinfer generate: error: prompt 1 ('ok'): ")
    assert lines[1].startswith("deepinfer generate: error: prompt 2 ('x'): ")


def _checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(TINY_DIR, d)
    return d


def test_llama_config_is_an_unsupported_architecture(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "max_position_embeddings": 8192,
            }
        )
    )
    r = run("generate", "x", "--model", str(d))
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert str(d / "config.json") in line
    assert (
        "unsupported architecture (model_type 'llama'" in line and "this library runs DeepSeek-V4.1" in line
    )
    r = run("generate", "x", "--model", str(d), "--debug")  # --debug: the traceback, for a bug report
    assert r.returncode == 1 and TRACE in r.stderr and "ConfigError" in r.stderr


def test_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path)
    f = d / "model.safetensors"
    if not f.exists():  # a sharded checkpoint: truncate its first shard
        f = sorted(d.glob("*.safetensors"))[0]
    data = f.read_bytes()
    for cut in (100, len(data) // 2):
        f.write_bytes(data[:cut])
        r = run("generate", "x", "--model", str(d))
        assert r.returncode == 1
        line = one_error_line(r.stderr)
        assert str(f) in line and "not a readable safetensors file" in line, line


def test_missing_structured_extra_fails_before_any_work(tmp_path: Path) -> None:
    r = run("generate", "x", "--choice", "a,b", blocked=("llguidance", "xgrammar"), tmp=tmp_path)
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert line.endswith('needs llguidance: pip install "deepinfer-components[structured]"'), line
    # without a grammar option the same install generates
    r = run("generate", "x", "--max-tokens", "3", blocked=("llguidance", "xgrammar"), tmp=tmp_path)
    assert r.returncode == 0, r.stderr


def test_missing_extra_is_checked_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import deepinfer_core.engine as engine
    import deepinfer_core.structured.engines as structured

    def no_model(*a: object, **k: object) -> None:
        raise AssertionError("the model was loaded before the missing extra was reported")

    monkeypatch.setattr(structured, "available_engines", lambda: ())
    monkeypatch.setattr(engine, "LLM", no_model)
    assert cli.main(["generate", "x", "--regex", "a+"]) == 1
    assert 'pip install "deepinfer-components[structured]"' in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------ demo and bench
def test_demo_list_and_a_section() -> None:
    r = run("demo", "--only", "kv,spec")
    assert r.returncode == 0, r.stderr
    assert "2 ran, 0 skipped" in r.stdout and TRACE not in r.stdout + r.stderr and "\ufffd" not in r.stdout


def test_bench_plot_without_matplotlib_fails_up_front(tmp_path: Path) -> None:
    r = run("bench", "mtp_varlen", "--quick", "--plot", blocked=("matplotlib",), tmp=tmp_path)
    assert r.returncode == 1
    err = [ln for ln in r.stderr.splitlines() if not ln.startswith("$ ")]  # the command line echo
    assert len(err) == 1 and TRACE not in r.stderr, r.stderr
    assert err[0].endswith('needs matplotlib: pip install "deepinfer-components[plot]"'), err
    assert r.stdout == ""  # no measurement ran


def test_bench_runs_with_its_arguments() -> None:
    r = run("bench", "mtp_varlen", "--quick")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert rows and all({"bench", "metric", "value"} <= set(row) for row in rows)


def test_json_schema_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "schema.json"
    f.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        )
    )
    assert cli.main(["generate", "Reply: ", "--json-schema", f"@{f}", "--max-tokens", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] in (True, False)
    for value, msg in (
        (f"@{tmp_path / 'none.json'}", "--json-schema: cannot read"),
        ("@" + str(tmp_path), "cannot read"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "x", "--json-schema", value])
        assert e.value.code == 2 and msg in one_error_line(capsys.readouterr().err)
    f.write_text("{oops")
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--json-schema", f"@{f}"])
    assert f"--json-schema ({f}): not valid JSON" in one_error_line(capsys.readouterr().err)


def test_a_failed_demo_section_is_one_line(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepinfer_core import demo

    def boom() -> None:
        raise RuntimeError("boom\nsecond line")

    secs = [demo.Section("a", "A", "a", boom)]
    assert demo.run(secs) == 1
    out = capsys.readouterr().out
    assert "  FAILED: RuntimeError: boom second line (--debug shows the traceback)" in out
    assert TRACE not in out + caplog.text
    assert demo.run(secs, debug=True) == 1 and "Traceback" in caplog.text  # --debug: logged with it
