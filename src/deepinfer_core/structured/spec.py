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
ENGINES = ("xgrammar", "llguidance")
# so_args keys besides the one constraint kind.
SO_ARGS_EXTRA = ("options", "engine")
# Per-engine options a request may pass (``so_args["options"][engine]``): name -> (type, what it does).
# Only options that change the language the engine accepts or how it approximates the schema; each
# engine reads its own entry, so one request can carry options for both (the ``auto`` backend may
# serve it with either).
ENGINE_OPTIONS: dict[str, dict[str, tuple[type, str]]] = {
    "xgrammar": {
        "any_whitespace": (bool, "allow JSON whitespace between tokens (default off: compact)"),
        "strict_mode": (bool, "no properties / items beyond the schema's (xgrammar's default on)"),
        "max_whitespace_cnt": (int, "at most this many whitespace characters in a row (with any_whitespace)"),
    },
    "llguidance": {
        "whitespace_flexible": (bool, "allow JSON whitespace between tokens (default off: compact)"),
        "whitespace_pattern": (str, "a regex for the whitespace allowed between tokens"),
        "coerce_one_of": (bool, "treat oneOf as anyOf (llguidance refuses oneOf otherwise)"),
        "lenient": (bool, "ignore keywords and formats llguidance does not implement instead of refusing"),
    },
}
# A guard against pathological submissions (a 10 MB regex would stall a compile worker for long).
MAX_SPEC_CHARS = 1 << 20


class FinishReason(enum.StrEnum):
    """Why a constrained request stopped (the engine copies it into the request's finish reason)."""

    STOP = "stop"  # the grammar accepted the end-of-sequence token
    DEAD_END = "grammar_dead_end"  # no token of the vocabulary can continue the text
    INVALID_GRAMMAR = "grammar_invalid"  # the backend refused to compile the spec
    REJECTED_TOKEN = "grammar_rejected_token"  # the engine committed a token the mask did not allow
    # The grammar accepted its end but the document is not valid (an engine's approximation of the
    # JSON schema let it through; the manager's post-hoc jsonschema check caught it).
    VIOLATION = "grammar_violation"


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
        # Compact, in the schema's own key order: two spellings of one schema share a cache entry, but
        # the order of "properties" is the order the document's keys come out in, so it is kept (a
        # schema listing `reasoning` before `answer` means the model writes it first).
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise _fail("text", f"json_schema is not JSON-serialisable: {e}") from None


def _canonical_options(value: Any) -> str:
    """``so_args["options"]`` validated, as canonical JSON ("" for none): ``{engine: {option: value}}``."""
    if value is None or value == "":
        return ""
    if isinstance(value, str):  # already canonical (a spec rebuilt from its own fields)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _fail("options", f"not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise _fail(
            "options",
            f"must be a dict {{engine: {{option: value}}}} with engines in {list(ENGINES)}, got {value!r}",
        )
    out: dict[str, dict[str, Any]] = {}
    for engine, opts in value.items():
        if engine not in ENGINE_OPTIONS:
            raise _fail("options", f"{engine!r} is not an engine; must be one of {list(ENGINES)}")
        if not isinstance(opts, Mapping):
            raise _fail(f"options.{engine}", f"must be a dict of options, got {opts!r}")
        allowed = ENGINE_OPTIONS[engine]
        for name, v in opts.items():
            if name not in allowed:
                raise _fail(f"options.{engine}", f"{name!r} is not an option; allowed: {sorted(allowed)}")
            typ = allowed[name][0]
            ok = isinstance(v, typ) and (typ is not int or not isinstance(v, bool))
            if not ok:
                raise _fail(f"options.{engine}.{name}", f"{v!r} must be a {typ.__name__}")
            if typ is int and v < 1:
                raise _fail(f"options.{engine}.{name}", f"{v} must be >= 1")
        out[engine] = dict(opts)
    return json.dumps(out, sort_keys=True, separators=(",", ":")) if any(out.values()) else ""


def _check_engine(value: Any) -> Any:
    if value is not None and value not in ENGINES:
        raise _fail("engine", f"{value!r} must be None or one of {list(ENGINES)}")
    return value


def _convert_text(value: Any) -> Any:
    # Choices arrive as a list; keep them hashable so the spec can key the compile cache.
    if isinstance(value, list):
        return tuple(value)
    return value


@attrs.frozen(slots=True)
class GrammarSpec:
    """One output constraint: ``kind`` in {regex, json_schema, ebnf, choice} and its ``text``.

    ``options`` / ``engine`` come from ``so_args["options"]`` / ``so_args["engine"]``.
    ``text`` is the regex (the backends' regex dialect: Rust ``regex`` for llguidance, ECMAScript-like
    for xgrammar; both agree on the common subset), the JSON schema (dict or JSON string, stored as
    canonical JSON), the EBNF grammar (GBNF dialect with a ``root`` rule, as xgrammar and llama.cpp
    write it; llguidance receives it converted to Lark) or the tuple of choice strings.
    Frozen and hashable: equal specs share one compiled grammar.
    """

    kind: str
    text: str | tuple[str, ...] = attrs.field(converter=_convert_text)
    # Engine options (canonical JSON of {engine: {option: value}}, "" for none; see ENGINE_OPTIONS).
    options: str = attrs.field(default="", converter=_canonical_options)
    # The engine to try first (the ``auto`` backend falls back to the other one; a fixed backend
    # refuses a spec that names another engine).
    engine: str | None = attrs.field(default=None, validator=lambda _i, _a, v: _check_engine(v))

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
        if self.options and self.kind != "json_schema":
            raise _fail(
                "options", f"engine options apply to json_schema constraints only, this is {self.kind!r}"
            )
        size = sum(map(len, self.text)) if isinstance(self.text, tuple) else len(self.text)
        if size > MAX_SPEC_CHARS:
            raise _fail("text", f"{size} characters; at most {MAX_SPEC_CHARS} are allowed")

    @classmethod
    def from_so_args(cls, so_args: Mapping[str, Any]) -> GrammarSpec:
        """From ``SamplingParams.so_args``: ``{"regex": ...}``, ``{"json_schema": ...}``, ... plus, optionally,
        ``"options": {engine: {option: value}}`` and ``"engine": "xgrammar" | "llguidance"``."""
        if not isinstance(so_args, Mapping):
            raise ValueError(
                f"so_args: must be a dict with exactly one key of {list(KINDS)}, got {so_args!r}"
            )
        kinds = [k for k in so_args if k in KINDS]
        extra = [k for k in so_args if k not in KINDS and k not in SO_ARGS_EXTRA]
        if len(kinds) != 1 or extra:
            raise ValueError(
                f"so_args: must have exactly one key of {list(KINDS)} (and optionally "
                f"{list(SO_ARGS_EXTRA)}), got keys {list(so_args)}"
            )
        try:
            return cls(
                kinds[0], so_args[kinds[0]], options=so_args.get("options"), engine=so_args.get("engine")
            )
        except ValueError as e:
            raise ValueError(
                str(e)
                .replace("GrammarSpec.options", "so_args.options")
                .replace("GrammarSpec.engine", "so_args.engine")
            ) from None

    @classmethod
    def of(cls, spec: GrammarSpec | Mapping[str, Any]) -> GrammarSpec:
        """``spec`` itself, or a spec built from an ``so_args`` mapping."""
        return spec if isinstance(spec, GrammarSpec) else cls.from_so_args(spec)

    def options_for(self, engine: str) -> dict[str, Any]:
        """The options this spec passes to ``engine`` (empty when none)."""
        return dict(json.loads(self.options).get(engine, {})) if self.options else {}

    @property
    def choices(self) -> tuple[str, ...]:
        if self.kind != "choice":
            raise AttributeError(f"GrammarSpec.choices: only for kind='choice', this is {self.kind!r}")
        return self.text  # type: ignore[return-value]

    def choice_ebnf(self) -> str:
        """The choices as a GBNF grammar (JSON string literals are valid GBNF string literals)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
