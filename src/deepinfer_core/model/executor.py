"""ModelExecutor: one step of the model over a flat batch, with KV kept in the executor's caches.

The caller (engine, tests) owns the bookkeeping: block ids from the KV block pool, one state slot per
sequence from the state pool, and each request's start position. The executor owns the device tensors
(see :mod:`deepinfer_core.model.cache`) and writes every new KV through the byte formats before reading
it back, so the attention sees exactly what a later step will see.

Per layer the dense work (projections, MoE) runs on all rows at once. A step runs one of two paths, both
through the one attention dispatch (:mod:`~deepinfer_core.model.attend`): the row path
(:mod:`~deepinfer_core.model.decode_step`: decode / verify steps, every row at once, graph replay on CUDA)
and the per-request path (:mod:`~deepinfer_core.model.prefill`: prefill chunks, each request's window,
compressed entries and top-k of its own).

The state the steps share is one typed :class:`~deepinfer_core.model.state.ExecutorState` (caches, rings,
per-slot floors, switches), passed explicitly to the modules that run them: ``validation`` (the batch
rules), ``engram_context`` (the token ring, Engram rows), ``prefill``, ``decode_step``, ``cuda_graphs``
and ``replay`` (SWA bounded replay: snapshots, restores, block copies). Part 2 state, per slot and indexed
by position like the SWA rings: the recent tokens (Engram n-gram context across steps) and, with a
drafter, the drafter's context rings and last drafts (:mod:`deepinfer_core.model.speculative`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Generic, TypeVar, overload

import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed
from deepinfer_core.model import replay, validation
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.cache import CacheFormats
from deepinfer_core.model.config import ModelConfig
from deepinfer_core.model.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs, check_buckets
from deepinfer_core.model.decode_step import execute_rows
from deepinfer_core.model.engram_context import engram_fetch, make_engram_tables, resolve_fed
from deepinfer_core.model.fused_kernels import kernel_defaults
from deepinfer_core.model.invariant import PREFILL_FACTOR, row_chunked
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.prefill import execute_requests
from deepinfer_core.model.speculative import SpecState
from deepinfer_core.model.state import ExecutorState, make_state
from deepinfer_core.protocols.engram import EngramTable
from deepinfer_core.protocols.model import Backend

__all__ = ["ExecutorState", "ModelExecutor", "make_engram_tables"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _StateField(Generic[T]):
    """An executor attribute that is the field of the same name of its :class:`ExecutorState` (one
    source of truth: the modules that run the steps read the state, users set the executor)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _StateField[T]: ...
    @overload
    def __get__(self, obj: ModelExecutor, owner: type) -> T: ...
    def __get__(self, obj: ModelExecutor | None, owner: type) -> T | _StateField[T]:
        return self if obj is None else getattr(obj.state, self.name)

    def __set__(self, obj: ModelExecutor, value: T) -> None:
        setattr(obj.state, self.name, value)


class ModelExecutor:
    """Runs :class:`ForwardBatch` steps of ``model`` (satisfies ``protocols.ModelExecutor``).

    ``num_blocks`` / ``block_size`` must match the KV block pool whose tables the batches carry;
    ``num_state_slots`` the state pool. ``backtrack_tokens`` is how far a sequence may be rolled back
    (DEEPINFER_MAX_BACKTRACKING_TOKENS; default drafts + 1 = 6). ``quantize`` stores KV as FP4 (main),
    FP8 (SWA ring) and MXFP4 (indexer keys); off stores exact raw values. ``backend`` (a
    ``deepinfer_kernels`` Backend) routes the cache writes through its ``kv_store`` /
    ``swa_ring_write`` ops; None writes with plain torch indexing (the same bytes as the reference ops).
    ``engram_placement`` chooses where the Engram tables live: ``"local"`` (the model's tables, one
    device), ``"host"`` (host memory, rows copied per step) or ``"sharded"`` (row blocks over
    ``engram_group``, a torch.distributed group whose every rank runs the same steps' fetches). ``seed``
    seeds the sampling of drafts and of verification.

    With a backend on a CUDA device (``sync_free``), decode / verify steps run without host
    synchronisation (:mod:`~deepinfer_core.model.decode_step`), and with ``cuda_graphs`` pure-decode
    batches replay CUDA graphs captured per batch bucket (``cuda_graph_buckets``;
    :mod:`~deepinfer_core.model.cuda_graphs`); ``cuda_graphs=False`` (DEEPINFER_CUDA_GRAPHS=0) runs them
    eagerly. ``fuse_glue`` compiles the step's small per-token functions into fused kernels
    (:mod:`~deepinfer_core.model.fusion`, torch.compile; the first step of each new shape compiles).
    ``draft_context=False`` keeps no drafter context (no drafts or verification from this executor,
    and none of the drafter's per-step work) for a model that has a drafter.
    ``invariant_rows`` > 0 is the batch-invariant mode (:mod:`~deepinfer_core.model.invariant`; the engine's
    ``batch_invariant``): every row product of a step in fixed chunks of that many rows, so a row's logits
    are bitwise the same whatever else its batch holds, with the batch still one call.
    These attributes may be changed between steps. ``prefill_path`` ("varlen": every request of a prefill
    step at once, the default with a backend on a CUDA device; "tiled": request by request, the default
    elsewhere; "dense": the oracle), ``prefill_budget`` (bytes of intermediates per piece of prefill rows:
    512 MiB on CUDA, 32 MiB on the CPU), ``row_path``
    (False: decode steps on the per-request path too) and the kernel switches (``fused_attention``,
    ``fused_moe``, ``fused_head``, ``fused_sinkhorn``) likewise.

    The executor's caches and bookkeeping are one :class:`~deepinfer_core.model.state.ExecutorState`
    (:attr:`state`), which it hands to the modules that run its steps; the attributes above and the
    caches (``kv``, ``swa``, ...) are that object's fields, read and written through the executor.
    """

    model: _StateField[DeepSeekV41] = _StateField()
    cfg: _StateField[ModelConfig] = _StateField()
    device: _StateField[torch.device] = _StateField()
    dtype: _StateField[torch.dtype] = _StateField()
    fmt: _StateField[CacheFormats] = _StateField()
    backend: _StateField[Backend | None] = _StateField()
    num_blocks: _StateField[int] = _StateField()
    block_size: _StateField[int] = _StateField()
    num_slots: _StateField[int] = _StateField()
    backtrack: _StateField[int] = _StateField()
    swa_ring: _StateField[int] = _StateField()
    tok_ring: _StateField[int] = _StateField()
    min_ratio: _StateField[int] = _StateField()
    swa: _StateField[list[torch.Tensor]] = _StateField()
    kv: _StateField[dict[int, torch.Tensor]] = _StateField()
    index_keys: _StateField[dict[int, torch.Tensor]] = _StateField()
    comp_state: _StateField[dict[int, torch.Tensor]] = _StateField()
    comp_ring: _StateField[dict[int, int]] = _StateField()
    engram_tables: _StateField[dict[int, EngramTable]] = _StateField()
    engram_placement: _StateField[str] = _StateField()
    spec: _StateField[SpecState | None] = _StateField()
    sync_free: _StateField[bool] = _StateField()
    cuda_graphs: _StateField[bool] = _StateField()
    fuse_glue: _StateField[bool] = _StateField()
    fused_sinkhorn: _StateField[bool] = _StateField()
    fused_attention: _StateField[bool] = _StateField()
    fused_moe: _StateField[bool] = _StateField()
    fused_head: _StateField[bool] = _StateField()
    row_path: _StateField[bool] = _StateField()
    prefill_path: _StateField[str] = _StateField()
    prefill_tile: _StateField[int] = _StateField()
    prefill_budget: _StateField[int] = _StateField()
    prefill_index_op: _StateField[bool] = _StateField()
    invariant_rows: _StateField[int] = _StateField()

    def __init__(
        self,
        model: DeepSeekV41,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        backtrack_tokens: int = 6,
        quantize: bool = True,
        backend: Backend | None = None,
        engram_placement: str = "local",
        engram_group: object | None = None,
        seed: int = 0,
        cuda_graphs: bool = True,
        cuda_graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        fuse_glue: bool = False,
        draft_context: bool = True,
    ) -> None:
        for name, v, lo in (
            ("num_blocks", num_blocks, 2),
            ("block_size", block_size, 1),
            ("num_state_slots", num_state_slots, 1),
            ("backtrack_tokens", backtrack_tokens, 0),
        ):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
        self.state = st = make_state(
            model, num_blocks, block_size, num_state_slots, backtrack_tokens, quantize, backend
        )
        # with a backend on a CUDA device, row-path steps run sync-free (decode_step) and pure-decode
        # batches replay CUDA graphs bucketed by batch size (cuda_graphs; the switch: DEEPINFER_CUDA_GRAPHS)
        st.sync_free = backend is not None and st.device.type == "cuda"
        st.cuda_graphs = bool(cuda_graphs) and st.sync_free
        self._graph_buckets = check_buckets(cuda_graph_buckets)
        # the sync-free step's small functions compiled into fused kernels (model.fusion; torch.compile)
        st.fuse_glue = bool(fuse_glue) and st.sync_free
        # prefill steps of every request at once (model.prefill_varlen: a number of kernel launches per layer
        # that does not grow with the requests) on the cuda backend; the per-request tiled path elsewhere
        # (equal speed on the CPU, docs/performance.md)
        st.prefill_path = "varlen" if st.sync_free else "tiled"
        # each decode layer's attention as the backend's one-kernel ``sink_attention_rows`` (TileLang on the
        # cuda backend) instead of two batched GEMMs and the softmax between them; the MoE's expert products
        # as its ``moe_grouped_gemm``; the LM head as that kernel with one group (a [V, D] weight stream).
        # On by default where the model's shapes run the kernels (model.fused_kernels)
        defaults = kernel_defaults(model, backend, st.sync_free)
        st.fused_attention, st.fused_moe, st.fused_head = (
            defaults["fused_attention"],
            defaults["fused_moe"],
            defaults["fused_head"],
        )
        self._graphs: DecodeGraphs | None = None
        self._graphs_rows = 0  # the invariant_rows the graphs were made for
        # Engram: the tables of the chosen placement
        st.engram_tables = make_engram_tables(model, engram_placement, engram_group)
        st.engram_placement = engram_placement
        # the drafter's context rings are written every step (eager work after a replayed graph): only
        # when drafts will be asked for (draft_context; the engine passes whether it speculates)
        st.spec = SpecState(st, seed) if model.drafter is not None and draft_context else None

    def graphs(self) -> DecodeGraphs:
        """This executor's captured decode graphs (made on first use; ``cuda_graphs`` must be on)."""
        rows = self.state.invariant_rows
        if self._graphs is None or self._graphs_rows != rows:
            # batch-invariant mode: every graph a whole number of chunks (a lone request replays the C-row
            # graph a full batch does: the same kernels whatever the batch, up to C rows)
            buckets = self._graph_buckets
            if rows:
                buckets = tuple(sorted({-(-b // rows) * rows for b in buckets}))
            capture = self._graphs is None or self._graphs.capture
            self._graphs, self._graphs_rows = DecodeGraphs(self.state, buckets, capture=capture), rows
        return self._graphs

    def cache_bytes(self) -> dict[str, int]:
        """Bytes held by each cache kind."""
        st = self.state
        return {
            "main_kv": sum(t.numel() for t in st.kv.values()),
            "index_keys": sum(t.numel() for t in st.index_keys.values()),
            "swa_ring": sum(t.numel() for t in st.swa),
            "compressor_state": sum(t.numel() * t.element_size() for t in st.comp_state.values()),
            "drafter_rings": 0 if st.spec is None else st.spec.cache_bytes(),
            "token_ring": st.tokens.nbytes,
        }

    # ------------------------------------------------------------------ the step
    @property
    def token_feed_ok(self) -> bool:
        """Whether ``execute`` can take input tokens from the device (a :class:`TokenFeed`) without
        waiting for them: Engram n-grams are then hashed on the device, so the tables must be the
        model's own (``"local"``); host or sharded tables fetch by host row ids. No drafter context
        either (the drafter reads its step's tokens on the host)."""
        st = self.state
        return st.spec is None and (not st.cfg.engram_layer_ids or st.engram_placement == "local")

    def validate(self, batch: ForwardBatch) -> None:
        """Raise :class:`~deepinfer_core.model.batch.BatchError` naming the first bad request and field;
        touches nothing (``validation.validate``)."""
        validation.validate(self.state, batch)

    @torch.no_grad()
    def execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> ForwardOutput:
        """Run one step; returns logits for the requested rows and per-layer expert counts. ``feed``:
        tokens of the batch that are still on the device (``batch.token_ids`` holds valid placeholders
        there), the engine's asynchronous overlap; needs :attr:`token_feed_ok`."""
        if feed is not None and not self.token_feed_ok:
            raise ValueError(
                "feed: this executor cannot take device tokens (host / sharded Engram tables or a "
                "drafter context); read them back first"
            )
        st = self.state
        validation.validate(st, batch)
        self._begin_step(batch)
        rows = st.row_path and not batch.encoder_only and int(batch.query_lens.max()) <= st.backtrack + 1
        # batch-invariant mode: fixed-shape products (model.invariant), a chunk per path
        with row_chunked(st.invariant_rows * (1 if rows else PREFILL_FACTOR)):
            if rows:
                # decode / verify steps: every row's window and group are in the rings after this step's
                # writes, so attention runs on all rows at once (no per-request loop)
                graphs = self.graphs() if st.sync_free and st.cuda_graphs else None
                return execute_rows(st, batch, feed, graphs)
            return execute_requests(st, batch, feed)

    def _begin_step(self, batch: ForwardBatch) -> None:
        """Per-slot resets and this step's snapshot requests, as indexed writes (no per-request loop):
        validation refused repeated slots, so the writes of different requests never touch the same slot
        and their order is immaterial."""
        st = self.state
        restart = batch.state_slots[batch.start_pos == 0]
        if restart.size:
            st.floor[restart] = 0
            st.min_start[restart] = 0
        if batch.decoder_floor is not None:
            up = batch.decoder_floor > 0
            if up.any():
                fs = batch.state_slots[up]
                st.floor[fs, 1] = np.maximum(st.floor[fs, 1], batch.decoder_floor[up])
        sp = batch.snapshot_pos
        st.snap_at = (
            {} if sp is None or not sp.any() else {i: int(x) for i, x in enumerate(sp.tolist()) if x > 0}
        )
        st.snaps = {}

    # ------------------------------------------------------------------ Engram rows and token context
    def engram_fetch(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """{layer: rows [T, row_dim]} for hashed row ids [L, T, columns] from this executor's tables."""
        return engram_fetch(self.state, ids)

    def resolve_fed(self, drop: bool = False) -> None:
        """Write device-fed tokens into the host token ring (waits for their step if the host copy is not
        done). The engine calls it as soon as the previous step's tokens are on the host, before its next
        step can restart a slot (so an entry never lands in a slot handed to another sequence).
        ``drop``: forget them instead (the engine reset: every slot restarts)."""
        resolve_fed(self.state, drop)

    # ------------------------------------------------------------------ SWA bounded replay (replay.py)
    def blocks_needed(self, num_tokens: int) -> int:
        """Block-table entries a sequence of ``num_tokens`` tokens uses."""
        return self.state.blocks_needed(num_tokens)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks (main KV and indexer keys of every source layer): a prefix hit's cached
        blocks into a sequence's own blocks when they cannot be shared (docs/swa.md)."""
        replay.copy_blocks(self.state, src, dst)

    def slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of everything kept per state slot, by name (``replay.slot_state``: a P/D handoff)."""
        return replay.slot_state(self.state, slot)

    def load_slot_state(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        """Put a :meth:`slot_state` of an executor of the same model and sizes into ``slot``."""
        replay.load_slot_state(self.state, slot, state)

    def encoder_rings(self, slot: int) -> torch.Tensor:
        """A copy of the slot's encoder SWA rings, uint8 [encoder layers, ring, bytes]."""
        return replay.encoder_rings(self.state, slot)

    def restore_encoder(
        self, slot: int, pos: int, rings: torch.Tensor | np.ndarray, context: np.ndarray
    ) -> None:
        """Put persisted encoder rings (from ``snapshots`` / :meth:`encoder_rings` at ``pos``) into ``slot``
        (``replay.restore_encoder``)."""
        replay.restore_encoder(self.state, slot, pos, rings, context)

    def replay_encoder(
        self, slot: int, token_ids: np.ndarray, start: int, block_table: np.ndarray, context: np.ndarray
    ) -> None:
        """Rebuild ``slot``'s encoder rings at ``start + len(token_ids)`` by running those tokens through the
        encoder with every window truncated to them (``replay.replay_encoder``)."""
        replay.replay_encoder(self.state, slot, token_ids, start, block_table, context)
