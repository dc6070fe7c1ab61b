"""The executor's shared state as one typed object: caches, rings, per-slot floors, settings.

:class:`ExecutorState` is everything a step reads and writes besides the batch. The executor owns one
and hands it explicitly to the modules that run its steps (``validation``, ``engram_context``,
``prefill``, ``decode_step``, ``cuda_graphs``, ``replay``): no module reaches into the executor, and
every field a step touches is declared here with its type. The cache writes and reads live here too
(:meth:`ExecutorState.store`, :meth:`~ExecutorState.ring_store`, :meth:`~ExecutorState.gather`), so the
byte layout of the caches is written once (see :mod:`deepinfer_core.model.cache` for the layouts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.cache import CacheFormats
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, ModelConfig
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.protocols.engram import EngramTable
from deepinfer_core.protocols.model import Backend

if TYPE_CHECKING:  # the drafter's state refers back to this object through model.speculative.SpecHost
    from deepinfer_core.model.speculative import SpecState

DEFAULT_BUDGET = 512 << 20  # bytes of intermediates per piece of prefill rows (the dense path: ~n^2 * H * 8)
# the CPU's default: pieces that stay in cache and skip the indexer's causal half more finely; one request
# of 8,192 tokens (tiny config) prefills ~15-25 % faster than at 512 MiB on both prefill paths (8-128 MiB
# within noise of each other; benchmarks/prefill_batching.py, docs/performance.md)
CPU_BUDGET = 32 << 20
DEFAULT_TILE = 64  # query rows per window tile: window + 63 keys per tile (1.5x the window at w = 128)


@attrs.define(eq=False, kw_only=True)
class ExecutorState:
    """One executor's caches and bookkeeping (made by :func:`make_state`); the switches at the end may be
    changed between steps (the executor exposes them as its own attributes)."""

    model: DeepSeekV41
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    fmt: CacheFormats
    # the format argument of the backend's kv ops per cache kind ("main" / "swa" / "index")
    fmt_arg: dict[str, Any]
    backend: Backend | None
    num_blocks: int
    block_size: int
    num_slots: int
    backtrack: int  # how far a sequence may roll back (DEEPINFER_MAX_BACKTRACKING_TOKENS)
    swa_ring: int  # window + backtrack entries per slot and layer
    tok_ring: int  # the host token ring's entries per slot (Engram n-gram context)
    min_ratio: int  # the smallest compress ratio (the block layout's unit; 0 without compressed layers)
    src_ratios: list[int]  # the KV source layers' distinct ratios (blocks_needed)
    entry_ratios: tuple[int, ...]  # the indexing layers' distinct ratios (decode_step.entries_needed)
    # ---- device caches (cache.py has the layouts)
    swa: list[torch.Tensor]
    kv: dict[int, torch.Tensor]
    index_keys: dict[int, torch.Tensor]
    comp_state: dict[int, torch.Tensor]
    comp_ring: dict[int, int]
    # ---- per slot, on the host: end position written (a gap or a rollback deeper than backtrack is
    # refused), filled by encoder-only steps (decoder rings empty), the first position whose SWA keys
    # exist in the encoder / decoder rings (bounded replay: keys below are never attended), the lowest
    # position a step may start at after a restore or a replay, and the recent tokens (a ring by position)
    slot_end: np.ndarray
    encoder_only: np.ndarray
    floor: np.ndarray
    min_start: np.ndarray
    tokens: np.ndarray
    # ring entries whose token is still on the device (the engine's overlap), written by resolve_fed
    fed: list[tuple[np.ndarray, np.ndarray, TokenFeed]] = attrs.field(factory=list)
    # ---- one step: replay_encoder reads shared blocks and writes none; snapshot requests and results
    no_block_writes: bool = False
    snap_at: dict[int, int] = attrs.field(factory=dict)
    snaps: dict[int, list[torch.Tensor]] = attrs.field(factory=dict)
    # ---- Engram tables of the chosen placement, and the drafter's state (None: no drafts)
    engram_tables: dict[int, EngramTable] = attrs.field(factory=dict)
    engram_placement: str = "local"
    spec: SpecState | None = None
    # ---- switches (documented on ModelExecutor)
    sync_free: bool = False
    cuda_graphs: bool = False
    fuse_glue: bool = False
    fused_sinkhorn: bool = False
    fused_attention: bool = False
    fused_moe: bool = False
    fused_head: bool = False
    row_path: bool = True
    prefill_path: str = "tiled"
    prefill_tile: int = DEFAULT_TILE
    prefill_budget: int = DEFAULT_BUDGET
    prefill_index_op: bool = True
    # batch-invariant mode (model.invariant): every row product of a step in chunks of this many rows
    # (0: off), so a row's logits do not depend on the other rows of its batch
    invariant_rows: int = 0

    # ------------------------------------------------------------------ the cache layout
    def entry_slots(self, table: torch.Tensor, idx: torch.Tensor, ratio: int) -> torch.Tensor:
        """Flat cache slots of compressed entries ``idx`` (of a layer of compress ``ratio``) through one
        block table. Entry j sits at logical slot j * ratio / min_ratio, so block b holds only entries of
        the tokens of block b (at every ratio): a prefix hit can share whole blocks (docs/model.md)."""
        lg = idx * ratio // self.min_ratio
        return table[lg // self.block_size] * self.block_size + lg % self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Block-table entries a sequence of ``num_tokens`` tokens uses (see :meth:`entry_slots`)."""
        last = [(num_tokens // r - 1) * r // self.min_ratio for r in self.src_ratios if num_tokens >= r]
        return max(last) // self.block_size + 1 if last else 0

    # ------------------------------------------------------------------ cache writes and reads
    def store(self, pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, kind: str) -> None:
        """Quantise rows ``x`` and write them to flat ``slots`` of a paged cache or ring (slot < 0: row
        skipped, the KV kernels' padding contract)."""
        if self.backend is not None:  # check=False: slots come from validated tables (no device sync)
            self.backend.op("kv_store")(pool, x, slots, self.fmt_arg[kind], check=False)
            return
        fmt = getattr(self.fmt, kind)
        keep = slots >= 0
        if not bool(keep.all()):  # plain torch (no backend): the host decides, a sync is no cost here
            x, slots = x[keep], slots[keep]
        pool.view(-1, fmt.bytes_per_token)[slots] = fmt.quantize(x)

    def ring_store(
        self,
        ring: torch.Tensor,
        x: torch.Tensor,
        x_bytes: torch.Tensor | None,
        states: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Write rows ``x`` (or their already quantised ``x_bytes``) at ``positions % ring`` of ``states``.
        Callers pass at most one row per ring entry (no duplicates in one call)."""
        if self.backend is not None:
            # the ring slots straight into kv_store (swa_ring_write's range checks and last-writer pass
            # synchronise with the device; callers pass no duplicates and in-range states)
            flat = states.to(torch.int64) * ring.shape[1] + positions.to(torch.int64) % ring.shape[1]
            self.backend.op("kv_store")(ring, x, flat, self.fmt_arg["swa"], check=False)
            return
        ring[states, positions % self.swa_ring] = self.fmt.swa.quantize(x) if x_bytes is None else x_bytes

    def gather(
        self,
        pool: torch.Tensor,
        slots: torch.Tensor,
        kind: str,
        dim: int,
        out: torch.Tensor | None = None,
        col: int = 0,
    ) -> torch.Tensor:
        """Rows ``slots`` (any shape, < 0 reads as zeros) of a paged cache or ring dequantised to the model
        dtype, [*slots.shape, dim]; with ``out`` [rows, total, dim] they land in ``out[:, col:]``."""
        if self.backend is not None:
            op = self.backend.op("kv_gather")
            if out is None:
                return op(pool, slots, self.fmt_arg[kind], dim, self.dtype)
            return op(pool, slots, self.fmt_arg[kind], dim, self.dtype, out=out, col=col)
        fmt = getattr(self.fmt, kind)
        got = fmt.dequantize(pool.view(-1, fmt.bytes_per_token)[slots.clamp(min=0)]).to(self.dtype)
        got = torch.where((slots >= 0)[..., None], got, torch.zeros((), dtype=self.dtype, device=got.device))
        if out is None:
            return got
        out[:, col : col + slots.shape[1]] = got
        return out

    def take_snapshots(self, b: ForwardBatch) -> dict[int, torch.Tensor]:
        """The encoder rings at each snapshot position this step asked for (captured by the prefill path for
        prefill steps; for row-path steps the rings after the step, which still hold [X - w + 1, X))."""
        e = self.cfg.encoder_layers
        out = {}
        for i in self.snap_at:
            got = self.snaps.get(i)
            if got is None or len(got) != e:
                got = [self.swa[lid][int(b.state_slots[i])].clone() for lid in range(e)]
            out[i] = torch.stack(got)
        self.snap_at, self.snaps = {}, {}
        return out

    def index_score_op(self) -> Callable[..., torch.Tensor] | None:
        """The backend's ``indexer_scores`` for the tiled prefill (the cuda backend's TileLang kernel: fp32
        accumulation, no [rows, heads, E] intermediate) for bf16 / fp16 models, or None (torch)."""
        if (
            self.prefill_index_op
            and self.backend is not None
            and self.dtype in (torch.bfloat16, torch.float16)
        ):
            return self.backend.op("indexer_scores")
        return None


def last_rows(b: ForwardBatch, ring: int) -> np.ndarray:
    """Mask [N] of each request's last ``ring`` rows (the only ones a ring of that size keeps)."""
    return np.arange(b.num_tokens) >= np.repeat(b.offsets[1:], b.query_lens) - ring


def make_state(
    model: DeepSeekV41,
    num_blocks: int,
    block_size: int,
    num_state_slots: int,
    backtrack_tokens: int,
    quantize: bool,
    backend: Backend | None,
) -> ExecutorState:
    """An :class:`ExecutorState` with zeroed caches for ``model`` (Engram tables, drafter state and the
    kernel switches are the executor's to set)."""
    cfg = model.cfg
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    fmt = CacheFormats.make(cfg.head_dim, cfg.index_head_dim, quantize, dtype)
    swa_ring = cfg.sliding_window + backtrack_tokens
    n_layers = cfg.num_hidden_layers
    kv, index_keys, comp_state, comp_ring = _paged_caches(
        model, fmt, num_blocks, block_size, num_state_slots, backtrack_tokens
    )
    tok_ring = max(swa_ring, cfg.engram_max_ngram - 1 + backtrack_tokens)
    min_ratio, src_ratios, entry_ratios = _compress_ratios(cfg)
    return ExecutorState(
        model=model,
        cfg=cfg,
        device=dev,
        dtype=dtype,
        fmt=fmt,
        backend=backend,
        # by name for quantised caches, so kernels recognise them
        fmt_arg={"main": "fp4", "swa": "fp8", "index": "mxfp4"}
        if quantize
        else {"main": fmt.main, "swa": fmt.swa, "index": fmt.index},
        num_blocks=num_blocks,
        block_size=block_size,
        num_slots=num_state_slots,
        backtrack=backtrack_tokens,
        swa_ring=swa_ring,
        tok_ring=tok_ring,
        min_ratio=min_ratio,
        src_ratios=src_ratios,
        entry_ratios=entry_ratios,
        swa=[
            torch.zeros(num_state_slots, swa_ring, fmt.swa.bytes_per_token, dtype=torch.uint8, device=dev)
            for _ in range(n_layers)
        ],
        kv=kv,
        index_keys=index_keys,
        comp_state=comp_state,
        comp_ring=comp_ring,
        slot_end=np.zeros(num_state_slots, np.int64),
        encoder_only=np.zeros(num_state_slots, bool),
        floor=np.zeros((num_state_slots, 2), np.int64),
        min_start=np.zeros(num_state_slots, np.int64),
        tokens=np.full((num_state_slots, tok_ring), -1, np.int64),
        prefill_budget=DEFAULT_BUDGET if dev.type == "cuda" else CPU_BUDGET,
    )


def _compress_ratios(cfg: ModelConfig) -> tuple[int, list[int], tuple[int, ...]]:
    """(the smallest compress ratio of the model's layers (0: none), the KV source layers' distinct ratios
    ascending, the distinct ratios of the layers that select entries (Full / Reindex) in layer order)."""
    n_layers = cfg.num_hidden_layers
    min_ratio = min((r for r in cfg.compress_ratios[:n_layers] if r > 0), default=0)
    src_ratios = sorted({cfg.ratio(s) for s in cfg.kv_source_layer_ids if cfg.ratio(s) > 0})
    entry_ratios = tuple(
        dict.fromkeys(
            cfg.ratio(lid) for lid in range(n_layers) if cfg.layer_kind(lid) in (LAYER_FULL, LAYER_REINDEX)
        )
    )
    return min_ratio, src_ratios, entry_ratios


def _paged_caches(
    model: DeepSeekV41, fmt: CacheFormats, num_blocks: int, block_size: int, num_slots: int, backtrack: int
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, int]]:
    """(main KV, indexer keys, compressor state, compressor ring length) per KV source layer."""
    cfg = model.cfg
    p = next(model.parameters())
    kv: dict[int, torch.Tensor] = {}
    index_keys: dict[int, torch.Tensor] = {}
    comp_state: dict[int, torch.Tensor] = {}
    comp_ring: dict[int, int] = {}
    for s in cfg.kv_source_layer_ids:
        kv[s] = torch.zeros(
            num_blocks, block_size, fmt.main.bytes_per_token, dtype=torch.uint8, device=p.device
        )
        index_keys[s] = torch.zeros(
            num_blocks, block_size, fmt.index.bytes_per_token, dtype=torch.uint8, device=p.device
        )
        if cfg.ratio(s) > 1:  # ratio 1 completes an entry every token: no partial group to keep
            a = model.layers[s].attn
            comp_ring[s] = cfg.ratio(s) + backtrack
            width = a.compressor.state_dim + a.index_compressor.state_dim
            comp_state[s] = torch.zeros(num_slots, comp_ring[s], width, dtype=p.dtype, device=p.device)
    return kv, index_keys, comp_state, comp_ring
