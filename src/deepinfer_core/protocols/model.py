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

        ``deepinfer_core.model.ForwardBatch``: request i feeds ``query_lens[i]`` tokens starting at
        position ``start_pos[i]`` (a smaller start than last time rolls back rejected tokens, within the
        executor's backtracking budget); ``block_tables`` / ``state_slots`` come from the KV block pool
        and the state pool. Returns a ``ForwardOutput``: logits for the last ``num_logits[i]`` rows of
        each request, per-layer per-expert token counts and, when a drafter is configured (part 2),
        drafts with their confidences. An invalid request raises ``BatchError`` naming the request and
        field before any cache is written, so the rest of the batch can be rerun without it.
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
