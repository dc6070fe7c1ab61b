"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

from typing import Any

import attrs


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"SamplingParams.{field}: {msg}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request and when to stop it.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible per request (counter-based RNG
    keyed by seed and position, so the batch around a request does not change its tokens). ``so_args``
    constrains output with a grammar: ``{"regex": str}``, ``{"json_schema": dict | str}``,
    ``{"ebnf": str}`` or ``{"choice": [str, ...]}`` (DeepInfer's SamplingParams field of the same name).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    so_args: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        _check(self.temperature >= 0.0 and self.temperature == self.temperature, "temperature", f"{self.temperature} must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"{self.top_p} must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"{self.top_k} must be -1 (off) or >= 1")
        _check(self.max_tokens >= 1, "max_tokens", f"{self.max_tokens} must be >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"{self.min_tokens} must be in [0, max_tokens]")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative ints")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", f"{self.seed} must be None or in [0, 2**63)")
        if self.so_args is not None:
            kinds = {"regex", "json_schema", "ebnf", "choice"}
            _check(
                isinstance(self.so_args, dict) and len(self.so_args) == 1 and next(iter(self.so_args)) in kinds,
                "so_args",
                f"must be a dict with exactly one key of {sorted(kinds)}, got {self.so_args!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
