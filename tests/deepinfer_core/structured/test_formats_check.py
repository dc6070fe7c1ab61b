"""The post-hoc schema check enforces ``format`` (issue #35): the ``structured`` extra installs jsonschema
with its format checkers, and the validator is built with format checking on. Both grammar engines let
``2020-04-31T12:00:00Z`` through a ``date-time`` field (April has 30 days); the check must not.

Oracle: the calendar (``datetime``) and RFC 3339 / 3986 / 1123 / 6901 by hand-picked valid and invalid
values; the manager's verdict on a document driven through the grammar token by token.
"""

from __future__ import annotations

import json

import pytest

from deepinfer_core.structured import FinishReason, StructuredOutputManager
from deepinfer_core.structured.validate import (
    CHECKABLE_FORMATS,
    check_document,
    make_validator,
    unchecked_formats,
)

pytest.importorskip("jsonschema")

# (format, valid values, invalid values)
CASES = [
    (
        "date-time",
        ["2020-04-30T12:00:00Z", "2024-02-29T23:59:59+08:00"],
        ["2020-04-31T12:00:00Z", "2023-02-29T00:00:00Z", "2020-01-01T25:00:00Z", "2020-01-01 12:00:00"],
    ),
    ("date", ["2020-04-30"], ["2020-04-31", "2020-13-01"]),
    ("time", ["12:00:00Z", "23:59:59.5+01:00"], ["25:00:00Z", "12:60:00Z"]),
    ("duration", ["P1Y2M3DT4H5M6S", "PT0.5S"], ["P1Y2", "1Y", "P"]),
    ("uri", ["https://example.com/a?b=c#d", "urn:isbn:0451450523"], ["not a uri", "//no-scheme"]),
    ("hostname", ["example.com", "a-b.example"], ["-bad-.com", "a" * 64 + ".com"]),
    ("json-pointer", ["", "/a/b~0c/~1"], ["no-slash", "/a~2"]),
]


def _schema(fmt: str) -> str:
    return json.dumps(
        {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    )


@pytest.mark.parametrize(("fmt", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_formats_are_checked(fmt: str, good: list[str], bad: list[str]) -> None:
    v, why = make_validator(_schema(fmt))
    assert why is None and v is not None
    assert fmt in v.format_checker.checkers, f"no checker for {fmt}: is jsonschema[format-nongpl] installed?"
    for s in good:
        assert check_document(json.dumps({"v": s}).encode(), v).ok, (fmt, s)
    for s in bad:
        verdict = check_document(json.dumps({"v": s}).encode(), v)
        assert not verdict.ok and verdict.checked, (fmt, s)
        assert f"is not a '{fmt}'" in verdict.error and "at v" in verdict.error


def test_every_checkable_format_has_its_checker_installed() -> None:
    from jsonschema import Draft202012Validator

    assert (
        unchecked_formats(
            {"properties": {f: {"format": f} for f in CHECKABLE_FORMATS}}, Draft202012Validator.FORMAT_CHECKER
        )
        == []
    )


def test_missing_format_checker_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    import jsonschema

    from deepinfer_core.structured import validate

    bare = jsonschema.FormatChecker(formats=())  # what jsonschema has without its format extras
    assert unchecked_formats({"items": [{"format": "date-time"}, {"format": "x-custom"}]}, bare) == [
        "date-time"
    ]
    validate._warned.discard("uri-template")
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    saved = checker.checkers.pop("uri-template")
    try:
        with caplog.at_level("WARNING", logger="deepinfer_core.structured.validate"):
            make_validator(_schema("uri-template"))
    finally:
        checker.checkers["uri-template"] = saved
    assert "cannot check format(s) ['uri-template']" in caplog.text
    assert 'pip install "deepinfer-components[structured]"' in caplog.text


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar", "auto"])
def test_an_impossible_date_never_finishes_as_stop(engine: str, byte_tok, backend_for) -> None:
    # Whichever engine serves it, a document with April 31 must not end as a success: either the
    # grammar refuses the day (llguidance's date-time rule knows month lengths) or, when the grammar
    # accepts it (xgrammar's does not), the post-hoc check turns the finish into grammar_violation,
    # naming the field and the format.
    from deepinfer_core.structured import make_backend

    schema = {
        "type": "object",
        "properties": {"at": {"type": "string", "format": "date-time"}},
        "required": ["at"],
        "additionalProperties": False,
    }
    backend = (
        make_backend("auto", byte_tok, order=(engine,))
        if engine != "auto"
        else make_backend("auto", byte_tok)
    )
    mgr = StructuredOutputManager(backend)
    checked = 0
    for rid, day in (("bad", "31"), ("ok", "30")):
        doc = f'{{"at":"2020-04-{day}T12:00:00Z"}}'
        mgr.add_request(rid, {"json_schema": schema})
        mgr.wait([rid])
        toks = [*byte_tok.encode(doc), byte_tok.eos_token_id]
        n = mgr.advance(rid, toks)
        if rid == "ok":
            assert n == len(toks) and mgr.finish_reason("ok") is FinishReason.STOP
        elif n == len(toks):  # the grammar let it through: the check must catch it
            checked += 1
            assert mgr.finish_reason("bad") is FinishReason.VIOLATION
            assert "is not a 'date-time'" in mgr.error("bad") and "at at" in mgr.error("bad")
            assert mgr.metrics("bad")["grammar_check"] == "failed"
        else:  # refused inside the day, never after the document
            assert n == len(doc.split("-31")[0]) + 2 and mgr.finish_reason("bad") is not FinishReason.STOP
    if engine == "xgrammar":
        assert checked == 1  # the case the post-hoc check exists for
    mgr.close()
