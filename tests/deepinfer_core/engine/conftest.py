"""Engine tests run torch on one thread: the tiny model's steps are dispatch-bound, and CI runs two
pytest workers on two cores, so more threads only contend. The previous setting is restored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
