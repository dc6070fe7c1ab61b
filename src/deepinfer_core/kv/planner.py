"""Memory planner: per-sequence bytes of each kind of attention memory, the StateBlock byte layout, and
how many paged blocks and state slots fit in a byte budget.

Three kinds of memory per request (DeepSeek-V4.1-Flash):
- paged (grows with the sequence): compressed main KV of each KV-source layer (one entry per ``ratio``
  tokens) and indexer keys of each index-source layer, in fixed blocks of ``block_size`` tokens;
- state (fixed per running sequence, one StateBlock): an SWA ring of ``window + backtracking`` tokens
  per layer (draft stages included), then the compressors' partial-window accumulators.

StateBlock layout: rings of the persisted layers (the encoder half, layers ``[0, num_persisted_layers)``)
first, so persisting them is one contiguous copy of ``persisted_bytes`` (20 x 134 x 528 = 1,415,040 B at
the released shape); then the other layers' rings in layer order, then draft-stage rings, then one
accumulator per compressing layer (ratio >= 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from deepinfer_core.kv._checks import check_int
from deepinfer_core.kv.sizes import bytes_per_token


def _ratios(v: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


@attrs.frozen
class KVModelConfig:
    """The cache-relevant part of a model config (defaults: the released V4.1-Flash shape)."""

    num_layers: int = 40
    compress_ratios: tuple[int, ...] = attrs.field(default=(0, 0) + (2,) * 18 + (1,) * 20, converter=_ratios)
    kv_source_layer_ids: tuple[int, ...] = attrs.field(default=(2, 8, 14, 20), converter=_ratios)
    index_source_layer_ids: tuple[int, ...] = attrs.field(
        default=(2, 8, 14, 20, 24, 28, 32, 36), converter=_ratios
    )
    head_dim: int = 512
    index_head_dim: int = 128
    window: int = 128
    backtracking: int = 6  # DEEPINFER_MAX_BACKTRACKING_TOKENS default: draft length + 1
    num_persisted_layers: int = 20
    num_draft_layers: int = 3  # DSpark stages: SWA only, never persisted
    main_format: str = "fp4"
    index_format: str = "mxfp4"
    swa_format: str = "fp8"
    # Compressor partial-window accumulator, bytes per pending token per compressing layer. The public
    # sources do not give it; default: fp32 KV + fp32 gate logit per head_dim value (uncertain).
    accumulator_bytes_per_token: int = 2 * 4 * 512

    def __attrs_post_init__(self) -> None:
        check_int("num_layers", self.num_layers, min_value=1)
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(
                f"compress_ratios must have num_layers={self.num_layers} entries, got {len(self.compress_ratios)}"
            )
        if any(r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios must be >= 0 (0 = SWA only), got {self.compress_ratios}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            for lid in getattr(self, name):
                if not 0 <= lid < self.num_layers:
                    raise ValueError(f"{name} holds layer {lid}, outside [0, {self.num_layers})")
                if self.compress_ratios[lid] < 1:
                    raise ValueError(f"{name} holds layer {lid} whose compress ratio is 0 (SWA only)")
        check_int("window", self.window, min_value=1)
        check_int("backtracking", self.backtracking, min_value=0)
        check_int("num_draft_layers", self.num_draft_layers, min_value=0)
        if not 0 <= self.num_persisted_layers <= self.num_layers:
            raise ValueError(
                f"num_persisted_layers must be in [0, {self.num_layers}], got {self.num_persisted_layers}"
            )
        for f in (self.main_format, self.index_format, self.swa_format):
            bytes_per_token(f, self.head_dim if f != self.index_format else self.index_head_dim)

    @classmethod
    def tiny(cls) -> KVModelConfig:
        """The tiny test config of v41_flash.md (8 layers, head_dim 64, window 16)."""
        return cls(
            num_layers=8,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
            kv_source_layer_ids=(2, 4),
            index_source_layer_ids=(2, 4, 6),
            head_dim=64,
            index_head_dim=32,
            window=16,
            backtracking=6,
            num_persisted_layers=4,
            num_draft_layers=2,
            accumulator_bytes_per_token=2 * 4 * 64,
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], **overrides: Any) -> KVModelConfig:
        """From an HF-style config.json dict (keys: num_hidden_layers, compress_ratios, sliding_window,
        kv_source_layer_ids, index_source_layer_ids, head_dim, index_head_dim; extra draft-stage
        ratios beyond num_hidden_layers count as draft layers)."""
        n = int(cfg["num_hidden_layers"])
        ratios = list(cfg.get("compress_ratios", [1] * n))
        kw: dict[str, Any] = {
            "num_layers": n,
            "compress_ratios": ratios[:n],
            "num_draft_layers": max(0, len(ratios) - n),
            "num_persisted_layers": n // 2,
        }
        for ours, theirs in (
            ("kv_source_layer_ids", "kv_source_layer_ids"),
            ("index_source_layer_ids", "index_source_layer_ids"),
            ("head_dim", "head_dim"),
            ("index_head_dim", "index_head_dim"),
            ("window", "sliding_window"),
        ):
            if theirs in cfg:
                kw[ours] = cfg[theirs]
        kw.update(overrides)
        return cls(**kw)

    # --- per-token / per-sequence bytes ---
    @property
    def ring_tokens(self) -> int:
        return self.window + self.backtracking

    @property
    def swa_bytes_per_token(self) -> int:
        return bytes_per_token(self.swa_format, self.head_dim)

    @property
    def main_bytes_per_entry(self) -> int:
        return bytes_per_token(self.main_format, self.head_dim)

    @property
    def index_bytes_per_entry(self) -> int:
        return bytes_per_token(self.index_format, self.index_head_dim)

    @property
    def max_ratio(self) -> int:
        return max(self.compress_ratios[i] for i in (*self.kv_source_layer_ids, *self.index_source_layer_ids))

    def compressing_layers(self) -> tuple[int, ...]:
        """Layers whose compressor keeps a partial window (ratio >= 2)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r >= 2)


@attrs.frozen
class StateLayout:
    """Byte offsets inside one StateBlock (one per running sequence)."""

    ring_tokens: int  # window + backtracking
    token_bytes: int  # SWA format bytes per token (528 for fp8 at head_dim 512)
    ring_bytes: int  # one layer's ring: ring_tokens * token_bytes
    ring_offsets: tuple[int, ...]  # per model layer, then per draft layer
    accumulator_offsets: Mapping[int, int]  # compressing layer -> offset
    accumulator_bytes: Mapping[int, int]
    persisted_bytes: int  # [0, persisted_bytes) = rings of the persisted layers
    bytes_per_seq: int

    @classmethod
    def build(cls, cfg: KVModelConfig) -> StateLayout:
        ring = cfg.ring_tokens * cfg.swa_bytes_per_token
        n_rings = cfg.num_layers + cfg.num_draft_layers
        # Layer order already puts layers [0, num_persisted_layers) first: the persisted prefix.
        offsets = tuple(i * ring for i in range(n_rings))
        off = n_rings * ring
        acc_off: dict[int, int] = {}
        acc_b: dict[int, int] = {}
        for lid in cfg.compressing_layers():
            acc_off[lid] = off
            acc_b[lid] = cfg.compress_ratios[lid] * cfg.accumulator_bytes_per_token
            off += acc_b[lid]
        return cls(
            ring_tokens=cfg.ring_tokens,
            token_bytes=cfg.swa_bytes_per_token,
            ring_bytes=ring,
            ring_offsets=offsets,
            accumulator_offsets=acc_off,
            accumulator_bytes=acc_b,
            persisted_bytes=cfg.num_persisted_layers * ring,
            bytes_per_seq=off,
        )


@attrs.frozen
class MemoryPlan:
    """What fits in a budget, and the per-sequence bytes of each kind."""

    block_size: int
    num_blocks: int  # including the null block 0
    num_state_slots: int
    bytes_per_block: int
    paged_bytes_per_token: float  # bytes_per_block / block_size
    main_kv_bytes_per_token: float
    indexer_bytes_per_token: float
    state_bytes_per_seq: int
    swa_bytes_per_seq: int
    persisted_swa_bytes_per_seq: int
    accumulator_bytes_per_seq: int
    total_bytes: int  # what the plan uses (<= budget)

    @property
    def max_cached_tokens(self) -> int:
        """Token capacity of the usable blocks (null block excluded)."""
        return max(self.num_blocks - 1, 0) * self.block_size


def block_bytes(cfg: KVModelConfig, block_size: int) -> tuple[int, int]:
    """(main KV bytes, indexer bytes) of one block of ``block_size`` tokens over all source layers."""
    bs = check_int("block_size", block_size, min_value=1)
    if bs % cfg.max_ratio:
        raise ValueError(
            f"block_size must be a multiple of the largest compress ratio {cfg.max_ratio}, got {bs}"
        )
    main = sum(bs // cfg.compress_ratios[i] * cfg.main_bytes_per_entry for i in cfg.kv_source_layer_ids)
    index = sum(bs // cfg.compress_ratios[i] * cfg.index_bytes_per_entry for i in cfg.index_source_layer_ids)
    return main, index


def plan_memory(
    cfg: KVModelConfig, budget_bytes: int, *, max_num_seqs: int, block_size: int = 64
) -> MemoryPlan:
    """Reserve one StateBlock per running sequence (``max_num_seqs``), fill the rest with paged blocks.

    ValueError (naming the field) when the budget cannot hold the state slots plus the null block and
    one usable block.
    """
    budget = check_int("budget_bytes", budget_bytes, min_value=0)
    seqs = check_int("max_num_seqs", max_num_seqs, min_value=1)
    layout = StateLayout.build(cfg)
    main, index = block_bytes(cfg, block_size)
    per_block = main + index
    state_total = seqs * layout.bytes_per_seq
    left = budget - state_total
    if left < 2 * per_block:
        raise ValueError(
            f"budget_bytes={budget} cannot hold max_num_seqs={seqs} state blocks ({state_total} B) plus two "
            f"paged blocks of {per_block} B; raise the budget or lower max_num_seqs"
        )
    nblocks = min(left // per_block, 2**31 - 1)
    swa = (cfg.num_layers + cfg.num_draft_layers) * layout.ring_bytes
    return MemoryPlan(
        block_size=block_size,
        num_blocks=nblocks,
        num_state_slots=seqs,
        bytes_per_block=per_block,
        paged_bytes_per_token=per_block / block_size,
        main_kv_bytes_per_token=main / block_size,
        indexer_bytes_per_token=index / block_size,
        state_bytes_per_seq=layout.bytes_per_seq,
        swa_bytes_per_seq=swa,
        persisted_swa_bytes_per_seq=layout.persisted_bytes,
        accumulator_bytes_per_seq=sum(layout.accumulator_bytes.values()),
        total_bytes=state_total + nblocks * per_block,
    )
