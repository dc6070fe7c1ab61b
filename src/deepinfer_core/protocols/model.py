"""Seams of the model executor (``deepinfer_core.model``) and of the device backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocols stay importable without torch
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
        each request and per-layer per-expert token counts. With a drafter (DSpark), a request may
        verify the drafts the executor made last step (``verify_lens[i]``: its last fed tokens, checked
        losslessly against this step's logits) and ask for new ones (``draft[i]``): the output then
        carries ``num_accepted``, ``next_token`` (fed next at ``start + query_len - verify_len +
        num_accepted``), up to ``dspark_block_size`` (5) ``drafts`` and their ``draft_confidence``
        (each draft's acceptance probability given the earlier ones were accepted: the input of
        the spec component's MTPVarlen). An invalid request raises ``BatchError`` naming the request and
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
