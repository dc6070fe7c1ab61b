"""Prometheus metrics of the server, in the text exposition format (version 0.0.4), with no dependency.

Counters and histograms are fed by the request handlers (``RequestTimer``); engine gauges (KV use, live
requests, steps, prefix-cache hits, drafts) are read from the engine when ``/metrics`` is scraped.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from typing import Any

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out += [
            f'{self.name}_bucket{{le="+Inf"}} {self.count}',
            f"{self.name}_sum {self.sum}",
            f"{self.name}_count {self.count}",
        ]
        return out


class ServerMetrics:
    """Everything ``/metrics`` exposes; thread-safe (handlers run on the event loop, scrapes too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds", "Time from request to its first token."
        )
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds", "Time between a request's streamed tokens."
        )
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Time from request to its last token.")

    def finish(
        self,
        endpoint: str,
        outcome: str,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        with self._lock:
            k = (endpoint, outcome)
            self.requests[k] = self.requests.get(k, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.cached_tokens += cached_tokens

    def render(self, engine: Any, llm: Any) -> str:
        with self._lock:
            lines = [
                "# HELP deepinfer_requests_total Requests by endpoint and outcome.",
                "# TYPE deepinfer_requests_total counter",
            ]
            lines += [
                f'deepinfer_requests_total{{endpoint="{e}",outcome="{o}"}} {c}'
                for (e, o), c in sorted(self.requests.items())
            ]
            for name, v, h in (
                ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("generation_tokens_total", self.generation_tokens, "Generated tokens."),
                (
                    "prefix_cache_hit_tokens_total",
                    self.cached_tokens,
                    "Prompt tokens whose KV came from the prefix cache.",
                ),
            ):
                lines += [
                    f"# HELP deepinfer_{name} {h}",
                    f"# TYPE deepinfer_{name} counter",
                    f"deepinfer_{name} {v}",
                ]
            for hist in (self.ttft, self.itl, self.e2e):
                lines += hist.lines()
        cfg = engine.config
        used = cfg.num_blocks - 1 - engine.kv_pool.num_free_blocks  # block 0 is the pool's null block
        drafts = engine.drafts
        gauges = (
            ("kv_blocks_used", used, "KV blocks in use."),
            ("kv_blocks_total", cfg.num_blocks - 1, "KV blocks."),
            ("kv_usage_ratio", used / max(cfg.num_blocks - 1, 1), "Fraction of KV blocks in use."),
            ("requests_live", engine.num_live, "Requests in the engine (waiting or running)."),
            (
                "state_slots_used",
                engine.state_pool.num_slots - engine.state_pool.num_free_slots,
                "State slots in use.",
            ),
            ("streams_open", llm.num_streams, "Open output streams."),
        )
        for name, v, h in gauges:
            lines += [
                f"# HELP deepinfer_{name} {h}",
                f"# TYPE deepinfer_{name} gauge",
                f"deepinfer_{name} {v}",
            ]
        counters = (
            ("engine_steps_total", llm.steps, "Engine steps."),
            ("engine_step_seconds_total", llm.step_time_s, "Wall time inside engine steps."),
            (
                "spec_drafts_verified_total",
                drafts.verified if drafts is not None else 0,
                "Speculative drafts verified.",
            ),
            (
                "spec_drafts_accepted_total",
                drafts.accepted if drafts is not None else 0,
                "Speculative drafts accepted.",
            ),
        )
        for name, v, h in counters:
            lines += [
                f"# HELP deepinfer_{name} {h}",
                f"# TYPE deepinfer_{name} counter",
                f"deepinfer_{name} {v}",
            ]
        return "\n".join(lines) + "\n"


class RequestTimer:
    """TTFT, inter-token latency and end-to-end time of one request, observed into ``ServerMetrics``."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.t0 = time.monotonic()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        with self.m._lock:
            if self.last is None:
                self.m.ttft.observe(now - self.t0)
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    self.m.itl.observe(gap)
        self.last = now

    def done(self) -> None:
        with self.m._lock:
            self.m.e2e.observe(time.monotonic() - self.t0)
