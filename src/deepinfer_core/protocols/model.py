"""Seams of the model executor (``deepinfer_core.model``) and of the device backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelExecutor(Protocol):
    """Runs one step of the model over a flat batch of query tokens."""

    def execute(self, batch: Any) -> Any:
        """Forward a batch (flat tokens, per-request lengths, positions, block tables, state slots).

        Returns logits for the rows that need sampling, per-layer per-expert token counts and, when a
        drafter is configured, drafts with their confidences.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """A set of device ops: ``reference`` (torch, any device) or ``cuda`` (TileLang + DeepSeek libraries)."""

    @property
    def name(self) -> str:
        """'reference' or 'cuda'."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the backend's tensors live."""
        ...

    def op(self, name: str) -> Callable[..., Any]:
        """The implementation of op ``name``; the reference one when the backend has no specialised kernel."""
        ...
