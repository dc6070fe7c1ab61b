"""Fixtures of the model tests: one thread (2-core CI with 2 workers), seeded tiny models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.executor import ModelExecutor
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


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every executor made in the test gets prefill tiles of 5 queries and pieces of a few rows, so each
    request spans many of both (set on the executor: the switches are its state's fields, a class
    attribute would shadow them without reaching the state)."""
    init = ModelExecutor.__init__

    def small(self: ModelExecutor, *args: object, **kw: object) -> None:
        init(self, *args, **kw)  # type: ignore[arg-type]
        self.prefill_tile, self.prefill_budget = 5, 40_000

    monkeypatch.setattr(ModelExecutor, "__init__", small)
