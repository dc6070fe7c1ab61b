"""What a request asks for (``GrammarSpec``) and how a constrained request can end (``FinishReason``).

A spec is validated when it is built, i.e. at submission, so a malformed ``so_args`` fails that request
at once with a message naming the field. Whether the regex / schema / grammar itself is valid is decided
by the backend when it compiles (asynchronously); that failure also stays with the one request.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import attrs

KINDS = ("regex", "json_schema", "ebnf", "choice")
# A guard against pathological submissions (a 10 MB regex would stall a compile worker for long).
MAX_SPEC_CHARS = 1 << 20


class FinishReason(enum.StrEnum):
    """Why a constrained request stopped (the engine copies it into the request's finish reason)."""

    STOP = "stop"  # the grammar accepted the end-of-sequence token
    DEAD_END = "grammar_dead_end"  # no token of the vocabulary can continue the text
    INVALID_GRAMMAR = "grammar_invalid"  # the backend refused to compile the spec
    REJECTED_TOKEN = "grammar_rejected_token"  # the engine committed a token the mask did not allow


def _fail(field: str, msg: str) -> ValueError:
    return ValueError(f"GrammarSpec.{field}: {msg}")


def _canonical_schema(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _fail("text", f"json_schema is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise _fail("text", f"json_schema must be a JSON object (or true/false), got {type(value).__name__}")
    try:
        # Sorted keys: two spellings of one schema share a cache entry.
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise _fail("text", f"json_schema is not JSON-serialisable: {e}") from None


def _convert_text(value: Any) -> Any:
    # Choices arrive as a list; keep them hashable so the spec can key the compile cache.
    if isinstance(value, list):
        return tuple(value)
    return value


@attrs.frozen(slots=True)
class GrammarSpec:
    """One output constraint: ``kind`` in {regex, json_schema, ebnf, choice} and its ``text``.

    ``text`` is the regex (the backends' regex dialect: Rust ``regex`` for llguidance, ECMAScript-like
    for xgrammar; both agree on the common subset), the JSON schema (dict or JSON string, stored as
    canonical JSON), the EBNF grammar (GBNF dialect with a ``root`` rule, as xgrammar and llama.cpp
    write it; llguidance receives it converted to Lark) or the tuple of choice strings.
    Frozen and hashable: equal specs share one compiled grammar.
    """

    kind: str
    text: str | tuple[str, ...] = attrs.field(converter=_convert_text)

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _fail("kind", f"{self.kind!r} is not one of {list(KINDS)}")
        if self.kind == "json_schema":
            object.__setattr__(self, "text", _canonical_schema(self.text))
        elif self.kind == "choice":
            choices = self.text
            if isinstance(choices, str) or not isinstance(choices, tuple) or not choices:
                raise _fail("text", f"choice needs a non-empty list of strings, got {choices!r}")
            bad = [c for c in choices if not isinstance(c, str) or not c]
            if bad:
                raise _fail("text", f"every choice must be a non-empty string; bad: {bad[:3]!r}")
        elif not isinstance(self.text, str) or not self.text.strip():
            raise _fail("text", f"{self.kind} needs a non-empty string, got {self.text!r}")
        size = sum(map(len, self.text)) if isinstance(self.text, tuple) else len(self.text)
        if size > MAX_SPEC_CHARS:
            raise _fail("text", f"{size} characters; at most {MAX_SPEC_CHARS} are allowed")

    @classmethod
    def from_so_args(cls, so_args: Mapping[str, Any]) -> GrammarSpec:
        """From ``SamplingParams.so_args`` (``{"regex": ...}``, ``{"json_schema": ...}``, ...)."""
        if not isinstance(so_args, Mapping) or len(so_args) != 1:
            raise ValueError(f"so_args: must be a dict with exactly one key of {list(KINDS)}, got {so_args!r}")
        ((kind, text),) = so_args.items()
        return cls(kind, text)

    @classmethod
    def of(cls, spec: GrammarSpec | Mapping[str, Any]) -> GrammarSpec:
        """``spec`` itself, or a spec built from an ``so_args`` mapping."""
        return spec if isinstance(spec, GrammarSpec) else cls.from_so_args(spec)

    @property
    def choices(self) -> tuple[str, ...]:
        if self.kind != "choice":
            raise AttributeError(f"GrammarSpec.choices: only for kind='choice', this is {self.kind!r}")
        return self.text  # type: ignore[return-value]

    def choice_ebnf(self) -> str:
        """The choices as a GBNF grammar (JSON string literals are valid GBNF string literals)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)

