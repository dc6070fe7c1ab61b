"""``python -m deepinfer_core``: the main job (the demo, :mod:`deepinfer_core.demo`) when called with no
command; ``python -m deepinfer_core generate|demo|bench ...`` is the ``deepinfer`` command
(:mod:`deepinfer_core.cli`)."""

import sys

from deepinfer_core.cli import COMMANDS, main


def _argv(argv: list[str]) -> list[str]:
    # No command (or only demo options such as --only kv): the demo, as before the CLI existed.
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        return ["demo", *argv]
    return argv


if __name__ == "__main__":
    raise SystemExit(main(_argv(sys.argv[1:])))
