"""The KV store's prefix hit rate against TTL and capacity, by replaying sessions through a real store.

Synthetic sessions (documented; calibrated, not measured): a session is a conversation whose every
turn resends the previous context and adds new tokens, so turn j's prefix is turn j-1's context. Turn
gaps per class:

- agent: 95% log-normal (median 20 s, sigma 1.5: tool calls), 5% log-uniform in [10 min, 2 days];
- chatbot: 90% log-normal (median 3 min, sigma 1.5), 10% log-uniform in [1 hour, 30 days]: users come
  back days later, the "long tail" of chatbot hits in the Q&A. That share is the one free parameter, set
  so the 3-day vs 7-day TTL gap lands in the reported 0.5-1% of hit rate; the curve's shape (a rise,
  then a plateau per class, chatbot's later) is what the replay shows.

Turns per session: 1 + geometric (mean 6 agent, 3 chatbot); new tokens per turn: log-normal (median
6K agent, 1K chatbot), first turn 16K agent / 2K chatbot. Sessions start uniformly over the trace.

The replay drives a real store through the ``KVBlockStore`` protocol, made by the caller for the replay's
fake clock (``kvstore.InMemoryKVStore`` with a TTL policy and an LRU capacity, in the tests and the
benchmark; each stored block is one byte, so a capacity in bytes counts blocks): each turn gets its prefix blocks in order until the first miss (those tokens hit), then puts every block of
its new context (re-put = touch). Blocks are ``block_tokens`` (1K) coarse units to keep replays fast;
the hit rate is the fraction of input tokens served from the store.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import attrs
import numpy as np

from deepinfer_core.protocols.kvstore import KVBlockStore

DAY = 86400.0


@attrs.frozen
class SessionTrace:
    time_s: np.ndarray  # per turn, sorted
    session: np.ndarray  # int64
    context: np.ndarray  # int64 tokens of the turn's full input
    prefix: np.ndarray  # int64 tokens of it that the previous turn stored
    is_agent: np.ndarray


def _gaps(rng: np.random.Generator, n: int, agent: bool) -> np.ndarray:
    if agent:
        body = rng.lognormal(np.log(20.0), 1.5, n)
        tail = np.exp(rng.uniform(np.log(600.0), np.log(2 * DAY), n))
        return np.where(rng.uniform(size=n) < 0.05, tail, body)
    body = rng.lognormal(np.log(180.0), 1.5, n)
    tail = np.exp(rng.uniform(np.log(3600.0), np.log(30 * DAY), n))
    return np.where(rng.uniform(size=n) < 0.10, tail, body)


def session_trace(
    num_sessions: int, duration_s: float = 21 * DAY, *, agent_share: float = 0.5, seed: int = 0
) -> SessionTrace:
    """Turns of ``num_sessions`` sessions starting uniformly in [0, duration_s) (see the module doc)."""
    if not (num_sessions >= 1 and duration_s > 0 and 0 <= agent_share <= 1):
        raise ValueError("session_trace: need num_sessions >= 1, duration_s > 0, agent_share in [0, 1]")
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(num_sessions):
        agent = bool(rng.uniform() < agent_share)
        turns = 1 + rng.geometric(1 / (5.0 if agent else 2.0))
        t = rng.uniform(0, duration_s) + np.concatenate([[0.0], np.cumsum(_gaps(rng, turns - 1, agent))])
        add = rng.lognormal(np.log(6144 if agent else 1024), 0.8, turns)
        add[0] = 16384 if agent else 2048
        ctx = np.cumsum(add).astype(np.int64)
        prev = np.concatenate([[0], ctx[:-1]])
        rows.append((t, np.full(turns, s), ctx, prev, np.full(turns, agent)))
    t, sid, ctx, prev, ag = (np.concatenate(x) for x in zip(*rows))
    o = np.argsort(t, kind="stable")
    return SessionTrace(t[o], sid[o].astype(np.int64), ctx[o], prev[o], ag[o].astype(bool))


@attrs.frozen
class HitRate:
    agent: float
    chatbot: float
    overall: float


def replay_hit_rate(
    trace: SessionTrace,
    make_store: Callable[[Callable[[], int]], KVBlockStore],
    *,
    block_tokens: int = 1024,
    warmup_s: float = 7 * DAY,
) -> HitRate:
    """Token hit rate of the trace's turns after ``warmup_s``, replayed through the store that
    ``make_store(clock)`` returns for the replay's clock (ns), e.g.
    ``lambda clock: InMemoryKVStore(TTLPolicy(), capacity_bytes=blocks, clock=clock)``.

    Denominator: every input token of the measured turns (as the Q&A's cache-hit accounting counts
    input); numerator: the tokens served from the store (prefix blocks hit in order)."""
    clock = [0]
    store = make_store(lambda: clock[0])
    hit = {True: 0, False: 0}
    want = {True: 0, False: 0}
    one = b"\x01"  # each stored block is one byte, so capacity_bytes counts blocks
    for i in range(trace.time_s.size):
        clock[0] = int(trace.time_s[i] * 1e9)
        sid, agent = int(trace.session[i]), bool(trace.is_agent[i])
        cls = "agent" if agent else "chatbot"
        nprefix = int(trace.prefix[i]) // block_tokens
        got = 0
        for b in range(nprefix):
            if store.get(struct.pack("<QQ", sid, b)) is None:
                break
            got += 1
        if trace.time_s[i] >= warmup_s:
            hit[agent] += got * block_tokens
            want[agent] += int(trace.context[i])
        for b in range(int(trace.context[i]) // block_tokens):
            store.put(struct.pack("<QQ", sid, b), one, traffic_class=cls)

    def rate(a: int, w: int) -> float:
        return a / w if w else float("nan")

    return HitRate(
        rate(hit[True], want[True]),
        rate(hit[False], want[False]),
        rate(hit[True] + hit[False], want[True] + want[False]),
    )
