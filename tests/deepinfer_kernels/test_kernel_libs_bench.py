"""benchmarks/kernel_libs.py's host side: the cases and byte counts it times (any machine, --dry-run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_libs.py"


def test_dry_run_cases_and_bytes() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--batches", "1,64", "--context", "4096"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and all(r["bench"] == "kernel_libs" for r in rows)
    gemm = {
        (r["params"]["impl"], r["params"]["batch"], r["params"]["part"]): r["value"]
        for r in rows
        if r["params"]["section"] == "gemm"
    }
    # B = 64, gate+up: 8 experts x 4608 x 5120 weights; bf16 2 bytes each, FP8 1 byte + a scale per 128 x 128
    w = 8 * 4608 * 5120
    x, y = 384 * 5120, 384 * 4608
    assert gemm[("bf16", 64, "gate_up")] == 2 * w + 2 * x + 2 * y
    assert gemm[("fp8", 64, "gate_up")] == w + 8 * 36 * 40 * 4 + x + 384 * 40 * 4 + 2 * y
    topk = [r for r in rows if r["params"]["section"] == "topk"]
    assert {r["params"]["use"] for r in topk} == {"indexer", "sampling", "indexer_prefill"}


def test_without_cuda_it_reports_a_skip() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark runs instead")
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, check=True, timeout=120
    )
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row["metric"] == "skipped" and "CUDA" in row["unit"]
