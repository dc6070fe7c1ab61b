"""Make the loop-per-layer oracle importable as ``reference_greedy`` from this folder's tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
