"""The main job: the reference engine generating with the built-in tiny model (no download), then a tour
of the components, each on a small realistic input, and a summary.

``deepinfer demo`` / ``python -m deepinfer_core``; ``--only kv,eplb`` runs the named sections (names:
``--list``). A section whose optional extra is not installed is skipped with a note saying what to install;
the run fails (exit 1) only if a section fails.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time
from collections.abc import Callable, Sequence

import attrs

from deepinfer_core.extras import missing_extra

log = logging.getLogger("deepinfer_core.demo")


@attrs.frozen
class Section:
    name: str  # what --only takes
    title: str
    shows: str  # one line: what the reader is looking at
    run: Callable[[], None]


def _build() -> None:
    from deepinfer_core import _C
    from deepinfer_core.envs import get_envs

    info = dict(_C.core.build_info())
    std = int(info.get("cplusplus", 0)) // 100 % 100  # 201703 -> C++17
    print(
        f"  C++ core deepinfer_core._C {getattr(_C, '__version__', '?')} ({info.get('compiler')}, C++{std}, release build: "
        f"{info.get('ndebug')}); components in C++: {', '.join(m for m in _C.submodules if m != 'core')}"
    )
    print(f"  DEEPINFER_* switches: {get_envs()}")


def _component(module: str) -> Callable[[], None]:
    # Each component ships deepinfer_core/<component>/demo.py with a demo() that prints its own result.
    def run() -> None:
        importlib.import_module(f"deepinfer_core.{module}.demo").demo()

    return run


SECTIONS: tuple[Section, ...] = (
    Section(
        "build",
        "build and switches",
        "the C++ core this tree built, and the engine's DEEPINFER_* switches",
        _build,
    ),
    Section(
        "engine",
        "reference engine: LLM.generate on the built-in tiny model",
        "the whole engine generating text: scheduler, KV pools, executor, grammar masks, sampler",
        _component("engine"),
    ),
    Section(
        "kv",
        "KV cache: byte accounting, pools, prefix sharing",
        "how many bytes a token costs in each cache format, and blocks shared between requests",
        _component("kv"),
    ),
    Section(
        "eplb",
        "EPLB: placing experts on GPUs for a skewed, drifting load",
        "moe_lb = the busiest GPU's load / the mean GPU's load: 1.0 is perfect balance",
        _component("eplb"),
    ),
    Section(
        "spec",
        "DSpark: how many drafts to verify (MTPVarlen)",
        "speculative decoding: verify fewer drafts when the batch is large; throughput figures are modelled",
        _component("spec"),
    ),
    Section(
        "scheduler",
        "step scheduler (C++)",
        "a cost model fitted from step times, then a burst of requests served one step ahead",
        _component("scheduler"),
    ),
    Section(
        "structured",
        "structured outputs: regex, JSON schema, EBNF",
        "random logits, masked by a grammar each step: every text matches its grammar",
        _component("structured"),
    ),
    Section(
        "engram",
        "Engram: n-gram hash tables",
        "n-gram ids hashed into prime-sized tables, and what the full model's tables weigh",
        _component("engram"),
    ),
    Section(
        "model",
        "model executor (tiny config)",
        "the V4.1-Flash architecture at toy size: cached decode equals the cache-free forward",
        _component("model"),
    ),
)
NAMES = tuple(s.name for s in SECTIONS)


def select(only: Sequence[str] | None) -> list[Section]:
    """Sections named in ``only`` (comma-separated items allowed), in the tour's order; all when empty.
    Unknown names raise ``ValueError`` listing the valid ones."""
    if not only:
        return list(SECTIONS)
    wanted = [w.strip().lower() for item in only for w in item.split(",") if w.strip()]
    bad = [w for w in wanted if w not in NAMES]
    if bad:
        raise ValueError(f"--only: unknown section(s) {bad}; choose from {list(NAMES)}")
    return [s for s in SECTIONS if s.name in wanted]


def run(sections: Sequence[Section], debug: bool = False) -> int:
    """Run the sections, print a summary; 1 if any failed (a missing optional extra is a skip). A failed
    section is one line (its error); ``debug`` logs its traceback too."""
    results: list[tuple[str, str, float]] = []
    t_all = time.perf_counter()
    for s in sections:
        print(f"== [{s.name}] {s.title}\n   ({s.shows})", flush=True)
        t0 = time.perf_counter()
        status = "ok"
        try:
            s.run()
        except Exception as e:
            extra = missing_extra(e)
            if extra is not None:
                print(f"  skipped: {extra}")
                status = "skipped"
            else:
                if debug:
                    log.exception("section %r failed", s.name)
                msg = " ".join(str(e).split())[:500]
                print(
                    f"  FAILED: {type(e).__name__}: {msg}"
                    + ("" if debug else " (--debug shows the traceback)")
                )
                status = "FAILED"
        results.append((s.name, status, time.perf_counter() - t0))
    total = time.perf_counter() - t_all
    print("== summary")
    print("  " + ", ".join(f"{n} {st} ({dt:.1f} s)" for n, st, dt in results))
    counts = {k: sum(1 for _, st, _ in results if st == k) for k in ("ok", "skipped", "FAILED")}
    print(
        f"  {counts['ok']} ran, {counts['skipped']} skipped (optional extra not installed), "
        f"{counts['FAILED']} failed, in {total:.1f} s"
    )
    return 1 if counts["FAILED"] else 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--only",
        action="append",
        metavar="SECTION[,SECTION]",
        help=f"run only these sections (repeatable or comma-separated): {', '.join(NAMES)}",
    )
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the components' INFO logs")
    ap.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="a failed section shows its traceback"
    )


def main_from_args(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:11s} {s.title}")
        return 0
    try:
        sections = select(args.only)
    except ValueError as e:
        ap.error(str(e))  # exits 2 with the usage line
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return run(sections, debug=bool(getattr(args, "debug", False)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="deepinfer demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(ap)
    return main_from_args(ap.parse_args(argv), ap)
