"""Verify-length policies behind the ``VerifyScheduler`` protocol: MTPVarlen, fixed-length, off.

All three return the same :class:`VerifyPlan` and account expected tokens the same way (in C++,
``_C.spec``): a request emits its accepted drafts plus one bonus/correction token, and draft k counts
with its cumulative rate (the chance that it and every draft before it are accepted).
"""

from __future__ import annotations

import logging

import attrs
import numpy as np

from deepinfer_core import _C
from deepinfer_core.spec.profile import StepTimeProfile

__all__ = ["FixedLength", "MTPVarlen", "NoSpec", "VerifyPlan", "make_policy"]

log = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class VerifyPlan:
    """One verify step's plan.

    ``lengths[i]`` drafts of request ``i`` are verified (always a prefix of its drafts); the step carries
    ``query_tokens`` = requests + sum(lengths) query tokens, takes ``step_ms`` on the profile, and is
    expected to emit ``expected_tokens`` tokens (accepted drafts + one bonus/correction per request).
    """

    lengths: np.ndarray
    query_tokens: int
    expected_tokens: float
    step_ms: float
    tokens_per_ms: float

    @property
    def num_requests(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_drafts(self) -> int:
        """Drafts verified in all (query tokens minus the one token per request)."""
        return self.query_tokens - self.num_requests

    @property
    def mean_drafts(self) -> float:
        """Drafts verified per request."""
        return self.total_drafts / self.num_requests if self.num_requests else 0.0


def _inputs(
    acceptance: object, num_drafts: object | None, max_drafts: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validated float64 acceptance and int32 drafts per request capped at max_drafts (None: all D)."""
    a = np.asarray(acceptance)
    if a.ndim != 2:
        raise ValueError(f"acceptance: must be a 2-D [requests, drafts] array, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"acceptance: must hold floating-point probabilities, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float64)
    R, D = a.shape
    if num_drafts is None:
        if max_drafts >= D:
            return a, None  # the common case: no per-request array to build (saves ~10 us per step)
        n = np.full(R, D, dtype=np.int64)
    else:
        n = np.asarray(num_drafts)
        if n.shape != (R,):
            raise ValueError(f"num_drafts: must have shape ({R},) (one entry per request), got {n.shape}")
        if not np.issubdtype(n.dtype, np.integer):
            raise ValueError(f"num_drafts: must be integers, got dtype {n.dtype}")
        bad = np.flatnonzero((n < 0) | (n > D))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"num_drafts[{i}]={int(n[i])}: must be in [0, {D}] (the width of acceptance)")
    # The cap (DEEPINFER_USE_NEXTN_DECODE) bounds how many drafts a policy may verify.
    return a, np.ascontiguousarray(np.minimum(n, max_drafts), dtype=np.int32)


INVALID_MODES = ("raise", "no_drafts")


def _check_invalid(mode: str) -> str:
    if mode not in INVALID_MODES:
        raise ValueError(f"invalid={mode!r}: must be one of {INVALID_MODES}")
    return mode


def _drop_invalid(a: np.ndarray, n: np.ndarray | None, max_drafts: int) -> np.ndarray:
    """Drafts per request with every request whose used confidences are not probabilities set to 0:
    that request is decoded without speculation this step, the rest of the batch is planned as usual."""
    R, D = a.shape
    n_arr = np.full(R, min(D, max_drafts), dtype=np.int32) if n is None else n.copy()
    used = np.arange(D)[None, :] < n_arr[:, None]
    bad = np.flatnonzero((used & ~((a >= 0.0) & (a <= 1.0))).any(axis=1))  # NaN fails both comparisons
    if bad.size:
        log.warning(
            "acceptance: %d request(s) with confidences outside [0, 1] (first: row %d) verify no drafts",
            bad.size,
            int(bad[0]),
        )
        n_arr[bad] = 0
    return n_arr


def _check_max_drafts(max_drafts: int) -> int:
    if not isinstance(max_drafts, int | np.integer) or max_drafts < 0:
        raise ValueError(f"max_drafts={max_drafts!r}: must be an integer >= 0")
    return int(max_drafts)


def _plan(t: tuple[np.ndarray, int, float, float, float]) -> VerifyPlan:
    lengths, tokens, e, ms, rate = t
    return VerifyPlan(lengths, int(tokens), float(e), float(ms), float(rate))


@attrs.frozen
class MTPVarlen:
    """DeepInfer's MTPVarlen: verify the draft prefixes that maximise expected tokens per millisecond.

    Exact: sorting drafts by cumulative rate and scanning every size gives the optimum over all
    prefix-closed selections (see docs/spec.md for the argument and tests for the brute-force check).
    ``invalid="raise"`` (default) rejects confidences outside [0, 1] or NaN, naming the entry;
    ``invalid="no_drafts"`` gives only the offending requests zero drafts (logged) and plans the rest.
    """

    profile: StepTimeProfile = attrs.field(factory=StepTimeProfile.published)
    max_drafts: int = attrs.field(default=5, converter=_check_max_drafts)
    invalid: str = attrs.field(default="raise", converter=_check_invalid)

    def _prepare(
        self, acceptance: np.ndarray, num_drafts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        a, n = _inputs(acceptance, num_drafts, self.max_drafts)
        return (a, _drop_invalid(a, n, self.max_drafts)) if self.invalid == "no_drafts" else (a, n)

    def plan(self, acceptance: np.ndarray, num_drafts: np.ndarray | None = None) -> VerifyPlan:
        """Per-request verify lengths maximising expected tokens / predicted step time."""
        a, n = self._prepare(acceptance, num_drafts)
        return _plan(_C.spec.plan(a, n, self.profile.knots_x, self.profile.knots_y))

    def plan_total(
        self, acceptance: np.ndarray, total: int, num_drafts: np.ndarray | None = None
    ) -> VerifyPlan:
        """The greedy restricted to exactly ``total`` drafts: the best ``total`` drafts by cumulative rate.

        This is what asynchronous mode runs on the device (``redistribute``) with fresher confidences.
        """
        a, n = self._prepare(acceptance, num_drafts)
        if not isinstance(total, int | np.integer) or total < 0:
            raise ValueError(f"total={total!r}: must be an integer >= 0")
        return _plan(_C.spec.plan(a, n, self.profile.knots_x, self.profile.knots_y, int(total)))


@attrs.frozen
class FixedLength:
    """Verify every draft, up to ``max_drafts`` per request (DeepInfer with MTP varlen off).

    ``invalid`` as for :class:`MTPVarlen` (the confidences only feed the expected-token accounting).
    """

    profile: StepTimeProfile = attrs.field(factory=StepTimeProfile.published)
    max_drafts: int = attrs.field(default=5, converter=_check_max_drafts)
    invalid: str = attrs.field(default="raise", converter=_check_invalid)

    def plan(self, acceptance: np.ndarray, num_drafts: np.ndarray | None = None) -> VerifyPlan:
        """Every request verifies min(num_drafts, max_drafts) drafts."""
        a, n = _inputs(acceptance, num_drafts, self.max_drafts)
        if self.invalid == "no_drafts":
            n = _drop_invalid(a, n, self.max_drafts)
        n = np.full(a.shape[0], a.shape[1], dtype=np.int32) if n is None else n
        return _plan((n, *_C.spec.evaluate(a, n, self.profile.knots_x, self.profile.knots_y)))


@attrs.frozen
class NoSpec:
    """Speculation off: one query token per request, nothing verified."""

    profile: StepTimeProfile = attrs.field(factory=StepTimeProfile.published)

    def plan(self, acceptance: np.ndarray, num_drafts: np.ndarray | None = None) -> VerifyPlan:
        """Zero drafts for every request."""
        a, n = _inputs(acceptance, num_drafts, 0)
        n = np.zeros(a.shape[0], dtype=np.int32) if n is None else n
        return _plan((n, *_C.spec.evaluate(a, n, self.profile.knots_x, self.profile.knots_y)))


def make_policy(
    enable_mtp_varlen: bool, use_nextn_decode: int, profile: StepTimeProfile | None = None
) -> MTPVarlen | FixedLength | NoSpec:
    """The policy DeepInfer's switches select (``DEEPINFER_ENABLE_MTP_VARLEN``, ``DEEPINFER_USE_NEXTN_DECODE``)."""
    prof = profile if profile is not None else StepTimeProfile.published()
    if use_nextn_decode == 0:
        return NoSpec(prof)
    if enable_mtp_varlen:
        return MTPVarlen(prof, use_nextn_decode)
    return FixedLength(prof, use_nextn_decode)
