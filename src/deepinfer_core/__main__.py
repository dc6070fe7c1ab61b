"""``python -m deepinfer_core``: the main job (see :mod:`deepinfer_core.demo`)."""

from deepinfer_core.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
