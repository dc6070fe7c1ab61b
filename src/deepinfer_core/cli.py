"""The ``deepinfer`` command.

    deepinfer generate "Once upon a time" [--max-tokens 64] [--temperature 0.8 --seed 1] [--regex '...']
    deepinfer generate 'The answer: ' --json-schema '{"type": "object", ...}'  (or --choice yes,no)
    deepinfer demo [--only kv,eplb] [--list]
    deepinfer bench scheduler [--quick] [--plot]      (from a source checkout: benchmarks/ is not in the wheel)
    deepinfer serve [--model tiny] [--port 8000]      (OpenAI-compatible HTTP server; the serve extra)

Errors are one line on stderr: exit 2 for a bad command line (unknown option, bad value), exit 1 for a
failure while running (a checkpoint that does not load, a missing extra, a request that failed); no
traceback unless ``--debug``. ``python -m deepinfer_core`` with no arguments runs the demo (the main job);
with arguments it is this command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import deepinfer_core
from deepinfer_core import demo as demo_mod

__all__ = ["COMMANDS", "bench_scripts", "main"]

COMMANDS = ("generate", "demo", "bench", "serve")


def one_line(msg: object) -> str:
    """A message on one line: inner newlines and runs of whitespace become single spaces."""
    return " ".join(str(msg).split())


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2): the message and where to look for the usage, not the whole
    usage block; unknown options are said as such."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            extra = message.removeprefix("unrecognized arguments: ").split()
            opts = [a for a in extra if a.startswith("-")]
            message = (
                f"unknown option{'s' if len(opts) > 1 else ''} {', '.join(opts)}"
                if opts
                else f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(extra)}"
            )
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the subcommand that was given them (its usage is the one to read)
            owner = getattr(ns, "parser", None) or self
            owner.error("unrecognized arguments: " + " ".join(extras))
        return ns


# ----------------------------------------------------------------------------------------------- generate
def _grammar(args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict[str, Any] | None:
    """so_args from --regex / --json-schema / --choice (at most one), checked before the model loads."""
    given = [
        f"--{k.replace('_', '-')}" for k in ("regex", "json_schema", "choice") if getattr(args, k) is not None
    ]
    if len(given) > 1:
        ap.error(f"give at most one of --regex, --json-schema, --choice (got {', '.join(given)})")
    if args.regex is not None:
        if not args.regex:
            ap.error("--regex: must not be empty")
        so: dict[str, Any] = {"regex": args.regex}
    elif args.json_schema is not None:
        text, where = args.json_schema, ""
        if text.startswith("@"):  # @schema.json: the schema from a file
            where = f" ({text[1:]})"
            try:
                text = Path(text[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                ap.error(f"--json-schema: cannot read {text[1:]} ({getattr(e, 'strerror', None) or e})")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            ap.error(f"--json-schema{where}: not valid JSON ({e})")
        so = {"json_schema": schema}
    elif args.choice is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            ap.error("--choice: give one or more comma-separated strings, e.g. --choice yes,no")
        so = {"choice": choices}
    else:
        return None
    from deepinfer_core.structured import GrammarSpec, require_any_engine

    try:
        GrammarSpec.from_so_args(so)
    except ValueError as e:
        ap.error(f"{given[0]}: {e}")
    require_any_engine(f"{given[0]}")  # the one-line install hint, before the model loads (exit 1)
    return so


def _check_model(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    from deepinfer_core.model.checkpoint import CheckpointError, resolve_model

    try:
        resolve_model(args.model)
    except CheckpointError as e:
        ap.error(f"--model: {str(e).removeprefix('model=')}")


def _generate(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    from deepinfer_core.display import printable, printable_completion
    from deepinfer_core.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    for i, p in enumerate(args.prompts):
        if not p:
            ap.error(
                f"PROMPT {i + 1} is empty: give the text to continue, e.g. deepinfer generate 'def main():'"
            )
    try:
        sp = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            so_args=_grammar(args, ap),
        )
    except ValueError as e:  # "SamplingParams.max_tokens: ..." is said as "--max-tokens: ..."
        field, _, why = str(e).removeprefix("SamplingParams.").partition(": ")
        ap.error(f"--{field.replace('_', '-')}: {why}" if why else str(e))
    if args.threads < 1:
        ap.error(f"--threads: {args.threads} must be >= 1")
    _check_model(args, ap)
    # The CLI reports each failed request itself (below): the engine's own warning about it would print
    # the same error twice. -v shows the engine's logs (every engine module's logger is under this one).
    logging.getLogger("deepinfer_core.engine").setLevel(logging.INFO if args.verbose else logging.ERROR)
    from deepinfer_core.engine import LLM

    llm = LLM(model=args.model, num_threads=args.threads)
    outs = llm.generate(args.prompts, sp, use_tqdm=False)
    token_bytes = llm.engine.tokenizer.token_bytes()
    failed = 0
    for i, (p, o) in enumerate(zip(args.prompts, outs)):
        if not o.ok:
            failed += 1
            where = f"prompt {i + 1} ({printable(p[:40])!r}): " if len(args.prompts) > 1 else ""
            print(f"{ap.prog}: error: {where}{one_line(o.error)}", file=sys.stderr)
            continue
        if len(args.prompts) > 1:
            print(f"== {printable(p)}")
        text = printable_completion(o.text, o.token_ids, token_bytes)
        print(printable(p) + text if args.echo else text)
        if args.verbose:
            print(f"   ({len(o.token_ids)} tokens, finish_reason={o.finish_reason})", file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------- bench
def _benchmarks_dir() -> Path | None:
    """benchmarks/ of the source tree this package runs from (editable install or a checkout on
    ``sys.path``), else ./benchmarks; None if neither has one."""
    here = Path(deepinfer_core.__file__).resolve().parent  # .../src/deepinfer_core in a checkout
    for cand in (here.parents[1] / "benchmarks", Path(os.getcwd()) / "benchmarks"):
        if (cand / "_common.py").is_file():
            return cand
    return None


def bench_scripts() -> dict[str, Path]:
    """Component name -> its benchmark script (``benchmarks/<component>.py``); empty outside a checkout."""
    d = _benchmarks_dir()
    if d is None:
        return {}
    return {p.stem: p for p in sorted(d.glob("*.py")) if not p.name.startswith("_")}


def _bench(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    scripts = bench_scripts()
    if not scripts:
        ap.error(
            "the benchmarks are in the source tree (benchmarks/), not in the installed package: "
            "run from a checkout of deepinfer-components"
        )
    if args.component not in scripts:
        ap.error(f"unknown benchmark {args.component!r}; choose from {sorted(scripts)}")
    cmd = [sys.executable, str(scripts[args.component]), *args.bench_args]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.call(cmd)


# ----------------------------------------------------------------------------------------------- main
def _add_debug(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="show the full traceback of an error (and the components' debug logs)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="deepinfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--version", action="version", version=f"deepinfer-components {deepinfer_core.__version__}"
    )
    _add_debug(ap, False)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    # (not required=True: argparse would then report a missing COMMAND before an unknown option)
    nodebug = argparse.SUPPRESS  # a subcommand's --debug must not reset the top-level one

    g = sub.add_parser(
        "generate",
        help="generate text with the built-in tiny model",
        description="Generate with the reference engine (CPU, no download).",
    )
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the shipped trained checkpoint, default), 'tiny-random' or a checkpoint directory",
    )
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    g.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads while generating (default 1: the tiny model is dispatch-bound)",
    )
    g.add_argument("--regex", help="constrain the output to this regex (needs the structured extra)")
    g.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="constrain the output to this JSON schema: a JSON string, or @FILE (structured extra)",
    )
    g.add_argument(
        "--choice", help="constrain the output to one of these comma-separated strings (structured extra)"
    )
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.add_argument("-v", "--verbose", action="store_true", help="token count and finish reason on stderr")
    _add_debug(g, nodebug)
    g.set_defaults(func=_generate, parser=g)

    d = sub.add_parser(
        "demo",
        help="the tour of every component (the main job)",
        description=demo_mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_mod.add_arguments(d)  # --debug included
    d.set_defaults(func=lambda a, p: demo_mod.main_from_args(a, p), parser=d)

    b = sub.add_parser(
        "bench",
        help="run benchmarks/COMPONENT.py (JSON lines on stdout)",
        description="Run one component's benchmark from the source tree; the arguments after "
        "COMPONENT go to the script (e.g. --quick, --plot).",
    )
    b.add_argument(
        "component", metavar="COMPONENT", help=f"one of: {', '.join(bench_scripts()) or '(none here)'}"
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.set_defaults(func=_bench, parser=b)

    from deepinfer_core.entrypoints.openai.api_server import (
        add_serve_parser,  # FastAPI is imported only to serve
    )

    add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse's usage errors exit 2 through SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.error(f"a COMMAND is required: one of {', '.join(COMMANDS)}")
    debug = bool(getattr(args, "debug", False))
    if debug:  # before the subcommand's own logging set-up, which then keeps it
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args, args.parser))
    except KeyboardInterrupt:
        print(f"{args.parser.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        # the library's errors name the file / field; anything else also names its type
        known = isinstance(e, ValueError | OSError | ImportError | LookupError | TypeError)
        what = (
            one_line(e)
            if known
            else f"{type(e).__name__}: {one_line(e)} (run with --debug for the traceback)"
        )
        print(f"{args.parser.prog}: error: {what}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
