"""Helpers for the tests of an executor flag that routes a decode-step product through a backend op: the
reference backend with that op recorded, and a greedy decode on it with the flags set (CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_kernels import get_backend
from tests.deepinfer_core.model.session import Session
from tests.deepinfer_core.model.test_cuda_graphs import _greedy


class SpyBackend:
    """The reference backend, with ``record(*args)`` called before each call of op ``name``."""

    def __init__(self, name: str, record: Callable[..., Any]) -> None:
        self.name, self.record, self.ref = name, record, get_backend("reference")

    def op(self, name: str) -> Callable[..., Any]:
        fn = self.ref.op(name)
        if name != self.name:
            return fn
        return lambda *a: (self.record(*a), fn(*a))[1]


def reference_decode(
    model: Any, prompts: dict[int, torch.Tensor], steps: int, drop_at: int, backend: Any, **flags: bool
) -> tuple[list, list]:
    """:func:`_greedy` on a sync-free session of ``model`` whose executor uses ``backend`` and ``flags``."""
    s = Session(model, quantize=True, num_blocks=128, block_size=16, slots=4)
    s.ex.backend, s.ex.sync_free = backend, True
    for k, v in flags.items():
        setattr(s.ex, k, v)
    return _greedy(s, prompts, steps, drop_at)
