"""Plain data across the executor seam (``protocols.ModelExecutor``): the batch a step runs, what it returns,
and the error naming a bad request. Neutral (no component of its own): the model executes it, the engine
and the SWA replay runner (``swa.run``) build it."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch


def _i64(a: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int64))


def _opt_i64(a: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
    return None if a is None else _i64(a)


def _opt_bool(a: Sequence[bool] | np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(np.asarray(a, dtype=bool))


def _opt_f64(a: Sequence[float] | np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(np.asarray(a, dtype=np.float64))


def _i32_2d(a: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    arr = np.asarray(a, dtype=np.int32)
    if arr.ndim == 1 and arr.size == 0:
        arr = arr.reshape(0, 0)
    return np.ascontiguousarray(arr)


class BatchError(ValueError):
    """A request of the batch is invalid. ``request`` is its index (None: the batch as a whole).

    Raised before any cache is touched, so the caller can drop that request and run the rest.
    """

    def __init__(self, request: int | None, field: str, msg: str) -> None:
        self.request, self.field = request, field
        where = "batch" if request is None else f"request {request}"
        super().__init__(f"{where}: {field}: {msg}")


@attrs.frozen(kw_only=True)
class ForwardBatch:
    """One step: a flat list of query tokens, request by request (prefill chunks, decodes, drafts).

    Request i owns rows [offset_i, offset_i + query_lens[i]) at positions start_pos[i] + 0, 1, ...;
    ``start_pos`` is how many tokens of the sequence are already in its caches (a smaller value than
    last time rolls the last tokens back). ``block_tables`` [R, W] int32 (null block 0 as padding) and
    ``state_slots`` [R] come from the KV block pool and the state pool. The last ``num_logits[i]`` rows
    of request i get logits (1 for a decode or a final prefill chunk, 1 + drafts when verifying, 0 for
    an intermediate chunk).
    """

    token_ids: np.ndarray = attrs.field(converter=_i64)
    query_lens: np.ndarray = attrs.field(converter=_i64)
    start_pos: np.ndarray = attrs.field(converter=_i64)
    block_tables: np.ndarray = attrs.field(converter=_i32_2d)
    state_slots: np.ndarray = attrs.field(converter=_i64)
    num_logits: np.ndarray = attrs.field(converter=_i64)
    # CED prefix prefill: run the encoder and write the first decoder layer's global KV, nothing more
    # (decoder SWA rings are left for bounded replay); no logits are produced.
    encoder_only: bool = False
    # layers whose output residual state is returned for the logits rows (e.g. DSpark's target layers)
    capture_layers: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(int(x) for x in v))
    # DSpark (None = all zeros / False): verify_lens[i] = how many of request i's last fed tokens are
    # drafts this executor made last step (verified losslessly against this step's logits, which needs
    # num_logits >= verify_lens + 1); draft[i] = after this step, draft the next block for request i
    # from its accepted / sampled token; temperature[i] (0 = greedy) for sampling and verification.
    verify_lens: np.ndarray | None = attrs.field(default=None, converter=_opt_i64)
    draft: np.ndarray | None = attrs.field(default=None, converter=_opt_bool)
    temperature: np.ndarray | None = attrs.field(default=None, converter=_opt_f64)
    # SWA bounded replay (deepinfer_core.swa; None = all zeros): decoder_floor[i] > 0 truncates request
    # i's decoder windows: decoder layers attend only to SWA keys at positions >= it, in this step and
    # every later one of the slot (a restart at 0 clears it). It is how a step starts on a slot whose
    # decoder rings hold nothing (after encoder-only steps): decoder_floor = start_pos.
    # snapshot_pos[i] > 0 (in (start, start + query_len]) returns the encoder SWA rings as they are at
    # that position in ForwardOutput.snapshots (the persisted half of the state block).
    decoder_floor: np.ndarray | None = attrs.field(default=None, converter=_opt_i64)
    snapshot_pos: np.ndarray | None = attrs.field(default=None, converter=_opt_i64)

    @property
    def num_requests(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        """Row offset of each request, [R + 1]."""
        return np.concatenate(([0], np.cumsum(self.query_lens)))

    @property
    def positions(self) -> np.ndarray:
        """Position of every row [N]."""
        if self.num_requests == 0:
            return np.zeros(0, np.int64)
        # row j of request i sits at start_pos[i] + (j - offset[i]): one repeat, no per-request arrays
        n = self.query_lens.astype(np.int64)
        return np.arange(int(n.sum()), dtype=np.int64) + np.repeat(
            self.start_pos.astype(np.int64) - self.offsets[:-1], n
        )

    def logit_rows(self) -> np.ndarray:
        """Flat row index of every row that gets logits, request by request."""
        n = self.query_lens.astype(np.int64)
        if n.size == 0:
            return np.zeros(0, np.int64)
        k = self.num_logits
        if k.shape == n.shape and (k == n).all() and int(n.min()) >= 0:  # every row (e.g. a decode step)
            return np.arange(int(n.sum()), dtype=np.int64)
        # the last num_logits rows of each request, in row order
        first = np.repeat(n - self.num_logits.astype(np.int64), n)
        local = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(self.offsets[:-1], n)
        return np.flatnonzero(local >= first).astype(np.int64)


@attrs.frozen(kw_only=True)
class ForwardOutput:
    """Logits [M, V] for ``logit_rows`` (flat row ids, request by request) and expert load.

    ``expert_counts`` [num_layers, n_routed_experts] int64: tokens each routed expert received in
    this step, layer by layer (the load source of EPLB). ``request_of_logit`` [M] maps a logits row
    back to its request index. ``captured`` holds the requested layers' output states for those rows.
    """

    logits: torch.Tensor
    logit_rows: np.ndarray
    request_of_logit: np.ndarray
    expert_counts: torch.Tensor
    # {layer id: residual state [M, D] after that layer (streams summed)} for capture_layers, logits rows
    captured: dict[int, torch.Tensor] = attrs.field(factory=dict)
    # DSpark, for requests with verify_lens > 0 or draft (else 0 / -1 / NaN): drafts accepted, the token
    # that follows them (correction or bonus; the next step feeds it at position start + query_len -
    # verify_lens + num_accepted), the new drafts [R, block] and their confidences [R, block]
    num_accepted: torch.Tensor | None = None
    next_token: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    draft_confidence: torch.Tensor | None = None
    # {request index: uint8 [encoder layers, ring, bytes]} for requests with snapshot_pos > 0; ring index
    # = position % ring; valid for positions [snapshot_pos - window + 1, snapshot_pos)
    snapshots: dict[int, torch.Tensor] = attrs.field(factory=dict)
