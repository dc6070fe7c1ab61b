"""deepinfer_core.model: a torch DeepSeek-V4.1-Flash-architecture model and its cached executor.

Imports are lazy so ``import deepinfer_core.model.config`` does not pay for torch model code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatchError",
    "ConfigError",
    "DeepSeekV41",
    "ForwardBatch",
    "ForwardOutput",
    "ModelConfig",
    "ModelExecutor",
    "WeightsError",
    "flash_config",
    "load_weights",
    "save_weights",
    "tiny_config",
]

_WHERE = {
    "BatchError": "batch",
    "WeightsError": "weights",
    "ConfigError": "config",
    "ModelConfig": "config",
    "flash_config": "config",
    "tiny_config": "config",
    "DeepSeekV41": "model",
    "ForwardBatch": "batch",
    "ForwardOutput": "batch",
    "ModelExecutor": "executor",
    "load_weights": "weights",
    "save_weights": "weights",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"deepinfer_core.model.{_WHERE[name]}"), name)
    raise AttributeError(name)
