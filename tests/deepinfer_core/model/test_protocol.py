"""The concrete executor satisfies its seam (runtime isinstance)."""

from __future__ import annotations

from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.protocols import ModelExecutor as ModelExecutorProtocol


def test_executor_satisfies_protocol(model64: DeepSeekV41) -> None:
    assert isinstance(ModelExecutor(model64, 8, 16, 2, quantize=False), ModelExecutorProtocol)
