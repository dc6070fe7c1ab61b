"""Plain data of the step planner: configuration, requests, plans and finished requests."""

from __future__ import annotations

import enum
import math

import attrs
import numpy as np

from deepinfer_core import _C
from deepinfer_core.sampling_params import SamplingParams

_dense = _C.scheduler.dense_block_tables  # CSR -> padded rows in one C++ pass
_NO_ROWS = np.zeros(0, np.int64)
_gather_names = _C.scheduler.gather_names  # plan.request_ids: a list of cached str objects in one pass

MAX_STEP_TOKENS = 32768  # DeepInfer's hard cap on tokens in one step (deployment Q&A)


class EngineType(enum.IntEnum):
    """What an engine runs (DeepInfer's EngineType)."""

    NORMAL = 0  # prefill and decode (never mixed in one step)
    PROMPT = 1  # prefill only: a request leaves after its prompt is computed and one token sampled
    COMPLETION = 2  # decode only: requests arrive with their prompt KV (loaded into blocks we reserve)


class PreemptionPolicy(enum.IntEnum):
    """Which request a decode step evicts when the KV pool runs out, and what admission holds back.

    GUARDED (default): decode rows in admission order, the victim is the most recently admitted request;
    admission keeps free what the running requests grow into over ``headroom_steps`` decode steps; a
    request preempted ``max_preemptions`` times is re-admitted with the KV of its whole possible length
    reserved and is never preempted again. DEEPINFER: the seed's rule (shortest output decoded first,
    longest output evicted, only ``watermark_blocks`` held back), which can evict the same request over
    and over under tight KV (docs/scheduler.md has the measurements)."""

    GUARDED = 0
    DEEPINFER = 1


class StepType(enum.IntEnum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS (unless ignore_eos) or a stop token id, once min_tokens outputs exist
    LENGTH = 2  # max_tokens outputs (or max_model_len tokens in all)
    ABORT = 3  # abort() by id
    HANDOFF = 4  # PROMPT engine: prompt computed, first token sampled, KV handed to a decode engine
    FAILED = 5  # the request could not be served (e.g. the executor returned an invalid token for it)


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"SchedulerConfig.{field}: {msg}")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Knobs of one rank's scheduler. Validated here; the C++ core checks them again.

    ``time_budget_ns`` bounds a prefill step's predicted time (``None``: only the token cap binds);
    it must allow one token of the longest request (``cost(1, max_model_len - 1)``).
    ``prefill_attempt_interval`` / ``prefill_any_attempt_interval``: decode steps (since the last
    prefill step) after which the group switches to prefill when all / any ranks have prefill work.
    """

    engine_type: EngineType = EngineType.NORMAL
    max_num_seqs: int = 256
    max_num_batched_tokens: int = MAX_STEP_TOKENS
    max_model_len: int = 8192
    eos_token_id: int | None = None
    time_budget_ns: float | None = None
    prefill_attempt_interval: int = 2
    prefill_any_attempt_interval: int = 16
    async_mode: bool = False
    watermark_blocks: int = 0
    preemption_policy: PreemptionPolicy = PreemptionPolicy.GUARDED
    max_preemptions: int = 2
    headroom_steps: int = 8
    # prefix sharing at admission (0: off; see Scheduler.set_prefix_sharing, which sets these)
    prefix_align: int = 0
    prefix_tail: int = 1

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.engine_type, EngineType),
            "engine_type",
            f"{self.engine_type!r} must be an EngineType",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"{self.max_num_seqs} must be >= 1")
        _check(
            1 <= self.max_num_batched_tokens <= MAX_STEP_TOKENS,
            "max_num_batched_tokens",
            f"{self.max_num_batched_tokens} must be in [1, {MAX_STEP_TOKENS}]",
        )
        _check(self.max_model_len >= 2, "max_model_len", f"{self.max_model_len} must be >= 2")
        _check(self.eos_token_id is None or self.eos_token_id >= 0, "eos_token_id", "must be None or >= 0")
        _check(
            self.time_budget_ns is None or (self.time_budget_ns > 0 and not math.isnan(self.time_budget_ns)),
            "time_budget_ns",
            f"{self.time_budget_ns} must be None or > 0",
        )
        _check(self.prefill_attempt_interval >= 0, "prefill_attempt_interval", "must be >= 0")
        _check(
            self.prefill_any_attempt_interval >= self.prefill_attempt_interval,
            "prefill_any_attempt_interval",
            f"{self.prefill_any_attempt_interval} must be >= prefill_attempt_interval={self.prefill_attempt_interval}",
        )
        _check(self.watermark_blocks >= 0, "watermark_blocks", "must be >= 0")
        _check(
            isinstance(self.preemption_policy, PreemptionPolicy),
            "preemption_policy",
            f"{self.preemption_policy!r} must be a PreemptionPolicy (GUARDED or DEEPINFER)",
        )
        _check(
            isinstance(self.max_preemptions, int) and self.max_preemptions >= 0,
            "max_preemptions",
            f"{self.max_preemptions!r} must be an int >= 0",
        )
        _check(
            isinstance(self.headroom_steps, int) and 0 <= self.headroom_steps <= 2**20,
            "headroom_steps",
            f"{self.headroom_steps!r} must be an int in [0, 2**20]",
        )
        _check(
            isinstance(self.prefix_align, int) and self.prefix_align >= 0,
            "prefix_align",
            f"{self.prefix_align!r} must be an int >= 0 (0: off), a multiple of the pool's block size",
        )
        _check(
            isinstance(self.prefix_tail, int) and self.prefix_tail >= 1,
            "prefix_tail",
            f"{self.prefix_tail!r} must be an int >= 1",
        )


def _prompt(v: object) -> tuple[int, ...]:
    a = np.asarray(v)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"Request.prompt_token_ids: must be integer token ids, got dtype {a.dtype}")
    return tuple(int(t) for t in a.reshape(-1).tolist())


@attrs.frozen
class Request:
    """One generation request: string id, prompt token ids, sampling and stopping parameters.

    For a COMPLETION engine the prompt's KV is present for all tokens but the last, which is the first
    token the decode engine feeds (in a P/D split: the token the PROMPT engine sampled).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_prompt)
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)


@attrs.frozen
class FinishedRequest:
    """A request that ended (reported exactly once, by the ``update`` that follows its end)."""

    request_id: str
    finish_reason: FinishReason
    output_token_ids: tuple[int, ...]
    num_preemptions: int
    handoff_block_ids: np.ndarray | None = None  # PROMPT engine: blocks holding its KV at hand-off


class Plan:
    """One step's plan. Row ``i`` computes ``num_tokens[i]`` tokens of sequence ``seq_ids[i]`` starting
    at position ``start[i]``; its input tokens are ``token_ids[offsets[i]:offsets[i+1]]`` where ``-1``
    is a placeholder for the token the previous step sampled for that sequence (asynchronous mode).
    Rows with ``sample[i]`` produce one token (a verify row, ``num_drafts[i] = k > 0``: 1..1 + k tokens;
    its last k input tokens are ``-1`` placeholders for the caller's drafts).

    Block tables come compact: row ``i``'s KV blocks are ``block_ids[block_offsets[i]:block_offsets[i+1]]``
    (CSR, no padding). ``block_tables`` is the dense ``[rows, widest row]`` view padded with the null
    block 0, built on demand (``dense_block_tables(rows)`` builds only some rows).

    Not an attrs class on purpose: the arrays are views of the core's two flat buffers, sliced when read
    (a view costs ~0.1 us; building all of them up front was half of an empty step's cost). Every
    array read is a fresh view of the same buffer, so writes through one are seen by the next.
    """

    __slots__ = (
        "_base",
        "_blk",
        "_i32",
        "_i64",
        "_names",
        "_names_at",
        "_nblk",
        "_nk",
        "_npre",
        "_ntok",
        "_rcap",
        "_tok",
        "num_rows",
        "predicted_ns",
        "preempted",
        "step_id",
        "step_type",
        "width",
    )

    def __init__(
        self, raw: tuple, preempted: tuple[str, ...], names: np.ndarray, base: int, names_at: int
    ) -> None:
        (
            step_id,
            step_type,
            self._i32,
            self._i64,
            self.num_rows,
            self._ntok,
            self._nblk,
            self._npre,
            self._nk,
            self.predicted_ns,
            self.width,
            rcap,
            tcap,
        ) = raw
        self._rcap = rcap
        self._tok = 7 * rcap + 1  # start of token_ids; block_ids follow the token region
        self._blk = self._tok + tcap
        self.step_id = step_id
        self.step_type = StepType(step_type)
        self.preempted = preempted  # request ids, in eviction order
        # request id by seq id - base (request_ids); names_at: the address of names' data (held alive here)
        self._names, self._base, self._names_at = names, base, names_at

    def __repr__(self) -> str:
        return (
            f"Plan(step_id={self.step_id}, step_type={self.step_type.name}, rows={self.num_rows}, "
            f"tokens={self._ntok}, blocks={self._nblk}, preempted={self.preempted})"
        )

    # ---- the arrays: regions of the core's two buffers, which it wrote the plan into; R = row capacity,
    #      T = token capacity (int32: num_tokens | start | sample | num_drafts | cached | kv_load_num_tokens,
    #      R each | block_offsets R + 1 | token_ids T | block_ids; int64: seq_ids | kv_load_seq_ids, R each |
    #      preempted)
    @property
    def seq_ids(self) -> np.ndarray:
        """int64 [n]: the scheduler's sequence id of each row."""
        return self._i64[: self.num_rows]

    @property
    def num_tokens(self) -> np.ndarray:
        """int32 [n]: tokens the row computes."""
        return self._i32[: self.num_rows]

    @property
    def start(self) -> np.ndarray:
        """int32 [n]: position of the row's first new token (its KV length before the step)."""
        a = self._rcap
        return self._i32[a : a + self.num_rows]

    @property
    def sample(self) -> np.ndarray:
        """int32 [n]: 1 where the row samples a token."""
        a = 2 * self._rcap
        return self._i32[a : a + self.num_rows]

    @property
    def num_drafts(self) -> np.ndarray:
        """int32 [n]: drafts a verify row checks (its last num_drafts input tokens)."""
        a = 3 * self._rcap
        return self._i32[a : a + self.num_rows]

    @property
    def token_ids(self) -> np.ndarray:
        """int32 [sum(num_tokens)]: flat input tokens, -1 = placeholder."""
        return self._i32[self._tok : self._tok + self._ntok]

    @property
    def block_offsets(self) -> np.ndarray:
        """int32 [n + 1]: row i's blocks are block_ids[block_offsets[i]:block_offsets[i+1]]."""
        a = 6 * self._rcap
        return self._i32[a : a + self.num_rows + 1]

    @property
    def block_ids(self) -> np.ndarray:
        """int32 [block_offsets[-1]]: every row's KV block ids, row after row."""
        return self._i32[self._blk : self._blk + self._nblk]

    @property
    def kv_load_seq_ids(self) -> np.ndarray:
        """int64: COMPLETION admissions whose KV the caller must load."""
        return self._i64[self._rcap : self._rcap + self._nk]

    @property
    def kv_load_num_tokens(self) -> np.ndarray:
        """int32: how many tokens of KV each of kv_load_seq_ids needs."""
        a = 5 * self._rcap
        return self._i32[a : a + self._nk]

    @property
    def cached(self) -> np.ndarray:
        """int32 [n]: -1, or for a row that is the first of an admission this step, the tokens of the
        shared cached prefix it starts after (0: no hit; prefix sharing, ``Scheduler.set_prefix_sharing``)."""
        a = 4 * self._rcap
        return self._i32[a : a + self.num_rows]

    @property
    def block_tables(self) -> np.ndarray:
        """int32 [n, width]: the dense view, padded with the null block 0 (built on each read)."""
        return self.dense_block_tables()

    def dense_block_tables(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Dense ``[len(rows), width]`` block tables of ``rows`` (default: all rows), padded with 0,
        the width being the widest row of the whole plan (so any subset lines up with the full view)."""
        if rows is None:
            flat = _dense(self.block_offsets, self.block_ids, _NO_ROWS, True, self.width)
            return flat.reshape(self.num_rows, self.width)
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (self.num_rows,):
                raise ValueError(f"rows: a boolean mask must have shape ({self.num_rows},), got {rows.shape}")
            rows = np.flatnonzero(rows)
        elif rows.dtype.kind not in "iu" and rows.size:
            raise ValueError(f"rows: must be row indices or a boolean mask, got dtype {rows.dtype}")
        rows = np.ascontiguousarray(rows.reshape(-1), np.int64)
        rows = np.where(rows < 0, rows + self.num_rows, rows)  # numpy-style negative indices
        try:
            flat = _dense(self.block_offsets, self.block_ids, rows, False, self.width)
        except IndexError as e:
            raise IndexError(f"dense_block_tables: {e}") from None
        return flat.reshape(rows.shape[0], self.width)

    # ---- derived --------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return self._ntok

    @property
    def context_lens(self) -> np.ndarray:
        """KV length of each row after the step (start + num_tokens)."""
        return self.start + self.num_tokens

    @property
    def request_ids(self) -> list[str]:
        """The request id of each row (one gather in the core; valid for as long as the plan lives)."""
        return _gather_names(self._names_at, self._names.shape[0], self._i64, self.num_rows, self._base)

    def request_id_array(self) -> np.ndarray:
        """object [n]: the request id of each row, as a numpy array (no list built)."""
        return self._names.take(self.seq_ids - self._base)  # take: ~1.6x faster than fancy indexing

    @property
    def num_scheduled(self) -> dict[str, int]:
        """vLLM-style view: ``{request_id: num_new_tokens}``."""
        return dict(zip(self.request_ids, self.num_tokens.tolist()))

    def positions(self) -> np.ndarray:
        """Flat position of every input token, vectorised (no per-row Python loop)."""
        total = self.total_tokens
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        nt = self.num_tokens
        offsets = np.concatenate(([0], np.cumsum(nt[:-1], dtype=np.int64)))
        return np.arange(total, dtype=np.int64) + np.repeat(self.start.astype(np.int64) - offsets, nt)
