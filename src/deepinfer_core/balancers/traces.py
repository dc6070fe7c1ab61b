"""Documented synthetic traces for the cluster simulator (no production trace is public).

Prefill requests (``prefill_trace``), two traffic classes:

- agent: total context log-normal, median 48K tokens, sigma 1.0, clipped to [1K, 1M]; 70-95% of it is a
  prefix hit in the KV store (uniform), as agent turns resend their whole history;
- chatbot: median 4K, sigma 1.2, clipped to [128, 256K]; 0-80% hit (uniform).

Cached counts are rounded down to 64-token blocks. Arrivals are Poisson. Shapes of the agent share:
``steady`` (constant ``agent_share``), ``shifting`` (agent share swings 0.2 <-> 0.9 with a 10-minute
sine: the tier demand moves and engines must follow) and ``bursty`` (bursts of 1M-clipped agent
requests: 20 s on, every 2 minutes, on top of the steady mix).

Decode requests (``decode_trace``): context from the same mix (prompt total), output log-normal with
median 400 tokens, sigma 1.0, clipped to [1, 8192]; Poisson arrivals.
"""

from __future__ import annotations

import attrs
import numpy as np

K = 1024
SHAPES = ("steady", "shifting", "bursty")


@attrs.frozen
class PrefillTrace:
    arrival_s: np.ndarray  # float64, sorted
    total_tokens: np.ndarray  # int64, context of the request (prompt incl. cached prefix)
    cached_tokens: np.ndarray  # int64, prefix hit in the KV store
    is_agent: np.ndarray  # bool

    def __len__(self) -> int:
        return int(self.arrival_s.size)


@attrs.frozen
class DecodeTrace:
    arrival_s: np.ndarray
    context_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.arrival_s.size)


def _lengths(rng: np.random.Generator, n: int, agent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tot = np.where(
        agent,
        np.clip(rng.lognormal(np.log(48 * K), 1.0, n), 1 * K, 1024 * K),
        np.clip(rng.lognormal(np.log(4 * K), 1.2, n), 128, 256 * K),
    ).astype(np.int64)
    hit = np.where(agent, rng.uniform(0.70, 0.95, n), rng.uniform(0.0, 0.80, n))
    cached = (np.floor(tot * hit / 64) * 64).astype(np.int64)
    return tot, np.minimum(cached, tot - 1)


def prefill_trace(
    duration_s: float, rate_per_s: float, *, shape: str = "steady", agent_share: float = 0.5, seed: int = 0
) -> PrefillTrace:
    """Requests over ``duration_s`` seconds at ``rate_per_s`` on average (see the module doc)."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: must be one of {list(SHAPES)}")
    if not (duration_s > 0 and rate_per_s > 0 and 0 <= agent_share <= 1):
        raise ValueError("prefill_trace: need duration_s > 0, rate_per_s > 0, agent_share in [0, 1]")
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate_per_s * duration_s))
    t = np.sort(rng.uniform(0.0, duration_s, n))
    if shape == "steady":
        p = np.full(n, agent_share)
    elif shape == "shifting":
        p = 0.55 + 0.35 * np.sin(2 * np.pi * t / 600.0)
    else:
        p = np.full(n, agent_share)
    agent = rng.uniform(size=n) < p
    tot, cached = _lengths(rng, n, agent)
    if shape == "bursty":
        # extra long agent requests in 20 s bursts every 120 s, ~ a third of the base rate while on
        starts = np.arange(0.0, duration_s, 120.0)
        nb = rng.poisson(rate_per_s / 3 * 20.0, starts.size)
        bt = (
            np.concatenate([s + rng.uniform(0, 20.0, k) for s, k in zip(starts, nb)])
            if nb.sum()
            else np.zeros(0)
        )
        bt = bt[bt < duration_s]
        btot = np.clip(rng.lognormal(np.log(200 * K), 0.5, bt.size), 64 * K, 1024 * K).astype(np.int64)
        bcached = (np.floor(btot * rng.uniform(0.7, 0.95, bt.size) / 64) * 64).astype(np.int64)
        t = np.concatenate([t, bt])
        order = np.argsort(t, kind="stable")
        t = t[order]
        tot = np.concatenate([tot, btot])[order]
        cached = np.concatenate([cached, bcached])[order]
        agent = np.concatenate([agent, np.ones(bt.size, bool)])[order]
    return PrefillTrace(t, tot, cached, agent)


def decode_trace(
    duration_s: float,
    rate_per_s: float,
    *,
    agent_share: float = 0.5,
    max_context: int = 256 * K,
    seed: int = 0,
) -> DecodeTrace:
    """Decode requests (context from the prefill mix, clipped to ``max_context``; outputs log-normal)."""
    if not (duration_s > 0 and rate_per_s > 0 and max_context >= 1):
        raise ValueError("decode_trace: need duration_s > 0, rate_per_s > 0, max_context >= 1")
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(rate_per_s * duration_s))
    t = np.sort(rng.uniform(0.0, duration_s, n))
    agent = rng.uniform(size=n) < agent_share
    tot, _ = _lengths(rng, n, agent)
    out = np.clip(rng.lognormal(np.log(400), 1.0, n), 1, 8192).astype(np.int64)
    return DecodeTrace(t, np.minimum(tot, max_context), out)
