"""ModelConfig: the DeepSeek-V4.1-Flash architecture as an HF-style ``config.json``.

Field names follow the V4.1 config files (``compress_ratios``, ``kv_source_layer_ids``, ...). Unknown
fields and inconsistent values raise :class:`ConfigError` naming the field. Fields marked (choice) in the
comments resolve a point where public sources disagree; docs/model.md lists them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger(__name__)

__all__ = [
    "LAYER_FULL",
    "LAYER_REINDEX",
    "LAYER_REUSE",
    "LAYER_SWA",
    "MODEL_TYPES",
    "ConfigError",
    "ModelConfig",
    "check_architecture",
    "flash_config",
    "tiny_config",
]

# Role of a layer in its sharing group.
LAYER_SWA = "swa"  # compress ratio 0: sliding window only
LAYER_FULL = "full"  # owns the compressed main KV and the indexer keys of its group
LAYER_REINDEX = "reindex"  # own indexer queries, new top-k against the group source's indexer keys
LAYER_REUSE = "reuse"  # reuses the source's KV and the top-k of the nearest index source

# HF bookkeeping fields that carry no architecture; accepted and ignored.
_IGNORED_FIELDS = frozenset(
    {
        "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
        "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
        "use_cache", "attention_bias", "attention_dropout", "hidden_act", "max_position_embeddings",
        "first_k_dense_replace", "topk_method", "n_group", "topk_group", "ep_size", "num_hash_layers",
        "expert_dtype", "_name_or_path",
    }
)  # fmt: skip


class ConfigError(ValueError):
    """A config field is unknown or inconsistent; the message names the field and what is allowed."""


# config.json's model_type values of the architecture this library runs (absent is accepted: the
# library's own configs, e.g. the shipped tiny one, need not say it)
MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v4_1", "deepseek_v4_flash", "deepseek_v41_flash")


def check_architecture(d: Mapping[str, Any]) -> None:
    """ConfigError when ``model_type`` names another architecture (a Llama or Qwen config.json fails with
    that, not with a list of missing fields)."""
    mt = d.get("model_type")
    if mt is not None and mt not in MODEL_TYPES:
        archs = d.get("architectures")
        also = f", architectures {archs}" if isinstance(archs, list) and archs else ""
        raise ConfigError(
            f"model_type: unsupported architecture (model_type {mt!r}{also}; this library runs "
            f"DeepSeek-V4.1, model_type one of {list(MODEL_TYPES)})"
        )


def _tuple_int(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _opt_dict(v: Any) -> dict[str, Any] | None:
    return None if v is None else dict(v)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Architecture hyper-parameters; construct with keywords, :meth:`from_dict` or :meth:`from_pretrained`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    rms_norm_eps: float = 1e-6
    sliding_window: int
    # per layer (+ optionally one 0 per draft stage): 0 = SWA only, r > 0 = r tokens pooled per entry
    compress_ratios: tuple[int, ...] = attrs.field(converter=_tuple_int)
    kv_source_layer_ids: tuple[int, ...] = attrs.field(converter=_tuple_int)
    index_source_layer_ids: tuple[int, ...] = attrs.field(converter=_tuple_int)
    # CED split: layers [0, num_encoder_layers) are the encoder. None = the last KV source layer.
    num_encoder_layers: int | None = None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # hierarchical candidate blocks (choice of field names: ports call them candidate_*)
    candidate_source_layer_id: int | None = None
    candidate_block_size: int = 8
    candidate_topk_blocks: int = 2048
    # (choice) RoPE position of a compressed entry: "first" or "last" token of its group
    compress_rope_position: str = "first"
    # (choice) RoPE pairs adjacent dims (DeepSeek-V3 reference code); False rotates the two halves
    rope_interleave: bool = True
    rope_theta: float = 10000.0
    # (choice) layers with compress ratio > 0 use this base (and rope_scaling); SWA-only layers rope_theta
    compress_rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, converter=_opt_dict)
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float = 0.0  # 0 = no clamp
    shared_expert_clamp: bool = True  # (choice) whether the shared expert is clamped too
    tie_word_embeddings: bool = False
    # part 2: Engram (layers/engram.py), mHC (mhc.py), DSpark drafter (drafter.py)
    engram_layer_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_int)
    engram_max_ngram: int = 3
    engram_n_heads: int = 2
    engram_head_dim: int = 32
    engram_pad_id: int = 2
    # (choice) base table size per n-gram order (one value, or one per order 2..max); primes searched upward
    engram_table_sizes: tuple[int, ...] = attrs.field(default=(1009, 2003), converter=_tuple_int)
    engram_seed: int = 0
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    # (choice) V4.1's "single-pass" mHC: one coefficient pass per layer serves both sublayers
    hc_single_pass: bool = False
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 5
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_int)
    dspark_markov_rank: int = 0

    def __attrs_post_init__(self) -> None:
        self._validate()

    # ---------------------------------------------------------------- validation
    def _err(self, name: str, msg: str) -> ConfigError:
        return ConfigError(f"{name}={getattr(self, name)!r}: {msg}")

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "candidate_block_size", "candidate_topk_blocks"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise self._err(name, "must be a positive integer")
        if self.num_key_value_heads != 1:
            raise self._err("num_key_value_heads", "must be 1 (the architecture is MQA)")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise self._err("qk_rope_head_dim", f"must be even and in (0, head_dim={self.head_dim}]")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise self._err(
                "qk_rope_head_dim",
                f"must be <= index_head_dim={self.index_head_dim} (the indexer ropes the same dims)",
            )
        if self.num_attention_heads % self.o_groups:
            raise self._err("o_groups", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise self._err("num_experts_per_tok", f"must be <= n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts < 0:
            raise self._err("n_shared_experts", "must be >= 0")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise self._err("scoring_func", "must be one of 'sqrtsoftplus', 'sigmoid', 'softmax'")
        if self.swiglu_limit < 0:
            raise self._err("swiglu_limit", "must be >= 0 (0 disables the clamp)")
        if not self.rms_norm_eps > 0:
            raise self._err("rms_norm_eps", "must be > 0")
        if self.compress_rope_position not in ("first", "last"):
            raise self._err("compress_rope_position", "must be 'first' or 'last'")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("yarn",):
                raise self._err("rope_scaling", "only rope_type 'yarn' (or null) is supported")
        self._validate_layers()
        self._validate_part2()

    def _validate_layers(self) -> None:
        # in dependency order: the per-layer lists, the KV sharing groups they define, then the encoder /
        # decoder split and the candidate source, which must be sources of those groups
        self._validate_layer_lists()
        self._validate_sharing_groups()
        self._validate_encoder_split()

    def _validate_layer_lists(self) -> None:
        """compress_ratios' length and entries; the KV / index source lists' ids and ratios."""
        n, cr = self.num_hidden_layers, self.compress_ratios
        if len(cr) not in (n, n + self.num_nextn_predict_layers):
            raise self._err(
                "compress_ratios",
                f"length must be num_hidden_layers={n} (+ num_nextn_predict_layers={self.num_nextn_predict_layers})",
            )
        if any(r < 0 for r in cr):
            raise self._err("compress_ratios", "entries must be >= 0")
        if any(r != 0 for r in cr[n:]):
            raise self._err(
                "compress_ratios",
                "draft-stage entries (after num_hidden_layers) must be 0: drafter blocks are SWA only",
            )
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise self._err(name, f"must be strictly increasing layer ids in [0, {n})")
            for i in ids:
                if cr[i] == 0:
                    raise self._err(name, f"layer {i} has compress ratio 0 and cannot be a KV/index source")
        missing = set(self.kv_source_layer_ids) - set(self.index_source_layer_ids)
        if missing:
            raise self._err(
                "index_source_layer_ids",
                f"must contain every KV source layer (missing {sorted(missing)}): a Full layer owns indexer keys",
            )

    def _validate_sharing_groups(self) -> None:
        """Each compressed layer shares the KV of a source at or before it, of its own ratio, with no
        SWA-only layer in between."""
        n, cr = self.num_hidden_layers, self.compress_ratios
        for layer in range(n):
            if cr[layer] == 0:
                continue
            src = self.kv_source_of(layer)
            if src is None:
                raise self._err(
                    "kv_source_layer_ids",
                    f"layer {layer} (compress ratio {cr[layer]}) has no KV source at or before it",
                )
            if cr[src] != cr[layer]:
                raise self._err(
                    "compress_ratios",
                    f"layer {layer} has ratio {cr[layer]} but its KV source {src} has {cr[src]}",
                )
            for between in range(src, layer):
                if cr[between] == 0:
                    raise self._err(
                        "compress_ratios",
                        f"SWA-only layer {between} lies inside the sharing group of source {src}",
                    )

    def _validate_encoder_split(self) -> None:
        """The CED encoder / decoder split (the decoder has one KV source, its first layer) and the
        candidate source layer."""
        n, enc = self.num_hidden_layers, self.encoder_layers
        if not 0 < enc <= n:
            raise self._err("num_encoder_layers", f"must be in (0, {n}]")
        if enc < n:
            if enc not in self.kv_source_layer_ids:
                raise self._err(
                    "num_encoder_layers",
                    "the first decoder layer must be a KV source (the CED global KV source)",
                )
            if any(s > enc for s in self.kv_source_layer_ids):
                raise self._err(
                    "kv_source_layer_ids", f"the decoder has one KV source (layer {enc}); found later ones"
                )
        c = self.candidate_source_layer_id
        if c is not None and c not in self.kv_source_layer_ids:
            raise self._err(
                "candidate_source_layer_id",
                "must be a KV source layer (a Full layer scores the candidate blocks)",
            )

    def _validate_part2(self) -> None:
        n = self.num_hidden_layers
        if any(not 0 <= i < n for i in self.engram_layer_ids) or list(self.engram_layer_ids) != sorted(
            set(self.engram_layer_ids)
        ):
            raise self._err("engram_layer_ids", f"must be strictly increasing layer ids in [0, {n})")
        if self.engram_max_ngram < 2:
            raise self._err("engram_max_ngram", "must be >= 2")
        if self.hc_mult < 1:
            raise self._err("hc_mult", "must be >= 1 (1 = plain residual)")
        if self.hc_sinkhorn_iters < 1:
            raise self._err("hc_sinkhorn_iters", "must be >= 1")
        if self.engram_layer_ids:
            if self.engram_n_heads < 1 or self.engram_head_dim < 1:
                raise self._err("engram_n_heads", "engram_n_heads and engram_head_dim must be >= 1")
            if (
                len(self.engram_table_sizes) not in (1, self.engram_max_ngram - 1)
                or min(self.engram_table_sizes) < 2
            ):
                raise self._err(
                    "engram_table_sizes",
                    f"give one base size >= 2 or one per order 2..{self.engram_max_ngram}",
                )
            if not 0 <= self.engram_pad_id < self.vocab_size:
                raise self._err("engram_pad_id", f"must be in [0, vocab_size={self.vocab_size})")
        if self.num_nextn_predict_layers:
            if self.dspark_block_size < 1:
                raise self._err("dspark_block_size", "must be >= 1 (the accepted token + noise tokens)")
            if self.dspark_noise_token_id is None:
                raise self._err("dspark_noise_token_id", "required when num_nextn_predict_layers > 0")
            if not self.dspark_target_layer_ids:
                raise self._err("dspark_target_layer_ids", "required when num_nextn_predict_layers > 0")
            if self.dspark_markov_rank < 1:
                raise self._err("dspark_markov_rank", "must be >= 1 when the drafter is on")
        if self.num_nextn_predict_layers < 0:
            raise self._err("num_nextn_predict_layers", "must be >= 0")
        if any(not 0 <= i < n for i in self.dspark_target_layer_ids):
            raise self._err("dspark_target_layer_ids", f"must be layer ids in [0, {n})")
        t = self.dspark_noise_token_id
        if t is not None and not 0 <= t < self.vocab_size:
            raise self._err("dspark_noise_token_id", f"must be in [0, vocab_size={self.vocab_size})")

    # ---------------------------------------------------------------- derived structure
    @property
    def encoder_layers(self) -> int:
        """Number of encoder layers of the CED split (all layers when there is no decoder)."""
        if self.num_encoder_layers is not None:
            return self.num_encoder_layers
        return self.kv_source_layer_ids[-1] if len(self.kv_source_layer_ids) > 1 else self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        # draft stages past the listed ratios are SWA only
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def kv_source_of(self, layer: int) -> int | None:
        """The Full layer whose compressed KV ``layer`` attends to (None for SWA-only layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        prior = [s for s in self.kv_source_layer_ids if s <= layer]
        return prior[-1] if prior else None

    def index_source_of(self, layer: int) -> int | None:
        """The nearest Full or Reindex layer at or before ``layer`` (whose top-k ``layer`` uses)."""
        if self.compress_ratios[layer] == 0:
            return None
        prior = [s for s in self.index_source_layer_ids if s <= layer]
        return prior[-1] if prior else None

    def layer_kind(self, layer: int) -> str:
        if self.ratio(layer) == 0:
            return LAYER_SWA
        if layer in self.kv_source_layer_ids:
            return LAYER_FULL
        if layer in self.index_source_layer_ids:
            return LAYER_REINDEX
        return LAYER_REUSE

    def uses_candidates(self, layer: int) -> bool:
        """Whether ``layer``'s top-k is restricted to the hierarchical candidate pool."""
        c = self.candidate_source_layer_id
        return c is not None and self.kv_source_of(layer) == c and self.layer_kind(layer) == LAYER_REINDEX

    def kv_model_config(self, backtracking: int = 6, **overrides: Any) -> Any:
        """The cache-relevant part as ``deepinfer_core.kv.KVModelConfig`` (for memory planning).

        Persisted SWA layers = the encoder (the decoder's SWA is rebuilt by bounded replay).
        """
        from deepinfer_core.kv.planner import KVModelConfig

        return KVModelConfig.from_hf_config(
            self.to_dict(), backtracking=backtracking, num_persisted_layers=self.encoder_layers, **overrides
        )

    # ---------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a config.json mapping; unknown fields raise ConfigError naming them, another
        architecture's ``model_type`` says so."""
        check_architecture(d)
        known = {a.name for a in attrs.fields(cls)}
        kw: dict[str, Any] = {}
        aliases = {"window_size": "sliding_window", "n_mtp_layers": "num_nextn_predict_layers"}
        for k, v in d.items():
            k2 = aliases.get(k, k)
            if k2 in known:
                if k2 in kw and kw[k2] != v:
                    raise ConfigError(f"{k}={v!r}: conflicts with {k2}={kw[k2]!r}")
                kw[k2] = v
            elif k in _IGNORED_FIELDS:
                log.debug("config field %s ignored (no architectural meaning here)", k)
            else:
                raise ConfigError(f"{k}={v!r}: unknown config field (known: {sorted(known)})")
        required = [a.name for a in attrs.fields(cls) if a.default is attrs.NOTHING]
        absent = [r for r in required if r not in kw]
        if absent:
            raise ConfigError(f"{absent[0]}: required config field is missing (all missing: {absent})")
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config: {e}") from e

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config.json: not found at {p}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read ({e.strerror or e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: top level must be an object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ConfigError as e:  # every message names the field; the file goes in front
            raise ConfigError(f"{p}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(self, recurse=False).items()
        }

    def save_pretrained(self, path: str | Path) -> Path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        out = p / "config.json"
        out.write_text(json.dumps(self.to_dict(), indent=2))
        return out


def tiny_config(**overrides: Any) -> ModelConfig:
    """The test config of v41_flash.md: every feature on, CPU-fast."""
    kw: dict[str, Any] = dict(
        vocab_size=512, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=128, o_lora_rank=128, o_groups=2, rms_norm_eps=1e-6,
        sliding_window=16, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6], num_encoder_layers=4,
        index_n_heads=4, index_head_dim=32, index_topk=8,
        candidate_source_layer_id=4, candidate_block_size=4, candidate_topk_blocks=4,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        routed_scaling_factor=1.5, swiglu_limit=10.0,
        engram_layer_ids=[1, 3], engram_max_ngram=3, engram_n_heads=2, engram_head_dim=32,
        engram_table_sizes=[1009, 2003], hc_mult=4, hc_sinkhorn_iters=20, hc_single_pass=True,
        num_nextn_predict_layers=2, dspark_block_size=5,
        dspark_noise_token_id=511, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=16,
    )  # fmt: skip
    kw.update(overrides)
    return ModelConfig(**kw)


def flash_config(**overrides: Any) -> ModelConfig:
    """The released DeepSeek-V4.1-Flash shape (byte accounting and wide GPU benchmarks)."""
    kw: dict[str, Any] = dict(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, rms_norm_eps=1e-20,
        sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        num_encoder_layers=20, index_n_heads=32, index_head_dim=128, index_topk=512,
        candidate_source_layer_id=20, candidate_block_size=8, candidate_topk_blocks=2048,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        n_routed_experts=384, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2304,
        routed_scaling_factor=1.5, swiglu_limit=10.0,
        engram_layer_ids=[1, 14], engram_max_ngram=4, engram_n_heads=8, engram_head_dim=256,
        engram_table_sizes=[16_000_000], hc_mult=4, hc_sinkhorn_iters=20, hc_single_pass=True,
        num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256,
    )  # fmt: skip
    kw.update(overrides)
    return ModelConfig(**kw)
