"""Fixtures of the model tests: one thread (2-core CI with 2 workers), seeded tiny models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.model import DeepSeekV41


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # small ops on a shared 2-core box: a second intra-op thread only adds contention (10x slower seen)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model64() -> DeepSeekV41:
    """Tiny config, fresh random weights, float64 (exactness tests)."""
    return DeepSeekV41.from_config(tiny_config(), seed=1234, dtype=torch.float64)
