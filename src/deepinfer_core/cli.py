"""The ``deepinfer`` command.

    deepinfer generate "Once upon a time" [--max-tokens 64] [--temperature 0.8 --seed 1] [--regex '...']
    deepinfer demo [--only kv,eplb] [--list]
    deepinfer bench scheduler [--quick] [--plot]      (from a source checkout: benchmarks/ is not in the wheel)
    deepinfer serve [--model tiny] [--port 8000]      (OpenAI-compatible HTTP server; the serve extra)

``python -m deepinfer_core`` with no arguments runs the demo (the main job); with arguments it is this
command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import deepinfer_core
from deepinfer_core import demo as demo_mod

__all__ = ["COMMANDS", "bench_scripts", "main"]

COMMANDS = ("generate", "demo", "bench", "serve")


# ----------------------------------------------------------------------------------------------- generate
def _generate(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    import logging

    from deepinfer_core.display import printable
    from deepinfer_core.engine import LLM
    from deepinfer_core.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    so = None
    given = [k for k in ("regex", "json_schema", "choice") if getattr(args, k) is not None]
    if len(given) > 1:
        ap.error(f"give at most one of --regex, --json-schema, --choice (got {given})")
    if args.regex is not None:
        so = {"regex": args.regex}
    elif args.json_schema is not None:
        try:
            so = {"json": json.loads(args.json_schema)}
        except json.JSONDecodeError as e:
            ap.error(f"--json-schema: not valid JSON ({e})")
    elif args.choice is not None:
        so = {"choice": [c for c in args.choice.split(",") if c]}
    try:
        sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, so_args=so)
    except ValueError as e:
        ap.error(str(e))
    llm = LLM(model=args.model, num_threads=args.threads)
    outs = llm.generate(args.prompts, sp, use_tqdm=False)
    failed = 0
    for p, o in zip(args.prompts, outs):
        if not o.ok:
            failed += 1
            print(f"error ({printable(p)!s}): {o.error}", file=sys.stderr)
            continue
        if len(args.prompts) > 1:
            print(f"== {printable(p)}")
        print(printable(p + o.text) if args.echo else printable(o.text))
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
        ap.error("the benchmarks are in the source tree (benchmarks/), not in the installed package: "
                 "run from a checkout of deepinfer-components")
    if args.component not in scripts:
        ap.error(f"unknown benchmark {args.component!r}; choose from {sorted(scripts)}")
    cmd = [sys.executable, str(scripts[args.component]), *args.bench_args]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.call(cmd)


# ----------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepinfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"deepinfer-components {deepinfer_core.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text with the built-in tiny model",
                       description="Generate with the reference engine (CPU, no download).")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--model", default="tiny", help="built-in model name (default: tiny)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads while generating (default 1: the tiny model is dispatch-bound)")
    g.add_argument("--regex", help="constrain the output to this regex (needs the structured extra)")
    g.add_argument("--json-schema", help="constrain the output to this JSON schema (a JSON string)")
    g.add_argument("--choice", help="constrain the output to one of these comma-separated strings")
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.add_argument("-v", "--verbose", action="store_true", help="token count and finish reason on stderr")
    g.set_defaults(func=_generate, parser=g)

    d = sub.add_parser("demo", help="the tour of every component (the main job)",
                       description=demo_mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_mod.add_arguments(d)
    d.set_defaults(func=lambda a, p: demo_mod.main_from_args(a, p), parser=d)

    b = sub.add_parser("bench", help="run benchmarks/COMPONENT.py (JSON lines on stdout)",
                       description="Run one component's benchmark from the source tree; the arguments after "
                                   "COMPONENT go to the script (e.g. --quick, --plot).")
    b.add_argument("component", metavar="COMPONENT", help=f"one of: {', '.join(bench_scripts()) or '(none here)'}")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.set_defaults(func=_bench, parser=b)

    from deepinfer_core.entrypoints.openai.api_server import (
        add_serve_parser,  # FastAPI is imported only to serve
    )

    add_serve_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    return int(args.func(args, args.parser))


if __name__ == "__main__":
    raise SystemExit(main())
