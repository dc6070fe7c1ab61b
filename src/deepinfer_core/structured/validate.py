"""Post-hoc checks of a finished document: strict UTF-8, strict JSON, and the JSON schema (jsonschema).

The grammar engines approximate JSON Schema (string bounds, formats, ``oneOf``, ``uniqueItems``, ...), so a
document the grammar accepted can still violate its schema. The manager runs :func:`check_document` when
a ``json_schema`` request's grammar accepts its end and reports ``grammar_violation`` instead of ``stop``
when it fails. Strict means: UTF-8 without replacement, JSON without ``NaN`` / ``Infinity`` and without
duplicate object keys (a schema cannot constrain a key that occurs twice: which value counts is up to
the parser), and the schema's ``format`` s checked where jsonschema has a checker for them.

The ``structured`` extra installs ``jsonschema[format-nongpl]``: jsonschema plus the packages behind its
``date-time``, ``time``, ``duration``, ``uri``, ``hostname``, ``json-pointer``, ... checkers (without them
jsonschema skips those formats silently, so ``2020-04-31T12:00:00Z`` would pass). A schema that uses a
format whose checker is not installed gets one warning per format naming the extra.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

log = logging.getLogger(__name__)


@attrs.frozen(slots=True)
class Verdict:
    """``ok``: the document passed every check that could run; ``error`` says what failed;
    ``checked``: the schema check ran (False: only UTF-8 / JSON were checked, see ``error``)."""

    ok: bool
    error: str | None = None
    checked: bool = True


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(f"duplicate object key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Formats jsonschema checks once its format extras are installed (jsonschema[format-nongpl]).
CHECKABLE_FORMATS = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "idn-email",
        "hostname",
        "idn-hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "iri",
        "iri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
        "uuid",
    }
)
_warned: set[str] = set()


def _formats(schema: Any, out: set[str], depth: int = 0) -> set[str]:
    """Every ``format`` value in a schema (any depth, bounded)."""
    if depth > 64:
        return out
    if isinstance(schema, dict):
        f = schema.get("format")
        if isinstance(f, str):
            out.add(f)
        for v in schema.values():
            _formats(v, out, depth + 1)
    elif isinstance(schema, list):
        for v in schema:
            _formats(v, out, depth + 1)
    return out


def unchecked_formats(schema: Any, checker: Any) -> list[str]:
    """Formats of ``schema`` that jsonschema could check but whose checker package is not installed."""
    return sorted((_formats(schema, set()) & CHECKABLE_FORMATS) - set(checker.checkers))


def make_validator(schema_text: str) -> tuple[Any | None, str | None]:
    """(a jsonschema validator for the schema with format checking on, None) or (None, why not)."""
    from deepinfer_core.extras import install_hint

    try:
        import jsonschema
        from jsonschema import validators
    except ImportError:
        return None, f"jsonschema is not installed: {install_hint('structured')}"
    try:
        schema = json.loads(schema_text)
        cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # format_checker turns the formats into assertions (JSON Schema 2019-09+ makes them annotations)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    except Exception as e:  # a schema jsonschema cannot load: the document's JSON is still checked
        return None, f"jsonschema cannot load the schema: {type(e).__name__}: {e}"
    missing = [f for f in unchecked_formats(schema, cls.FORMAT_CHECKER) if f not in _warned]
    if missing:
        _warned.update(missing)
        log.warning(
            "the post-hoc schema check cannot check format(s) %s (their checker packages are not "
            "installed): %s",
            missing,
            install_hint("structured"),
        )
    return validator, None


def check_document(data: bytes, validator: Any | None, unavailable: str | None = None) -> Verdict:
    """Check ``data`` (the document's bytes) strictly; ``validator`` from :func:`make_validator`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Verdict(False, f"not valid UTF-8: {e}")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        return Verdict(False, f"not valid JSON: {e}")
    except ValueError as e:
        return Verdict(False, f"not valid JSON: {e}")
    except RecursionError:
        return Verdict(False, "not valid JSON: nested too deeply for the checker")
    if validator is None:
        return Verdict(True, unavailable, checked=False)
    try:
        from jsonschema.exceptions import best_match

        err = best_match(validator.iter_errors(doc))
    except Exception as e:  # e.g. an unresolvable $ref, a pattern Python's re cannot compile
        return Verdict(True, f"schema check could not run: {type(e).__name__}: {str(e)[:200]}", checked=False)
    if err is None:
        return Verdict(True)
    where = "/".join(str(p) for p in err.absolute_path) or "(root)"
    return Verdict(False, f"violates the schema at {where}: {err.message[:300]}")
