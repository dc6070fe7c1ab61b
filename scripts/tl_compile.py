"""Compile TileLang kernels for the H200 (sm_90a) on a machine without a GPU, and report ptxas's register and
spill counts: a check that a kernel lowers (layout inference, fragment partitioning, shared memory) and
fits before any device time is spent on it. Needs tilelang (0.1.15, as the device site archive) and nvcc
in a Python environment where ``torch.cuda`` is absent; the cuda op package refuses to import without a
device, so its modules are loaded here without that guard.

    python -m venv /tmp/tlvenv && /tmp/tlvenv/bin/pip install torch==2.13.0 tilelang==0.1.15 \\
        apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0 torch-c-dlpack-ext numpy
    DEEPINFER_TL_ARCH=sm_90a PYTHONPATH=src /tmp/tlvenv/bin/python scripts/tl_compile.py [--only NAME]

Prints one JSON line per kernel: name, key, compile seconds, registers, spill bytes (ptxas -v on the
generated source, sm_90a). ``--grouped-sweep``: instead, every candidate configuration of the grouped
expert GEMM (``grouped_gemm.CANDIDATES``) for the wide config's three shapes (``grouped_gemm.SWEEP_SHAPES``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

log = logging.getLogger("tl_compile")
ROOT = Path(__file__).resolve().parents[1]

# (name, module, builder arguments): representative shapes of the wide / Flash config
KERNELS = [
    ("sink_attention_rows", "sink_attention", (640, 512**-0.5, "bfloat16")),  # window 128 + top-k 512
    ("sink_attention_rows", "sink_attention", (128, 512**-0.5, "bfloat16")),  # an SWA-only layer
    ("mhc_sinkhorn", "mhc_sinkhorn", (4, 20)),
    ("indexer", "indexer", (32, 128, "bfloat16")),
    # the decode gathers as the default path launches them, then filling one [rows, 640, 512] key buffer:
    # the window (fp8 ring) then the top-k (fp4)
    ("kv_gather_lanes", "kv_kernels", ("fp8", 512, "bfloat16", 8, None)),
    ("kv_gather", "kv_kernels", ("fp4", 512, "bfloat16", False, 1, True, None)),
    ("kv_gather", "kv_kernels", ("mxfp4", 128, "bfloat16", False, 1, True, None)),
    ("kv_gather_lanes", "kv_kernels", ("fp8", 512, "bfloat16", 8, (128, 640, 0))),
    ("kv_gather", "kv_kernels", ("fp4", 512, "bfloat16", False, 1, True, (512, 640, 128))),
    # the wide config's expert products: gate / up packed (N = 2 x 2304, K = 5120), down (N = 5120, K = 2304)
    ("moe_grouped_gemm", "grouped_gemm", (8, 4608, 5120, "bfloat16")),
    ("moe_grouped_gemm", "grouped_gemm", (8, 5120, 2304, "bfloat16")),
    ("moe_grouped_gemm", "grouped_gemm", (1, 129280, 5120, "bfloat16")),  # the LM head, one group
]
BUILDERS = {"kv_gather_lanes": "_build_gather_lanes", "kv_gather": "_build_gather"}


def ptxas_usage(source: str) -> dict[str, int]:
    """(registers, spill store bytes) of the kernel source compiled for sm_90a by nvcc / ptxas."""
    import tilelang

    tl = Path(tilelang.__file__).parent
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "k.cu"
        cu.write_text(source)
        r = subprocess.run(
            [
                "nvcc",
                "-std=c++17",
                "-gencode",
                "arch=compute_90a,code=sm_90a",
                "-Xptxas",
                "-v",
                "-c",
                str(cu),
                "-o",
                str(Path(d) / "k.o"),
                f"-I{tl / 'src'}",
                f"-I{tl / '3rdparty/cutlass/include'}",
                "-DENABLE_BF16",
                "-w",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    text = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    if r.returncode:
        log.error("nvcc failed:\n%s", text[-2000:])
    return {"registers": int(regs[-1]) if regs else -1, "spill_store_bytes": int(spill[-1]) if spill else -1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="compile only the kernels of this op name")
    ap.add_argument(
        "--grouped-sweep", action="store_true", help="every moe_grouped_gemm candidate config instead"
    )
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.environ.setdefault("DEEPINFER_TL_ARCH", "sm_90a")  # sm_90a: warp-specialised kernels need it
    pkg = types.ModuleType("deepinfer_kernels.cuda")  # the op modules without the package's device guard
    pkg.__path__ = [str(Path(__import__("deepinfer_kernels").__file__).parent / "cuda")]
    sys.modules["deepinfer_kernels.cuda"] = pkg
    import importlib

    if a.grouped_sweep:
        grouped_sweep(importlib.import_module("deepinfer_kernels.cuda.grouped_gemm"))
        return
    for name, mod, args in KERNELS:
        if a.only and name != a.only:
            continue
        m = importlib.import_module(f"deepinfer_kernels.cuda.{mod}")
        from deepinfer_kernels.cuda._tl import compile_kernel, kernel_source

        key = (f"check-{name}", *args)
        t0 = time.perf_counter()
        build = getattr(m, BUILDERS.get(name, "_build"))
        compile_kernel(key, lambda build=build, args=args: build(*args))
        secs = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "kernel": name,
                    "args": list(args),
                    "compile_s": round(secs, 1),
                    **ptxas_usage(kernel_source(key)),
                }
            ),
            flush=True,
        )


def grouped_sweep(m: types.ModuleType) -> None:
    """One JSON line per (shape, candidate config) of the grouped GEMM: registers and spills, or the error."""
    for shape in m.SWEEP_SHAPES:
        for cfg in m.CANDIDATES:
            if not (cfg.valid() and cfg.takes(shape[1], shape[2])):
                continue
            t0 = time.perf_counter()
            row = {"kernel": "moe_grouped_gemm", "args": list(shape), "config": cfg.name()}
            try:
                kern = m._compile((*shape, "bfloat16", cfg))
            except Exception as e:  # report and go on: a config that does not lower is dropped from the sweep
                print(json.dumps({**row, "error": str(e)[-400:]}), flush=True)
                continue
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps({**row, **ptxas_usage(kern.get_kernel_source())}), flush=True)


if __name__ == "__main__":
    main()
