"""GrammarSpec validation at submission: clear errors naming the field, canonical cache keys."""

from __future__ import annotations

import pytest

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.structured import GrammarSpec
from deepinfer_core.structured.spec import MAX_SPEC_CHARS


@pytest.mark.parametrize(
    ("kind", "text", "match"),
    [
        ("grammar", "x", r"GrammarSpec.kind: 'grammar' is not one of"),
        ("regex", "", r"GrammarSpec.text: regex needs a non-empty string"),
        ("regex", 5, r"GrammarSpec.text: regex needs a non-empty string"),
        ("ebnf", "   ", r"GrammarSpec.text: ebnf needs a non-empty string"),
        ("json_schema", "{not json", r"GrammarSpec.text: json_schema is not valid JSON"),
        ("json_schema", "[1, 2]", r"must be a JSON object"),
        ("json_schema", {"x": {1, 2}}, r"not JSON-serialisable"),
        ("choice", [], r"non-empty list of strings"),
        ("choice", "abc", r"non-empty list of strings"),
        ("choice", ["a", ""], r"every choice must be a non-empty string"),
        ("choice", ["a", 3], r"every choice must be a non-empty string"),
        ("regex", "a" * (MAX_SPEC_CHARS + 1), r"at most"),
    ],
)
def test_bad_specs_name_the_field(kind: str, text: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GrammarSpec(kind, text)


def test_from_so_args_and_equality() -> None:
    params = SamplingParams(so_args={"choice": ["a", "b"]})
    spec = GrammarSpec.from_so_args(params.so_args)
    assert spec == GrammarSpec("choice", ("a", "b")) and spec.choices == ("a", "b")
    assert GrammarSpec("json_schema", True).text == "true"
    assert GrammarSpec("json_schema", {"b": 1, "a": [1]}) == GrammarSpec("json_schema", '{"b":1,  "a":[1]}')
    assert GrammarSpec("json_schema", {"b": 1, "a": [1]}).text == '{"b":1,"a":[1]}'  # key order kept
    with pytest.raises(ValueError, match="so_args"):
        GrammarSpec.from_so_args({})
    with pytest.raises(AttributeError, match="only for kind='choice'"):
        _ = GrammarSpec("regex", "a").choices
    # Choices become a GBNF alternation of JSON string literals (quotes and backslashes escaped).
    assert GrammarSpec("choice", ['a"b', "c\\d"]).choice_ebnf() == r'root ::= "a\"b" | "c\\d"'
