"""Step-time predictions the balancers and the simulator use, from the scheduler's cost model.

The balancers take any object with ``base_ns`` and ``chunk_ns(q, c)`` (``scheduler.CostModel`` is the one
meant: ``cost(q, c) = base + token*q + quad*q^2 + ctx*q*c``). They do not import the scheduler package,
so importing ``deepinfer_core.balancers`` pulls neither the C++ core nor torch.

A decode step is the same model with q = 1 per request: ``base + (token + quad) * batch + ctx * sum(c)``,
linear in the batch size and the KV held, which is why the decode balancer weighs exactly those two.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

MAX_CHUNK = 32768  # the scheduler's per-step token cap


@runtime_checkable
class StepCost(Protocol):
    """What the balancers need from ``scheduler.CostModel``."""

    @property
    def base_ns(self) -> float: ...

    def chunk_ns(self, q, c): ...


def prefill_chunks(new_tokens: int, cached: int, cap: int = MAX_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """(q, c) of each chunk when a request with ``cached`` tokens already computed prefills
    ``new_tokens`` more, chunked at ``cap`` tokens."""
    if new_tokens < 0 or cached < 0 or cap < 1:
        raise ValueError(f"new_tokens={new_tokens}, cached={cached} must be >= 0 and cap={cap} >= 1")
    n = -(-new_tokens // cap)
    q = np.full(n, cap, dtype=np.int64)
    if n:
        q[-1] = new_tokens - cap * (n - 1)
    c = cached + np.concatenate([[0], np.cumsum(q)[:-1]]) if n else np.zeros(0, np.int64)
    return q, c


def prefill_request_ns(cost: StepCost, new_tokens: int, cached: int = 0, cap: int = MAX_CHUNK) -> float:
    """Predicted compute of one request's prefill run alone: each chunk a step of its own (base included).
    This is the request's *compute demand* the prefill balancer shares engines by."""
    q, c = prefill_chunks(int(new_tokens), int(cached), cap)
    if q.size == 0:
        return 0.0
    return float(q.size * cost.base_ns + np.sum(cost.chunk_ns(q, c)))


def decode_step_ns(cost: StepCost, batch: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
    """Predicted decode step time of each engine holding ``batch[e]`` requests with ``kv_tokens[e]`` tokens
    of context in all (q = 1 per request): base + (token + quad) * batch + ctx * kv."""
    b = np.asarray(batch, dtype=np.float64)
    k = np.asarray(kv_tokens, dtype=np.float64)
    per_req = float(cost.chunk_ns(1, 0))  # token + quad
    per_kv = float(cost.chunk_ns(1, 1)) - per_req  # ctx
    return cost.base_ns + per_req * b + per_kv * k
