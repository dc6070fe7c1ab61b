"""``python -m deepinfer_core``: the main job (the demo, :mod:`deepinfer_core.demo`) when called with no
command; ``python -m deepinfer_core generate|demo|bench ...`` is the ``deepinfer`` command
(:mod:`deepinfer_core.cli`)."""

import sys

from deepinfer_core.cli import main

# the demo's own options, which `python -m deepinfer_core --only kv` takes without the word "demo"
DEMO_OPTIONS = ("--only", "--list", "-v", "--verbose", "--debug")


def _argv(argv: list[str]) -> list[str]:
    # No command (or only demo options such as --only kv): the demo, as before the CLI existed; anything
    # else goes to the command as given (so an unknown option is said as such).
    if not argv or argv[0].split("=")[0] in DEMO_OPTIONS:
        return ["demo", *argv]
    return argv


if __name__ == "__main__":
    raise SystemExit(main(_argv(sys.argv[1:])))
