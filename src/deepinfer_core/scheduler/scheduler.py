"""Python face of the C++ step planner (``_C.scheduler.StepScheduler``).

All per-request work (admission, chunking, block appends, preemption, stop checks) runs in C++ with the
GIL released; Python only maps string request ids to the pool's int64 sequence ids and wraps arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from deepinfer_core import _C
from deepinfer_core.protocols.scheduler import StepVote
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler.cost_model import CostModel
from deepinfer_core.scheduler.types import (
    FinishedRequest,
    FinishReason,
    Plan,
    Request,
    SchedulerConfig,
)
from deepinfer_core.scheduler.vote import LocalVote

logger = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1
_NO_COUNTS = np.zeros(0, np.int32)
_I32 = np.dtype(np.int32)
MAX_DRAFTS = int(_C.scheduler.MAX_DRAFTS)  # drafts one verify row may carry


def _draft_arrays(seq_ids: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check the array form's shapes and dtypes (vectorised) and return C-contiguous int64 / int32
    copies or views; ranges, duplicates and liveness are checked by the core (all-or-nothing)."""
    if seq_ids is None or counts is None:
        raise ValueError("draft_seq_ids / draft_counts: give both (or neither)")
    seqs, ks = np.asarray(seq_ids), np.asarray(counts)
    for name, a in (("draft_seq_ids", seqs), ("draft_counts", ks)):
        if a.ndim != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {a.shape}")
        # an empty list arrives as float64; anything else must be an integer array (no bools, floats)
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
            raise ValueError(f"{name}: must be an integer array, got dtype {a.dtype}")
    if seqs.shape != ks.shape:
        raise ValueError(f"draft_seq_ids / draft_counts: lengths differ ({seqs.size} vs {ks.size})")
    if ks.dtype != np.int32 and ks.size and (ks.min() < 0 or ks.max() > MAX_DRAFTS):
        # checked before the cast so a huge value cannot wrap into range
        bad = int(np.flatnonzero((ks < 0) | (ks > MAX_DRAFTS))[0])
        raise ValueError(
            f"draft_counts[{bad}]={int(ks[bad])} (draft_seq_ids[{bad}]={int(seqs[bad])}): "
            f"must be in [0, {MAX_DRAFTS}]"
        )
    if seqs.dtype == np.uint64 and seqs.size and seqs.max() > np.iinfo(np.int64).max:
        bad = int(np.argmax(seqs))
        raise ValueError(f"draft_seq_ids[{bad}]={int(seqs[bad])}: not a live request of this scheduler")
    return np.ascontiguousarray(seqs, np.int64), np.ascontiguousarray(ks, np.int32)


class Scheduler:
    """Per-step planner of one DP rank over a KV block pool.

    ``pool`` is a ``deepinfer_core.kv.PagedKVPool`` (its C++ ``.impl`` is used directly) or a raw
    ``_C.kv.BlockPool``. The scheduler creates and frees the pool sequences of its requests; give it a
    pool that nothing else allocates sequence ids in, or set ``first_seq_id`` past them.

    Why the concrete C++ pool and not the ``KVBlockPool`` protocol: ``schedule()`` runs in C++ with the
    GIL released and reserves, appends and frees blocks inside that call (admission, chunking,
    preemption, prefix sharing by refcount), thousands of pool operations a step; through a Python
    protocol each would be a GIL round trip, the cost the C++ planner exists to avoid (docs/scheduler.md).
    The seam between the two is therefore the C++ ``BlockPool`` class itself (one object that the engine's
    ``PagedKVPool`` and the scheduler share), and the scheduler refuses anything else by type.

    One step: ``plan = schedule()``; run the model; ``ended = update(plan, sampled)`` where ``sampled``
    holds one token per plan row (ignored for rows that do not sample). With ``async_mode`` the next
    ``schedule()`` may come before the previous ``update`` (one step ahead, placeholders ``-1`` in
    ``plan.token_ids``); updates must follow schedule order.
    """

    def __init__(
        self,
        pool: Any,
        config: SchedulerConfig | None = None,
        *,
        cost_model: CostModel | None = None,
        vote: StepVote | None = None,
        first_seq_id: int = 1,
    ) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.vote: StepVote = vote if vote is not None else LocalVote()
        impl = getattr(pool, "impl", pool)
        if not isinstance(impl, _C.kv.BlockPool):
            raise TypeError(f"pool: expected a PagedKVPool or _C.kv.BlockPool, got {type(pool).__name__}")
        self.pool = pool
        cfg = self.config
        self._impl = _C.scheduler.StepScheduler(
            impl,
            int(cfg.engine_type),
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.max_model_len,
            -1 if cfg.eos_token_id is None else cfg.eos_token_id,
            0.0 if cfg.time_budget_ns is None else float(cfg.time_budget_ns),
            cfg.prefill_attempt_interval,
            cfg.prefill_any_attempt_interval,
            cfg.async_mode,
            cfg.watermark_blocks,
            list(self.cost_model.as_tuple()),
            int(cfg.preemption_policy),
            cfg.max_preemptions,
            cfg.headroom_steps,
        )
        if cfg.prefix_align:  # (a copy of a sharing scheduler's config shares too, e.g. P/D's PROMPT side)
            self.set_prefix_sharing(cfg.prefix_align, cfg.prefix_tail)
        # One rank deciding alone: wish, vote and schedule in one core call.
        self._local = type(self.vote) is LocalVote
        self._next_seq = int(first_seq_id)
        self._seq_of: dict[str, int] = {}  # live (not yet reported ended) request id -> seq id
        self._id_of: dict[int, str] = {}  # seq id -> request id, kept while any plan may mention it
        # Request ids by seq id - _names_base, for plan.request_ids (one numpy gather per plan). Grown
        # by replacement, never in place below the live window: a plan keeps the array it was planned
        # with, so its names stay valid for as long as the plan lives, while dropped windows are freed.
        self._names_base = self._next_seq
        self._names = np.empty(1024, dtype=object)
        self._names_at = self._names.__array_interface__["data"][0]  # for the core's list gather

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; invalid input raises ``ValueError`` naming the field, nothing is queued."""
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a scheduler.Request, got {type(request).__name__}")
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id: must be a non-empty str, got {rid!r}")
        if rid in self._seq_of:
            raise ValueError(f"request_id={rid!r}: already queued or running")
        sp = request.sampling_params
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"request {rid!r}: sampling_params must be a SamplingParams")
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
        if prompt.size and (prompt.min() < 0 or prompt.max() > _INT32_MAX):
            raise ValueError(f"request {rid!r}: prompt_token_ids must be in [0, {_INT32_MAX}]")
        seq = self._next_seq
        try:
            self._impl.add_request(
                seq,
                np.ascontiguousarray(prompt, dtype=np.int32),
                # None: as many as max_model_len leaves (SamplingParams' vLLM rule)
                sp.max_tokens
                if sp.max_tokens is not None
                else max(1, self.config.max_model_len - prompt.size),
                sp.min_tokens,
                sp.ignore_eos,
                [int(t) for t in sp.stop_token_ids],
            )
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        self._next_seq += 1
        self._seq_of[rid] = seq
        self._id_of[seq] = rid
        idx = seq - self._names_base
        if idx >= self._names.shape[0]:
            self._grow_names(seq)
            idx = seq - self._names_base
        self._names[idx] = rid

    def _grow_names(self, seq: int) -> None:
        """New names window from the oldest seq id any outstanding plan or live request can name (amortised
        O(1) per request: the window at least doubles relative to what it keeps)."""
        lo = min(self._id_of) if self._id_of else seq
        keep = self._names[lo - self._names_base : seq - self._names_base]
        names = np.empty(max(1024, 2 * (seq + 1 - lo)), dtype=object)
        names[: keep.shape[0]] = keep
        self._names, self._names_base = names, lo
        self._names_at = names.__array_interface__["data"][0]

    def abort(self, request_id: str) -> bool:
        """End a request now (its blocks are freed at once); reported by the next ``update``."""
        seq = self._seq_of.get(request_id)
        return seq is not None and bool(self._impl.abort(seq))

    def set_prefix_sharing(self, align: int, tail: int) -> None:
        """Admit requests onto the pool's cached prefix blocks, shared by refcount (``align`` 0: off).

        An admission matches the prefix index (no extra key) over the first ``known - tail`` tokens,
        rounded down to ``align`` tokens (a multiple of the block size), takes those blocks into its
        table, fresh blocks for the rest, and starts computing after them; ``plan.cached`` reports the
        hit of each row that begins an admission. ``tail`` (>= 1) tokens are always computed, so a request
        only ever writes its own blocks. ``ValueError`` naming the field for other values.
        """
        for name, v in (("align", align), ("tail", tail)):
            if not isinstance(v, int | np.integer) or isinstance(v, bool):
                raise ValueError(f"{name}: must be an int, got {v!r}")
        bs = int(getattr(self.pool, "impl", self.pool).block_size)
        if align < 0 or align % bs:
            raise ValueError(f"align: {align} must be 0 (off) or a positive multiple of block_size={bs}")
        if tail < 1:
            raise ValueError(f"tail: {tail} must be >= 1 (the last prompt token is always computed)")
        self._impl.set_prefix_sharing(int(align), int(tail))
        self.config = attrs.evolve(self.config, prefix_align=int(align), prefix_tail=int(tail))

    def has_unfinished(self) -> bool:
        """True while a request is waiting or running, a plan awaits ``update``, or an ended request
        awaits being reported by ``update``."""
        return bool(self._impl.has_unfinished())

    # ---- one step -------------------------------------------------------------------------------
    def step_wish(self) -> tuple[bool, bool]:
        """This rank's (has prefill work it can start now, has decode work), for the group vote."""
        prefill, decode = self._impl.wish()
        return bool(prefill), bool(decode)

    def schedule(
        self,
        group: tuple[bool, bool, bool] | None = None,
        num_draft_tokens: Mapping[str, int] | None = None,
        *,
        draft_seq_ids: Any = None,
        draft_counts: Any = None,
    ) -> Plan:
        """Plan the next step. ``group`` is the DP group's (all have prefill, any has prefill, any has
        decode); by default this rank's wish goes through ``self.vote``.

        Verify rows (speculative decoding) are asked for in one of two equivalent forms:

        - ``draft_seq_ids`` (int64 [n], the scheduler's sequence ids, as in ``plan.seq_ids`` /
          ``seq_id()``) with ``draft_counts`` (int32 [n], k per entry): the fast form, validated
          vectorised and in C++ without a per-request Python step;
        - ``num_draft_tokens`` ({request id: k}): converted to the arrays above (one dict lookup per
          entry, ~0.4 us each).

        A decode request's row becomes ``[last token, k drafts]`` (the drafts are ``-1`` placeholders the
        caller fills; ``plan.num_drafts`` gives the k actually planned, which may be smaller: capped by
        max_tokens, the token cap and free KV, and 0 while a verify row of the request is still
        outstanding). Its ``update`` then takes 1..1 + k tokens for that row (see ``update``). Invalid
        input (k outside [0, 64], an id given twice or not live, mismatched arrays) raises ``ValueError``
        naming the field and changes nothing; a live request that has ended but is not yet reported by
        ``update`` (e.g. aborted) is skipped."""
        if draft_seq_ids is not None or draft_counts is not None:
            if num_draft_tokens is not None:
                raise ValueError("num_draft_tokens: give either it or draft_seq_ids / draft_counts, not both")
            seqs, ks = _draft_arrays(draft_seq_ids, draft_counts)
            if seqs.size:
                self._impl.set_drafts(seqs, ks)
        elif num_draft_tokens:
            self._impl.set_drafts(*self._drafts_from_dict(num_draft_tokens))
        if group is not None:
            raw = self._impl.schedule(bool(group[0]), bool(group[1]), bool(group[2]))
        elif self._local:
            raw = self._impl.schedule_local()
        else:
            all_p, any_p, any_d = self.vote.decide(*self._impl.wish())
            raw = self._impl.schedule(bool(all_p), bool(any_p), bool(any_d))
        preempted: tuple[str, ...] = ()
        npre = raw[7]
        if npre:
            a = 2 * raw[11]  # the preempted region follows seq_ids and kv_load_ids (row capacity each)
            preempted = tuple(self._id_of[s] for s in raw[3][a : a + npre].tolist())
            logger.debug("step %d preempted %s", raw[0], preempted)
        return Plan(raw, preempted, self._names, self._names_base, self._names_at)

    def update(self, plan: Plan, result: Any, num_sampled: Any = None) -> list[FinishedRequest]:
        """Apply ``plan``'s sampled tokens; return every request that ended since the previous
        ``update`` (stopped, length, handed off, aborted or failed), each exactly once.

        ``num_sampled`` None: ``result`` holds one token per row. Otherwise ``num_sampled[i]`` tokens of
        row i lie flat in ``result``: for a sampling row 1..1 + ``plan.num_drafts[i]`` (its accepted
        drafts, then the correction / bonus token), for a row that does not sample 0 or 1 (ignored).
        Tokens are stop-checked one by one; those after a stop are dropped."""
        if (
            type(result) is np.ndarray
            and result.dtype is _I32
            and result.ndim == 1
            and result.flags.c_contiguous
        ):
            sampled = result  # the executor's usual form: no conversion
        else:
            sampled = np.ascontiguousarray(np.asarray(result).reshape(-1), dtype=np.int32)
        counts = (
            _NO_COUNTS
            if num_sampled is None
            else np.ascontiguousarray(np.asarray(num_sampled).reshape(-1), np.int32)
        )
        ended = self._impl.update(plan.step_id, sampled, counts)
        if not ended:
            return []
        out: list[FinishedRequest] = []
        for seq, reason, output, blocks, npre in ended:
            rid = self._id_of.pop(seq)
            del self._seq_of[rid]
            fr = FinishReason(reason)
            if fr is FinishReason.FAILED:
                logger.warning("request %r failed: the executor returned an invalid token for it", rid)
            out.append(FinishedRequest(rid, fr, tuple(output.tolist()), int(npre), blocks))
        return out

    def _drafts_from_dict(self, num_draft_tokens: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """{request id: k} -> (seq ids int64, k int32), checked here so errors name the request id."""
        seqs, ks = [], []
        for rid, k in num_draft_tokens.items():
            seq = self._seq_of.get(rid)
            if seq is None:
                raise ValueError(f"num_draft_tokens: request {rid!r} is not live")
            if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
                raise ValueError(f"num_draft_tokens[{rid!r}]: {k!r} must be an int")
            if not 0 <= k <= MAX_DRAFTS:
                raise ValueError(f"num_draft_tokens[{rid!r}]={k}: must be in [0, {MAX_DRAFTS}]")
            seqs.append(seq)
            ks.append(int(k))
        return np.asarray(seqs, np.int64), np.asarray(ks, np.int32)

    # ---- inspection -----------------------------------------------------------------------------
    def seq_id(self, request_id: str) -> int:
        return self._seq_of[request_id]

    def request_info(self, request_id: str) -> dict[str, int]:
        """status, num_computed, pending, schedule_cnt, process_cnt, num_preemptions, output_len."""
        keys = (
            "status",
            "num_computed",
            "pending",
            "schedule_cnt",
            "process_cnt",
            "num_preemptions",
            "output_len",
        )
        return dict(zip(keys, self._impl.request_info(self._seq_of[request_id])))

    def known_output_len(self, request_id: str) -> int:
        """Output tokens whose values are known (``output_len - pending``: async scheduling counts the
        in-flight step's tokens as output before their values land); KeyError when not in the scheduler."""
        info = self._impl.request_info(self._seq_of[request_id])
        return int(info[6]) - int(info[2])

    def output_token_ids(self, request_id: str) -> list[int]:
        return list(self._impl.output_tokens(self._seq_of[request_id]))

    @property
    def num_live(self) -> int:
        """Requests not ended (waiting, prefilling, decoding or awaiting their hand-off token)."""
        return int(self._impl.num_live)

    @property
    def num_waiting(self) -> int:
        return int(self._impl.num_waiting)

    @property
    def num_running(self) -> int:
        return int(self._impl.num_running)

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far (every eviction counts, the same request's repeats too)."""
        return int(self._impl.total_preemptions)

    @property
    def discarded_tokens(self) -> int:
        """Computed KV tokens that preemptions threw away (recomputed when the victims return)."""
        return int(self._impl.discarded_tokens)

    @property
    def decode_steps_since_prefill(self) -> int:
        return int(self._impl.decode_steps_since_prefill)

    def check_invariants(self) -> None:
        """Full consistency check of the C++ state (tests); raises RuntimeError on a violation."""
        self._impl.check_invariants()
