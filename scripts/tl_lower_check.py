"""Lower and compile TileLang kernels for sm_90 on a machine without a GPU (no run, no correctness).

    /tmp/tl-venv/bin/python scripts/tl_lower_check.py kv_kernels:_build_store:fp8:512:bfloat16:True \\
        spec_verify:_build:5:129280 [--src-dir DIR]

Each spec is ``module:builder:arg:...`` under ``deepinfer_kernels.cuda``; integer-looking args become
ints, True / False bools. The interpreter needs tilelang (and nvcc on PATH); the project's ``_C``
extension is loaded by path from ``.venv`` (built for the same Python minor version), and
``torch.cuda.is_available`` is patched so ``deepinfer_kernels.cuda`` imports. Prints OK / FAIL per spec
and writes each kernel's CUDA source to ``--src-dir`` (default /tmp) for reading.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _prepare() -> None:
    os.environ.setdefault("DEEPINFER_TL_ARCH", "sm_90")
    import torch

    torch.cuda.is_available = lambda: True  # only to import the cuda package; nothing is launched
    sys.path.insert(0, str(ROOT / "src"))
    so = glob.glob(str(ROOT / ".venv/lib/python3*/site-packages/deepinfer_core/_C*.so"))
    if so:
        import deepinfer_core

        spec = importlib.util.spec_from_file_location("deepinfer_core._C", so[0])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deepinfer_core._C"] = mod
        spec.loader.exec_module(mod)
        deepinfer_core._C = mod  # type: ignore[attr-defined]


def _arg(a: str) -> object:
    if a in ("True", "False"):
        return a == "True"
    return int(a) if a.lstrip("-").isdigit() else a


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--src-dir", default="/tmp")
    args = ap.parse_args()
    _prepare()
    import tilelang

    from deepinfer_kernels.cuda import _tl

    bad = 0
    for spec in args.specs:
        mod, fn, *rest = spec.split(":")
        t0 = time.perf_counter()
        try:
            build = getattr(importlib.import_module(f"deepinfer_kernels.cuda.{mod}"), fn)
            kern = tilelang.compile(build(*[_arg(a) for a in rest]), target=_tl.target())
            src = kern.get_kernel_source()
            (Path(args.src_dir) / f"tl_{spec.replace(':', '_')}.cu").write_text(src)
            print(f"OK   {spec}  {time.perf_counter() - t0:.1f} s  {len(src)} chars")
        except Exception as e:  # report and go on: one bad kernel should not hide the others
            bad += 1
            print(f"FAIL {spec}: {type(e).__name__}: {str(e)[-2000:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
