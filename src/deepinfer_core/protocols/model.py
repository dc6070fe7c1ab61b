"""Seams of the model executor (``deepinfer_core.model``) and of the device backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocols stay importable without torch
    import torch


@runtime_checkable
class SpecControl(Protocol):
    """The executor's drafter state, as the engine steers it (``model.speculative.SpecState``)."""

    #: called with (batch, logits) before verify / draft rows are verified, to mask them in place (the
    #: grammar's draft rows of structured requests); None: no masking
    logits_hook: Callable[[Any, torch.Tensor], None] | None
    #: state slot -> request seed; when every verifying / drafting row has one, verification is keyed by
    #: (seed, position) (batch-invariant sampled verification); None: the executor's generator
    counter_seeds: dict[int, int] | None


@runtime_checkable
class InvariantRows(Protocol):
    """An executor's optional batch-invariant products (``model.invariant``): the engine's
    ``batch_invariant`` mode runs a step batched on an executor that has them (``isinstance``), and request
    by request on one that does not."""

    #: rows per fixed-shape chunk of every row product (0: the mode is off)
    invariant_rows: int
    #: the most tokens a request may feed for the step to take the row path (a request must take the same
    #: path alone and in any batch: the engine cuts a step where its requests' paths change)
    backtrack: int
    #: where the executor runs (the mode's default chunk depends on it)
    device: torch.device


@runtime_checkable
class ModelExecutor(Protocol):
    """Runs one step of the model over a flat batch of query tokens, and keeps the per-sequence state the
    steps need (paged KV, SWA rings, token context) between them. These members are everything the engine
    uses of an executor (tests/test_protocols.py checks engine/ reads no other)."""

    #: the one-kernel decode paths (cuda backend); switches the engine may set between steps
    fused_attention: bool
    fused_moe: bool
    fused_head: bool
    #: the paged caches by KV source layer: main KV and indexer keys, uint8 [num_blocks, block_size, bytes]
    #: (the external KV store copies whole blocks of them)
    kv: dict[int, torch.Tensor]
    index_keys: dict[int, torch.Tensor]

    @property
    def sync_free(self) -> bool:
        """Whether decode steps run without host synchronisation (a backend on a CUDA device)."""
        ...

    @property
    def tok_ring(self) -> int:
        """Tokens of context kept per sequence (the n-gram context a restore or replay must pass)."""
        ...

    @property
    def token_feed_ok(self) -> bool:
        """Whether ``execute`` takes ``feed`` (input tokens still on the device) without waiting for them."""
        ...

    @property
    def engram_placement(self) -> str:
        """Where the Engram tables live: "local", "host" or "sharded"."""
        ...

    @property
    def spec(self) -> SpecControl | None:
        """The drafter state (None: this executor neither drafts nor verifies)."""
        ...

    def validate(self, batch: Any) -> None:
        """Raise ``BatchError`` naming the first bad request and field of ``batch``; touches nothing."""
        ...

    def execute(self, batch: Any, feed: Any = None) -> Any:
        """Forward a batch (flat tokens, per-request lengths, positions, block tables, state slots).

        ``deepinfer_core.batch.ForwardBatch``: request i feeds ``query_lens[i]`` tokens starting at
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
        field before any cache is written, so the rest of the batch can be rerun without it. ``feed``
        (``device_tokens.TokenFeed``): tokens of the batch that exist only on the device (the engine's
        asynchronous overlap; needs ``token_feed_ok``).
        """
        ...

    def resolve_fed(self, drop: bool = False) -> None:
        """Record device-fed tokens in the host token context once they are known (``drop``: forget them)."""
        ...

    def cache_bytes(self) -> dict[str, int]:
        """Device bytes held by each cache kind (the engine sizes its pool from two probe executors')."""
        ...

    def restore_encoder(self, slot: int, pos: int, rings: Any, context: Any) -> None:
        """Put persisted encoder SWA rings of a ``pos``-token prefix into ``slot`` (SWA bounded replay);
        ``context``: the tokens before ``pos``."""
        ...

    def replay_encoder(self, slot: int, token_ids: Any, start: int, block_table: Any, context: Any) -> None:
        """Rebuild ``slot``'s encoder rings by running ``token_ids`` (from ``start``) through the encoder over
        the cached blocks of ``block_table``, writing no block."""
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
