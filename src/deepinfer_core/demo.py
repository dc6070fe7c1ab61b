"""The main job: the reference engine generating with the built-in tiny model (no download), then a tour
of the components, each on a small realistic input.

Each section imports its component lazily and prints its result; ``--only TEXT`` runs the sections whose
title contains TEXT (e.g. ``--only engine``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

log = logging.getLogger("deepinfer_core.demo")

Section = Callable[[], None]
SECTIONS: list[tuple[str, Section]] = []


def section(title: str) -> Callable[[Section], Section]:
    def deco(fn: Section) -> Section:
        SECTIONS.append((title, fn))
        return fn

    return deco


@section("build and switches")
def _build() -> None:
    from deepinfer_core import _C
    from deepinfer_core.envs import get_envs

    print(f"  deepinfer_core._C {_C.__version__}: {dict(_C.core.build_info())}, submodules {list(_C.submodules)}")
    print(f"  {get_envs()}")


# Each component ships `deepinfer_core/<component>/demo.py` with a `demo()` that prints its own result.
COMPONENTS = (
    ("reference engine: LLM.generate on the built-in tiny model", "engine"),
    ("KV byte accounting, pools and prefix index", "kv"),
    ("EPLB on a skewed expert load", "eplb"),
    ("MTPVarlen verify plan (DSpark)", "spec"),
    ("step scheduler", "scheduler"),
    ("structured outputs", "structured"),
    ("Engram hashing and tables", "engram"),
    ("model executor (tiny config)", "model"),
)


def _component_section(module: str) -> Section:
    def run() -> None:
        import importlib

        importlib.import_module(f"deepinfer_core.{module}.demo").demo()

    return run


for _title, _module in COMPONENTS:
    SECTIONS.append((_title, _component_section(_module)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_core", description=__doc__)
    ap.add_argument("--only", help="run only sections whose title contains this text")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    failed = 0
    for title, fn in SECTIONS:
        if args.only and args.only not in title:
            continue
        print(f"== {title}")
        try:
            fn()
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("deepinfer_core"):
                raise
            print(f"  (not built yet: {e.name})")
        except Exception:
            log.exception("section %r failed", title)
            failed += 1
    return 1 if failed else 0
