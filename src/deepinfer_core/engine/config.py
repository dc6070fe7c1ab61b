"""``EngineConfig``: every knob of the reference engine, validated at construction (errors name the field)."""

from __future__ import annotations

from pathlib import Path

import attrs

MODELS = ("tiny", "tiny-random")  # or a checkpoint directory (model/checkpoint.py)
BACKENDS = ("reference", "cuda")
DTYPES = ("float32", "float64", "bfloat16")
PREEMPTION_POLICIES = ("guarded", "deepinfer")
SWA_REPLAY_MODES = ("exact", "bounded")
GRAMMAR_BACKENDS = (
    "xgrammar",
    "llguidance",
    "auto",
)  # auto: per-spec engine with fallback (structured.auto_backend)


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"EngineConfig.{field}: {msg}")


def _guard_config(v: object) -> object:
    """``kv_store_guard``: None, a ``StoreGuardConfig``, or a dict of its fields (its errors name the field)."""
    if v is None:
        return None
    from deepinfer_core.kvstore.guard import StoreGuardConfig

    if isinstance(v, dict):
        try:
            return StoreGuardConfig(**v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"EngineConfig.kv_store_guard: {e}") from None
    _check(
        isinstance(v, StoreGuardConfig),
        "kv_store_guard",
        f"{type(v).__name__}: must be None, a kvstore.StoreGuardConfig or a dict of its fields",
    )
    return v


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """What ``LLM(...)`` / ``LLMEngine`` build.

    ``model="tiny"`` is the trained tiny V4.1 checkpoint shipped in the package (its BPE tokenizer with the
    V4.1 control tokens; ``seed`` unused), ``"tiny-random"`` the same config with weights drawn from
    ``seed`` and the byte tokenizer, and a directory path any release-format checkpoint (``config.json``,
    safetensors, ``tokenizer.json``; no downloads). ``backend`` picks the device ops ("reference": torch on CPU; "cuda": the CUDA
    backend's kernels, model on the GPU). ``dtype`` / ``quantize`` choose the model dtype and whether the
    KV caches use the FP4 / FP8 / MXFP4 byte formats (off: exact raw values, what the oracle tests use).
    ``num_blocks`` x ``block_size`` is the paged KV pool; ``max_num_seqs`` bounds running requests (and
    sizes the state pool); left None they come from the device: on the ``cuda`` backend from the GPU memory
    left after the weights, ``gpu_memory_utilization`` of the card at most (engine/sizing.py; the engine logs
    what it chose), on the ``reference`` backend 1,024 blocks and 32 sequences; ``max_num_batched_tokens`` caps one step's tokens (prefill is chunked to it).
    ``async_scheduling`` plans step N+1 before step N's tokens are applied (DeepInfer's one-step-ahead
    mode; same tokens as synchronous); ``async_overlap`` (with it) launches step N+1 before the host reads
    step N's tokens, which stay on the device for N+1's inputs (engine/overlap.py; off: the host waits for
    each step's tokens before planning the next). ``batch_invariant`` (None: ``DEEPINFER_BATCH_INVARIANT``) makes a
    request's tokens bitwise independent of its batch: the step stays one executor call whose products run
    in fixed-shape row chunks (model/invariant.py; an executor without them runs each request alone).
    ``speculative`` turns on DSpark drafts verified inside the step, ``num_speculative_tokens`` drafts at
    most per request and step (None: ``DEEPINFER_USE_NEXTN_DECODE``; 0: off), how many of them each step
    verifies picked by ``spec.MTPVarlen`` (``DEEPINFER_ENABLE_MTP_VARLEN``; off: all of them). Only greedy,
    unconstrained requests draft, and scheduling is synchronous while speculating (docs/engine.md).
    ``preemption_policy``: the scheduler's victim rule under KV pressure: ``"guarded"`` (default: admission
    headroom, newest-admitted victim, bounded preemptions per request; cannot thrash) or ``"deepinfer"``
    (the seed's longest-output victim; docs/scheduler.md).
    ``prefix_caching`` reuses cached prompt blocks through the KV pool's prefix index and rebuilds the
    sliding-window state by replay (docs/swa.md): ``swa_replay="exact"`` (default: the tokens of a run
    without the cache) or ``"bounded"`` (DeepInfer's: the last ``swa_keep_tokens`` tokens, None =
    ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, decoder windows truncated to them; approximate);
    ``swa_host_bytes`` bounds the host-memory store of persisted encoder rings (LRU).
    ``kv_store`` attaches an external ``protocols.KVBlockStore`` (docs/kvstore.md; needs
    ``prefix_caching``): a GPU prefix miss continues in the store block by block (fetched blocks, then
    the SWA state by replay), and finished blocks are written back, decode's too, under the TTL of
    ``kv_store_traffic_class``. A store fault is a miss or a skipped write, never a failed request:
    ``kv_store_guard`` (a ``kvstore.StoreGuardConfig`` or a dict of its fields; None: its defaults) sets
    the store calls' timeouts and the circuit breaker (docs/kvstore.md, "Faults").
    """

    model: str = "tiny"
    seed: int = 0
    backend: str = "reference"
    dtype: str = "float32"
    quantize: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    async_scheduling: bool = True
    async_overlap: bool = True
    batch_invariant: bool | None = None
    structured_backend: str = "auto"
    speculative: bool = False
    num_speculative_tokens: int | None = None
    preemption_policy: str = "guarded"
    prefix_caching: bool = True
    swa_replay: str = "exact"
    swa_keep_tokens: int | None = None
    swa_host_bytes: int = 256 << 20
    kv_store: object | None = attrs.field(default=None, eq=False, repr=False)
    kv_store_traffic_class: str = "chatbot"
    kv_store_guard: object | None = attrs.field(default=None, converter=_guard_config)

    def __attrs_post_init__(self) -> None:
        # one group after another: the first bad field found is the one reported
        self._check_choices()
        self._check_sizes()
        self._check_options()
        self._check_switches()

    def _check_choices(self) -> None:
        _check(
            isinstance(self.model, str) and (self.model in MODELS or Path(self.model).is_dir()),
            "model",
            f"{self.model!r}: must be one of {list(MODELS)} or a checkpoint directory (no downloads here)",
        )
        _check(
            _is_int(self.seed) and 0 <= self.seed < 2**63,
            "seed",
            f"{self.seed!r}: must be an int in [0, 2**63)",
        )
        _check(self.backend in BACKENDS, "backend", f"{self.backend!r}: must be one of {list(BACKENDS)}")
        _check(self.dtype in DTYPES, "dtype", f"{self.dtype!r}: must be one of {list(DTYPES)}")

    def _check_sizes(self) -> None:
        # upper bounds: the C++ core's int32 ids and counts (a larger value would wrap, not fail)
        _check(
            _is_int(self.block_size) and 1 <= self.block_size <= 2**20,
            "block_size",
            f"{self.block_size!r}: must be an int in [1, 2**20]",
        )
        _check(
            self.num_blocks is None or (_is_int(self.num_blocks) and 2 <= self.num_blocks <= 2**31 - 1),
            "num_blocks",
            f"{self.num_blocks!r}: must be None (sized from the device) or an int in "
            "[2, 2**31 - 1] (block 0 is the null block)",
        )
        _check(
            self.max_num_seqs is None or (_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 2**20),
            "max_num_seqs",
            f"{self.max_num_seqs!r}: must be None (sized from the device) or an int in [1, 2**20]",
        )
        _check(
            isinstance(self.gpu_memory_utilization, (int, float))
            and not isinstance(self.gpu_memory_utilization, bool)
            and 0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"{self.gpu_memory_utilization!r}: must be a number in (0, 1] (the share of the GPU's memory the engine may hold)",
        )
        _check(
            _is_int(self.max_num_batched_tokens) and 1 <= self.max_num_batched_tokens <= 32768,
            "max_num_batched_tokens",
            f"{self.max_num_batched_tokens!r}: must be an int in [1, 32768]",
        )
        _check(
            _is_int(self.max_model_len) and 2 <= self.max_model_len <= 2**31 - 1,
            "max_model_len",
            f"{self.max_model_len!r}: must be an int in [2, 2**31 - 1]",
        )

    def _check_options(self) -> None:
        _check(
            self.structured_backend in GRAMMAR_BACKENDS,
            "structured_backend",
            f"{self.structured_backend!r}: must be one of {list(GRAMMAR_BACKENDS)}",
        )
        _check(
            self.preemption_policy in PREEMPTION_POLICIES,
            "preemption_policy",
            f"{self.preemption_policy!r}: must be one of {list(PREEMPTION_POLICIES)}",
        )
        _check(
            self.swa_replay in SWA_REPLAY_MODES,
            "swa_replay",
            f"{self.swa_replay!r}: must be one of {list(SWA_REPLAY_MODES)}",
        )
        _check(
            self.swa_keep_tokens is None
            or (_is_int(self.swa_keep_tokens) and 1 <= self.swa_keep_tokens <= 2**20),
            "swa_keep_tokens",
            f"{self.swa_keep_tokens!r}: must be None (from DEEPINFER_YOCO_PREFILL_KEEP_TOKENS) "
            "or an int in [1, 2**20]",
        )
        _check(
            _is_int(self.swa_host_bytes) and 0 <= self.swa_host_bytes <= 2**48,
            "swa_host_bytes",
            f"{self.swa_host_bytes!r}: must be an int in [0, 2**48] (bytes of host memory for SWA rings)",
        )

    def _check_switches(self) -> None:
        if self.kv_store is not None:
            from deepinfer_core.protocols.kvstore import KVBlockStore

            _check(
                isinstance(self.kv_store, KVBlockStore),
                "kv_store",
                f"{type(self.kv_store).__name__}: must be None or a KVBlockStore (put, get, exists, touch, delete)",
            )
            _check(
                self.prefix_caching is True,
                "kv_store",
                "needs prefix_caching=True (the store continues its hits)",
            )
        _check(
            isinstance(self.kv_store_traffic_class, str) and bool(self.kv_store_traffic_class),
            "kv_store_traffic_class",
            f"{self.kv_store_traffic_class!r}: must be a non-empty str (a TTL class)",
        )
        ttl = getattr(self.kv_store, "ttl", None)
        known = getattr(ttl, "ttls_s", None)
        if self.kv_store is not None and isinstance(
            known, dict
        ):  # a class the store's TTL policy lacks fails now
            _check(
                self.kv_store_traffic_class in known,
                "kv_store_traffic_class",
                f"{self.kv_store_traffic_class!r}: the store's TTL policy knows only {sorted(known)}",
            )
        for name in ("quantize", "async_scheduling", "async_overlap", "speculative", "prefix_caching"):
            _check(isinstance(getattr(self, name), bool), name, f"{getattr(self, name)!r}: must be a bool")
        _check(
            self.num_speculative_tokens is None
            or (_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 5),
            "num_speculative_tokens",
            f"{self.num_speculative_tokens!r}: must be None (from "
            "DEEPINFER_USE_NEXTN_DECODE) or an int in [0, 5]",
        )
        _check(
            self.batch_invariant is None or isinstance(self.batch_invariant, bool),
            "batch_invariant",
            f"{self.batch_invariant!r}: must be None (from DEEPINFER_BATCH_INVARIANT) or a bool",
        )
