"""The package builds, imports without heavy side effects, and the C++ core is this tree's."""

from __future__ import annotations

import subprocess
import sys


def test_extension_built_from_this_tree() -> None:
    from deepinfer_core import _C

    info = dict(_C.core.build_info())
    assert info["cplusplus"] >= 201703  # C++17 or newer
    assert info["ndebug"] is True  # release build (-O2 -DNDEBUG)
    assert "core" in list(_C.submodules)
    # A value the C++ computes, checked against Python's arithmetic on the boundary of int64.
    assert _C.core.add_i64(2**62, 2**62 - 1) == 2**63 - 1


def test_importing_packages_is_light() -> None:
    # Importing the top-level packages must not import tilelang or the optional libraries.
    code = (
        "import sys, deepinfer_core, deepinfer_core._C, deepinfer_kernels;"
        "bad=[m for m in ('tilelang','tile_kernels','xgrammar','llguidance','deep_gemm') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_main_job_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer_core"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "deepinfer_core._C" in out.stdout
