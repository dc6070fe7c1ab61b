"""Discrete-event cluster simulator: prefill engines behind a prefill balancer, a lockstep decode group
behind a decode balancer, each against a perfectly balanced offline bound.

Engines are modelled by the scheduler's step-cost model (``scheduler.CostModel``, fitted from
measured steps): a prefill step packs chunks first-come first-served up to 32,768 tokens and lasts
``base + sum cost(q_i, c_i)``; a decode step of an engine lasts ``base + a * running + b * kv``.
Optional multiplicative noise (``step_noise``) models the model's error.

Bounds (same work, perfectly balanced, offline):

- prefill: every step's time is charged to its chunks (pro rata their cost); the bound is the fluid
  makespan of that work on N engines with release times, ``max_t (t + W(arrivals >= t) / N)``, and no
  request earlier than ``arrival + its own work``. Efficiency = bound / simulated makespan (from the
  first arrival).
- decode: the ranks of one wide-EP group step together, so a step lasts as long as its slowest engine;
  perfectly balanced, the same requests would make every engine cost the mean. Efficiency =
  sum(mean) / sum(max) over the steps.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from typing import cast

import attrs
import numpy as np

from deepinfer_core.balancers.costs import MAX_CHUNK, StepCost, decode_step_ns
from deepinfer_core.balancers.decode import DecodeBalancer
from deepinfer_core.balancers.prefill import DEFAULT_TIER_BOUNDS, tier_of
from deepinfer_core.balancers.traces import DecodeTrace, PrefillTrace

logger = logging.getLogger(__name__)


@attrs.frozen
class PrefillResult:
    policy: str
    makespan_s: float
    bound_s: float
    ttft_s: np.ndarray  # per request: finish - arrival
    tier: np.ndarray
    moves: int

    @property
    def efficiency(self) -> float:
        return self.bound_s / self.makespan_s if self.makespan_s > 0 else 1.0

    def ttft_quantile(self, q: float, tier: int | None = None) -> float:
        x = self.ttft_s if tier is None else self.ttft_s[self.tier == tier]
        return float(np.quantile(x, q)) if x.size else float("nan")


def fluid_bound_s(arrival_s: np.ndarray, work_s: np.ndarray, num_engines: int) -> float:
    """Least makespan (from the first arrival) of jobs with release times on ``num_engines`` identical
    machines when work is perfectly divisible: max over t of t + W(released >= t) / N, and each job
    no earlier than its release + its own work."""
    if arrival_s.size == 0:
        return 0.0
    o = np.argsort(arrival_s, kind="stable")
    a, w = arrival_s[o], work_s[o]
    tail = np.cumsum(w[::-1])[::-1]
    return float(max(np.max(a + tail / num_engines), np.max(a + w)) - a[0])


def simulate_prefill(
    trace: PrefillTrace,
    balancer,
    cost: StepCost,
    *,
    num_engines: int,
    round_s: float = 30.0,
    cap: int = MAX_CHUNK,
    step_noise: float = 0.0,
    seed: int = 0,
    bounds=DEFAULT_TIER_BOUNDS,
) -> PrefillResult:
    """Run ``trace`` through ``balancer`` (``route`` / ``done`` / ``end_round``) on ``num_engines``."""
    rng = np.random.default_rng(seed)
    n = len(trace)
    new = (trace.total_tokens - trace.cached_tokens).astype(np.int64)
    done_at = np.full(n, np.nan)
    work = np.zeros(n)
    predicted = np.zeros(n)
    queues: list[deque] = [deque() for _ in range(num_engines)]
    progress = trace.cached_tokens.astype(np.int64).copy()  # tokens computed so far (incl. cached)
    busy = np.zeros(num_engines, dtype=bool)
    ev: list[
        tuple[float, int, int, object]
    ] = []  # (time, order, kind, payload); kind 0 arrival 1 step 2 round
    seq = 0
    for i in range(n):
        ev.append((float(trace.arrival_s[i]), seq, 0, i))
        seq += 1
    heapq.heapify(ev)
    t_end = float(trace.arrival_s[-1]) if n else 0.0
    r = round_s
    while r <= t_end:
        heapq.heappush(ev, (r, seq, 2, None))
        seq += 1
        r += round_s
    moves = 0

    def start(e: int, now: float) -> None:
        nonlocal seq
        q, chunks, tokens = queues[e], [], 0
        for i in q:  # FCFS packing up to the step's token cap
            take = min(int(new[i] - (progress[i] - trace.cached_tokens[i])), cap - tokens)
            if take <= 0:
                break
            chunks.append((i, take))
            tokens += take
            if tokens >= cap:
                break
        if not chunks:
            busy[e] = False
            return
        qs = np.array([c[1] for c in chunks], np.int64)
        cs = np.array([progress[c[0]] for c in chunks], np.int64)
        var = np.asarray(cost.chunk_ns(qs, cs), dtype=np.float64).reshape(-1)
        ns = cost.base_ns + float(var.sum())
        if step_noise:
            ns *= max(0.05, 1.0 + step_noise * rng.standard_normal())
        share = var / var.sum() if var.sum() > 0 else np.full(var.size, 1.0 / var.size)
        for (i, take), s in zip(chunks, share):
            work[i] += ns * 1e-9 * s
            progress[i] += take
        busy[e] = True
        heapq.heappush(ev, (now + ns * 1e-9, seq, 1, (e, [c[0] for c in chunks])))
        seq += 1

    while ev:
        now, _, kind, payload = heapq.heappop(ev)
        if kind == 0:
            i = cast(int, payload)
            e, ns = balancer.route(int(trace.total_tokens[i]), int(trace.cached_tokens[i]))
            predicted[i] = ns
            queues[e].append(i)
            if not busy[e]:
                start(e, now)
        elif kind == 1:
            e, ids = cast(tuple[int, list[int]], payload)
            for i in ids:
                if progress[i] >= trace.total_tokens[i]:
                    done_at[i] = now
                    balancer.done(e, predicted[i])
            while queues[e] and progress[queues[e][0]] >= trace.total_tokens[queues[e][0]]:
                queues[e].popleft()
            # a finished request in the middle of the queue (packed) is removed too
            if any(progress[i] >= trace.total_tokens[i] for i in queues[e]):
                queues[e] = deque(i for i in queues[e] if progress[i] < trace.total_tokens[i])
            start(e, now)
        else:
            moves += len(balancer.end_round())
    if np.isnan(done_at).any():
        raise AssertionError("simulator lost a request")  # every arrival is routed and run to the end
    t0 = float(trace.arrival_s[0]) if n else 0.0
    makespan = float(done_at.max() - t0) if n else 0.0
    bound = fluid_bound_s(trace.arrival_s, work, num_engines)
    return PrefillResult(
        getattr(balancer, "name", type(balancer).__name__),
        makespan,
        bound,
        done_at - trace.arrival_s,
        np.asarray(tier_of(trace.total_tokens, bounds)),
        moves,
    )


@attrs.frozen
class DecodeResult:
    policy: str
    steps: int
    time_s: float
    tokens: int
    efficiency: float  # sum(mean step cost) / sum(max step cost)
    variable_efficiency: float  # the same without the per-step base (the part placement can move)
    forwarded: int
    finished: int
    refused_scale_in: int


def simulate_decode(
    trace: DecodeTrace,
    balancer: DecodeBalancer,
    cost: StepCost,
    *,
    drain: tuple[float, int] | None = None,
    step_noise: float = 0.0,
    seed: int = 0,
    max_steps: int = 10**7,
) -> DecodeResult:
    """Lockstep decode of ``trace`` on ``balancer.num_engines`` engines. ``drain=(t, engine)`` asks to
    drain ``engine`` at time t (refused above the utilisation limit: retried each step)."""
    rng = np.random.default_rng(seed)
    m = balancer.num_engines
    n = len(trace)
    eng = np.zeros(0, np.int64)
    ctx = np.zeros(0, np.int64)
    rem = np.zeros(0, np.int64)
    rid = np.zeros(0, np.int64)
    waiting: deque[int] = deque()
    # per request: context and output still to go when it (re)enters the queue; the trace is not touched
    q_ctx = trace.context_tokens.astype(np.int64).copy()
    q_out = trace.output_tokens.astype(np.int64).copy()
    nxt = 0
    t = 0.0
    steps = tokens = forwarded = finished = refused = 0
    sum_max = sum_mean = var_max = var_mean = 0.0
    drain_pending = drain
    while (nxt < n or waiting or eng.size) and steps < max_steps:
        while nxt < n and trace.arrival_s[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        if not eng.size and not waiting:
            t = float(trace.arrival_s[nxt])
            continue
        balancer.report(
            np.bincount(eng, minlength=m), np.bincount(eng, weights=ctx, minlength=m).astype(np.int64)
        )
        placed_e, placed_i = [], []
        while waiting:
            i = waiting[0]
            e = balancer.place(int(q_ctx[i]))
            if e is None:
                break  # FIFO: wait for room
            waiting.popleft()
            placed_e.append(e)
            placed_i.append(i)
        if waiting and not eng.size and not placed_i:
            raise ValueError(
                f"request {waiting[0]}: {q_ctx[waiting[0]]} context tokens fit no engine "
                f"(kv_capacity={balancer.kv_capacity})"
            )
        if placed_i:
            pi = np.array(placed_i, np.int64)
            eng = np.concatenate([eng, np.array(placed_e, np.int64)])
            ctx = np.concatenate([ctx, q_ctx[pi]])
            rem = np.concatenate([rem, q_out[pi]])
            rid = np.concatenate([rid, pi])
        if drain_pending is not None and t >= drain_pending[0]:
            try:
                balancer.drain(drain_pending[1], t)
                drain_pending = None
            except Exception:  # ScaleInRefused: count and retry next step
                refused += 1
        for e in balancer.due(t):
            mine = np.flatnonzero(eng == e)
            targets = balancer.forward(e, ctx[mine].tolist())
            keep = np.ones(eng.size, bool)
            for j, tgt in zip(mine, targets):
                if tgt is None:
                    keep[j] = False
                    waiting.appendleft(int(rid[j]))  # no room: back to the head of the queue (KV kept)
                    q_ctx[rid[j]] = ctx[j]
                    q_out[rid[j]] = rem[j]
                else:
                    eng[j] = tgt
            forwarded += mine.size
            eng, ctx, rem, rid = eng[keep], ctx[keep], rem[keep], rid[keep]
        alive = balancer.alive
        r = np.bincount(eng, minlength=m)
        k = np.bincount(eng, weights=ctx, minlength=m)
        c = decode_step_ns(cost, r, k)[alive]
        if step_noise:
            c = c * np.maximum(0.05, 1.0 + step_noise * rng.standard_normal(c.size))
        step = float(c.max())
        sum_max += step
        sum_mean += float(c.mean())
        var_max += step - cost.base_ns
        var_mean += float(c.mean()) - cost.base_ns
        t += step * 1e-9
        steps += 1
        tokens += eng.size
        ctx += 1
        rem -= 1
        fin = rem <= 0
        if fin.any():
            finished += int(fin.sum())
            keep = ~fin
            eng, ctx, rem, rid = eng[keep], ctx[keep], rem[keep], rid[keep]
    return DecodeResult(
        balancer.name,
        steps,
        t,
        tokens,
        sum_mean / sum_max if sum_max else 1.0,
        var_mean / var_max if var_max > 0 else 1.0,
        forwarded,
        finished,
        refused,
    )
