"""Per-request sampling and stopping parameters, validated at construction.

Validation rules (docs/engine.md, "Validation"), chosen the way vLLM users expect:

- Integer fields (``max_tokens``, ``min_tokens``, ``top_k``, ``seed``, ``stop_token_ids`` members) take a
  Python or numpy integer, or a float with an integral value (``2.0``, as pydantic's lax mode does); a
  non-integral float (``2.5``), a bool, ``inf`` / NaN or any other type is rejected, never rounded.
- Float fields (``temperature``, ``top_p``) take a finite int / float / numpy float; bools are rejected.
- Every value must fit the engine's integer types: ``max_tokens`` <= 2**31 - 1, ``seed`` < 2**63, token
  ids <= 2**31 - 1; ``top_k`` may be any positive int (>= the vocabulary means off).
- ``temperature`` in (0, 0.01) is raised to 0.01 with a logged warning (vLLM's rule: smaller values
  overflow float32 logits / T); 0 means greedy.
- ``ignore_eos`` must be a bool (``"no"``, ``None`` or ``2`` are rejected: a string would be truthy).

Every error is a ``ValueError`` whose message starts with ``SamplingParams.<field>:``.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

import attrs

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MIN_TEMPERATURE = 1e-2  # vLLM's floor for a positive temperature
SO_KINDS = ("regex", "json_schema", "ebnf", "choice")
MAX_N = 256  # parallel samples of one request (each is a sequence: a seat, a state slot, its own blocks)


class RequestOutputKind(enum.IntEnum):
    """What each streamed ``RequestOutput`` of a request carries (vLLM's names and values)."""

    CUMULATIVE = 0  # text / token_ids: everything so far
    DELTA = 1  # text / token_ids: only what is new since the request's previous output
    FINAL_ONLY = 2  # a single output, when the request ends (what LLM.generate uses)


def _output_kind(v: object) -> RequestOutputKind:
    """A RequestOutputKind, its int value or its name (any case: "delta")."""
    if isinstance(v, RequestOutputKind):
        return v
    if isinstance(v, str) and v.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[v.upper()]
    if isinstance(v, int) and not isinstance(v, bool) and v in {k.value for k in RequestOutputKind}:
        return RequestOutputKind(v)
    raise _fail(
        "output_kind",
        f"{short_repr(v)} must be a RequestOutputKind or one of "
        f"{[k.name.lower() for k in RequestOutputKind]}",
    )


def _fail(field: str, msg: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}: {msg}")


def as_int(v: object, field: str, lo: int, hi: int) -> int:
    """``v`` as an exact Python int in [lo, hi], or ValueError naming ``field``."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        raise _fail(field, f"{v!r} is a bool; must be an int in [{lo}, {hi}]")
    if isinstance(v, numbers.Integral):
        i = int(v)
    elif isinstance(v, numbers.Real):
        f = float(v)
        if not math.isfinite(f) or f != math.floor(f):
            raise _fail(
                field, f"{short_repr(v)} must be an int in [{lo}, {hi}] (non-integral values are not rounded)"
            )
        i = int(f)
    else:
        raise _fail(field, f"{short_repr(v)} ({type(v).__name__}) must be an int in [{lo}, {hi}]")
    if not lo <= i <= hi:
        raise _fail(field, f"{short_repr(i)} must be in [{lo}, {hi}]")
    return i


def as_float(v: object, field: str) -> float:
    """``v`` as a finite Python float, or ValueError naming ``field``."""
    if isinstance(v, bool) or type(v).__name__ == "bool_" or not isinstance(v, numbers.Real):
        raise _fail(field, f"{short_repr(v)} ({type(v).__name__}) must be a finite number")
    f = float(v)
    if not math.isfinite(f):
        raise _fail(field, f"{short_repr(v)} must be finite")
    return f


def _stop_strings(v: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (a str or a list of them, as vLLM takes it)."""
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if isinstance(v, bytes | bytearray | Mapping) or not hasattr(v, "__iter__"):
        raise _fail("stop", f"{short_repr(v)} must be a str or a list of str")
    out = tuple(v)
    for i, s in enumerate(out):
        if not isinstance(s, str) or not s:
            raise _fail(f"stop[{i}]", f"{short_repr(s)} must be a non-empty str")
    return out


def _token_ids(v: object) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints (any iterable of integers; not a str, bytes, dict or scalar)."""
    if isinstance(v, str | bytes | bytearray | memoryview | Mapping) or not hasattr(v, "__iter__"):
        raise _fail("stop_token_ids", f"{short_repr(v)} must be a list of token ids (ints)")
    out = []
    for i, t in enumerate(v):
        out.append(as_int(t, f"stop_token_ids[{i}]", 0, INT32_MAX))
    return tuple(out)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request and when to stop it.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible per request (counter-based RNG
    keyed by seed and position, so the batch around a request does not change its tokens). ``so_args``
    constrains output with a grammar: ``{"regex": str}``, ``{"json_schema": dict | str}``,
    ``{"ebnf": str}`` or ``{"choice": [str, ...]}`` (DeepInfer's SamplingParams field of the same name).
    ``top_k`` of -1 or 0 turns top-k off (as in vLLM). See the module docstring for the type rules.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 256  # None: as many as max_model_len leaves after the prompt (vLLM's rule)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    ignore_eos: bool = False
    seed: int | None = None
    so_args: dict[str, Any] | None = None
    # stop strings (engine/stops.py: vLLM's semantics); the text ends before the match unless
    # include_stop_str_in_output
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    include_stop_str_in_output: bool = False
    # parallel sampling: n completions of one prompt (prefilled once; sample i is seeded seed + i)
    n: int = 1
    # vLLM's best_of (sample best_of, return the n best by log-probability): only best_of == n is
    # accepted, since the engine computes no log-probabilities to rank samples by
    best_of: int | None = None
    output_kind: RequestOutputKind = attrs.field(default=RequestOutputKind.CUMULATIVE, converter=_output_kind)

    def __attrs_post_init__(self) -> None:
        # Every message below is formatted only when its check fails (``raise _fail``, never a message
        # built up front): a request's parameters may hold a 1 MB grammar, and a passing check must not
        # pay for its repr. Values in messages go through ``short_repr``.
        put = object.__setattr__  # frozen: normalised values are written once, here
        t = as_float(self.temperature, "temperature")
        if not t >= 0.0:
            raise _fail("temperature", f"{t} must be >= 0 (0 is greedy)")
        if 0.0 < t < MIN_TEMPERATURE:
            log.warning(
                "SamplingParams.temperature=%g is below %g, which overflows float32 logits / T; "
                "using %g (vLLM's rule)",
                t,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            t = MIN_TEMPERATURE
        put(self, "temperature", t)
        p = as_float(self.top_p, "top_p")
        if not 0.0 < p <= 1.0:
            raise _fail("top_p", f"{p} must be in (0, 1]")
        put(self, "top_p", p)
        k = as_int(self.top_k, "top_k", -1, INT64_MAX)
        put(self, "top_k", -1 if k == 0 else k)
        if self.max_tokens is not None:
            put(self, "max_tokens", as_int(self.max_tokens, "max_tokens", 1, INT32_MAX))
        put(self, "min_tokens", as_int(self.min_tokens, "min_tokens", 0, INT32_MAX))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"{self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if not (isinstance(self.ignore_eos, bool) or type(self.ignore_eos).__name__ == "bool_"):
            raise _fail("ignore_eos", f"{short_repr(self.ignore_eos)} must be a bool")
        put(self, "ignore_eos", bool(self.ignore_eos))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _fail(
                "include_stop_str_in_output", f"{short_repr(self.include_stop_str_in_output)} must be a bool"
            )
        if self.seed is not None:
            put(self, "seed", as_int(self.seed, "seed", 0, INT64_MAX))
        put(self, "n", as_int(self.n, "n", 1, MAX_N))
        if self.best_of is not None:
            b = as_int(self.best_of, "best_of", 1, MAX_N)
            if b != self.n:
                raise _fail(
                    "best_of",
                    f"{b} is not supported unless equal to n={self.n}: ranking samples needs "
                    "log-probabilities, which the engine does not compute; use n",
                )
            put(self, "best_of", b)
        if self.so_args is not None:
            so = self.so_args
            # one constraint, plus optional engine options / preferred engine (checked in full by
            # deepinfer_core.structured.GrammarSpec when the request is added; it fails alone)
            if not (
                isinstance(so, Mapping)
                and sum(k in SO_KINDS for k in so) == 1
                and all(k in SO_KINDS or k in ("options", "engine") for k in so)
            ):
                raise _fail(
                    "so_args",
                    f"must be a dict with exactly one key of {sorted(SO_KINDS)} (optionally "
                    f"'options', 'engine'), got {short_repr(so)}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def short_repr(v: object, n: int = 200) -> str:
    """``repr`` cut to ``n`` characters (a huge or deeply nested value must not flood the message). A str
    or bytes is cut before its repr is built, so a 1 MB value costs O(n) here, not O(size)."""
    if isinstance(v, str | bytes | bytearray) and len(v) > n:
        return repr(v[:n]) + f"... ({len(v)} {'characters' if isinstance(v, str) else 'bytes'})"
    try:
        r = repr(v)
    except (RecursionError, ValueError):  # ValueError: an int too large to convert to decimal
        return f"<{type(v).__name__}>"
    return r if len(r) <= n else r[:n] + "..."
