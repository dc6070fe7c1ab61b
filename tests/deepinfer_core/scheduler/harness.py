"""Deterministic fake executor, an independent token-stream oracle, and a step driver for the tests.

The fake model's next token depends only on (request, position, previous token), so a request's
stream is fixed by its prompt no matter how it is chunked, batched, preempted or scheduled ahead. The
executor also checks every input token it is given against the oracle, which catches a wrong
placeholder, a lost or duplicated token, or a recompute from the wrong place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import numpy as np

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import (
    EngineType,
    FinishedRequest,
    FinishReason,
    Plan,
    Request,
    Scheduler,
    StepType,
)

VOCAB = 40
EOS = 0


def next_token(req_no: int, pos: int, prev: int) -> int:
    """The fake model: token at position ``pos`` of request ``req_no`` given the token before it."""
    h = (req_no * 1_000_003 + pos * 7_919 + prev * 31 + 12_345) * 2_654_435_761
    return int(h % (1 << 32)) % VOCAB


@attrs.define
class Spec:
    """One request of a workload: when it arrives, its prompt, its stop rules; optional abort step."""

    no: int
    arrive: int
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    abort_at: int | None = None

    @property
    def rid(self) -> str:
        return f"req-{self.no}"

    def request(self) -> Request:
        sp = SamplingParams(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_ids,
        )
        return Request(self.rid, self.prompt, sp)


class Oracle:
    """Expected tokens by position, and the expected final output, computed straight from the rules."""

    def __init__(self, specs: list[Spec]) -> None:
        self.specs = {s.rid: s for s in specs}
        self._seq: dict[str, list[int]] = {s.rid: list(s.prompt) for s in specs}

    def token(self, rid: str, pos: int) -> int:
        seq = self._seq[rid]
        no = self.specs[rid].no
        while len(seq) <= pos:
            seq.append(next_token(no, len(seq), seq[-1]))
        return seq[pos]

    def expected(self, rid: str, engine: EngineType) -> tuple[list[int], FinishReason]:
        s = self.specs[rid]
        p = len(s.prompt)
        out: list[int] = []
        while True:
            tok = self.token(rid, p + len(out))
            out.append(tok)
            n = len(out)
            if n >= s.min_tokens and ((not s.ignore_eos and tok == EOS) or tok in s.stop_ids):
                return out, FinishReason.STOP
            if n >= s.max_tokens:
                return out, FinishReason.LENGTH
            if engine is EngineType.PROMPT:
                return out, FinishReason.HANDOFF


class FakeExecutor:
    """Runs a plan: resolves placeholders from its own previous samples, checks inputs, samples.

    Verify rows (``plan.num_drafts[i] = k > 0``): a fake drafter fills the k draft placeholders, each
    right (the oracle's token) with probability ``p_right``, else wrong; verification accepts the
    longest right prefix and appends the oracle's next token, so a random prefix of the drafts is
    accepted and the stream stays the oracle's. ``run`` then returns (flat tokens, count per row).
    """

    def __init__(self, oracle: Oracle, rng: np.random.Generator | None = None, p_right: float = 0.6) -> None:
        self.oracle = oracle
        self.last: dict[str, int] = {}
        self.rng, self.p_right = rng, p_right
        self.drafts_fed = self.drafts_accepted = 0

    def run(self, plan: Plan) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        out = np.full(plan.num_rows, -7, dtype=np.int32)  # non-sampling rows: a value update must ignore
        flat: list[int] = []
        counts = np.zeros(plan.num_rows, np.int32)
        off = 0
        rids = plan.request_ids
        for i, rid in enumerate(rids):
            q = int(plan.num_tokens[i])
            k = int(plan.num_drafts[i])
            start = int(plan.start[i])
            toks = plan.token_ids[off : off + q].copy()
            off += q
            assert k == 0 or (plan.step_type is StepType.DECODE and q == 1 + k and plan.sample[i])
            assert (toks[q - k :] == -1).all(), f"{rid}: draft slots must be placeholders"
            if toks[0] == -1:
                assert plan.step_type is StepType.DECODE and q == 1 + k, "placeholder outside a decode row"
                toks[0] = self.last[rid]
            assert (toks[: q - k] >= 0).all(), f"{rid}: placeholder not at the row's first token"
            for j, t in enumerate(toks[: q - k].tolist()):
                assert t == self.oracle.token(rid, start + j), (
                    f"{rid}: wrong input token at position {start + j}"
                )
            no = self.oracle.specs[rid].no
            if k:
                assert self.rng is not None, "verify row without a drafter"
                true = [self.oracle.token(rid, start + j) for j in range(1, k + 2)]
                right = self.rng.random(k) < self.p_right
                acc = int(np.argmin(right)) if not right.all() else k
                row = true[: acc + 1]  # accepted drafts (right by construction) + the next token
                self.drafts_fed += k
                self.drafts_accepted += acc
                flat += row
                counts[i] = len(row)
                self.last[rid] = row[-1]
            elif plan.sample[i]:
                out[i] = next_token(no, start + q, int(toks[-1]))
                self.last[rid] = int(out[i])
                flat.append(int(out[i]))
                counts[i] = 1
            else:
                flat.append(-7)
                counts[i] = 1
        assert off == plan.token_ids.shape[0]
        if self.rng is None:
            return out
        return np.asarray(flat, np.int32), counts


@attrs.define
class RunResult:
    finished: list[FinishedRequest]
    plans: int
    max_steps_hit: bool
    drafts_fed: int = 0
    drafts_accepted: int = 0
    asked: list[dict[str, int]] = attrs.Factory(list)  # the drafts asked before each schedule


def drive(
    sched: Scheduler,
    specs: list[Spec],
    *,
    lag: int,
    on_plan: Callable[[Scheduler, Plan], None] | None = None,
    before_schedule: Callable[[Scheduler], None] | None = None,
    max_steps: int = 5000,
    drafts: np.random.Generator | None = None,
    max_drafts: int = 4,
    draft_form: str = "dict",
) -> RunResult:
    """Step ``sched`` until every request ended. ``lag`` 0: synchronous; 1: one step ahead.

    ``drafts``: before every schedule, ask for a random 0..max_drafts drafts per live request (the
    fake executor verifies them, see :class:`FakeExecutor`). ``draft_form`` "dict": as
    ``num_draft_tokens``; "array": the same ask as ``draft_seq_ids`` / ``draft_counts`` (k = 0 entries
    left out, shuffled, dtypes varied), which must plan exactly the same."""
    assert draft_form in ("dict", "array")
    asked: list[dict[str, int]] = []
    oracle = Oracle(specs)
    ex = FakeExecutor(oracle, drafts)
    reported: set[str] = set()
    arrived: list[str] = []
    arrivals: dict[int, list[Spec]] = {}
    aborts: dict[int, list[Spec]] = {}
    for s in specs:
        arrivals.setdefault(s.arrive, []).append(s)
        if s.abort_at is not None:
            aborts.setdefault(s.abort_at, []).append(s)
    last_event = max([s.arrive for s in specs] + [s.abort_at or 0 for s in specs] + [0])
    inflight: deque[tuple[Plan, np.ndarray]] = deque()
    finished: list[FinishedRequest] = []
    plans = 0
    for step in range(max_steps):
        for s in arrivals.get(step, []):
            sched.add_request(s.request())
            arrived.append(s.rid)
        for s in aborts.get(step, []):
            sched.abort(s.rid)
        live = sched.num_live > 0
        if live or (not inflight and sched.has_unfinished()):
            if before_schedule is not None:
                before_schedule(sched)
            kw: dict = {}
            if drafts is not None:
                live_ids = [r for r in arrived if r not in reported]
                ask = {r: int(k) for r, k in zip(live_ids, drafts.integers(0, max_drafts + 1, len(live_ids)))}
                asked.append(ask)
                kw = {"num_draft_tokens": ask} if draft_form == "dict" else _as_arrays(sched, ask, plans)
            plan = sched.schedule(**kw)
            plans += 1
            if on_plan is not None:
                on_plan(sched, plan)
            inflight.append((plan, ex.run(plan)))
        if inflight and (len(inflight) > lag or sched.num_live == 0):
            p, r = inflight.popleft()
            ended = sched.update(p, *r) if isinstance(r, tuple) else sched.update(p, r)
            reported.update(f.request_id for f in ended)
            finished.extend(ended)
        sched.check_invariants()
        if step > last_event and not inflight and not sched.has_unfinished():
            return RunResult(finished, plans, False, ex.drafts_fed, ex.drafts_accepted, asked)
    return RunResult(finished, plans, True, ex.drafts_fed, ex.drafts_accepted, asked)


def _as_arrays(sched: Scheduler, ask: dict[str, int], salt: int) -> dict[str, np.ndarray]:
    """``ask`` in the array form: k = 0 entries dropped (the same as not asking), the order shuffled and
    the dtypes varied by ``salt`` (its own generator: the drafts generator must be consumed exactly as
    in the dict form)."""
    rng = np.random.default_rng(salt)
    rids = [r for r, k in ask.items() if k > 0]
    order = rng.permutation(len(rids))
    seqs = np.array([sched.seq_id(rids[i]) for i in order], np.int64)
    ks = np.array([ask[rids[i]] for i in order], np.int32)
    if salt % 2:
        seqs, ks = seqs.astype(np.int32), ks.astype(np.int64)  # the wrapper's cast path
    return {"draft_seq_ids": seqs, "draft_counts": ks}
