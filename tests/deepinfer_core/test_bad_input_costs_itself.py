"""A bad input costs only itself, cheaply (issue #34's small findings, fixed as a class).

- ``SamplingParams`` formats no value for an error message unless its check fails (a 1 MB grammar must
  not be repr'd by a passing check), and a failing check's message stays short whatever the value.
- ``V41Tokenizer.encode_chat`` raises ``ChatError`` naming the field and index of every malformed
  message, tool call or tool, never an AttributeError / TypeError from inside.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.sampling_params import SamplingParams

pytest.importorskip("tokenizers")

from deepinfer_core.model.checkpoint import TINY_DIR
from deepinfer_core.tokenizer import ChatError, V41Tokenizer

TOK = V41Tokenizer(TINY_DIR / "tokenizer.json")


class Loud(str):
    """A str whose repr is counted: a passing check must never call it."""

    calls = 0

    def __repr__(self) -> str:
        Loud.calls += 1
        return str.__repr__(self)


class LoudList(list):
    calls = 0

    def __repr__(self) -> str:
        LoudList.calls += 1
        return list.__repr__(self)


def test_passing_checks_format_nothing():
    Loud.calls = LoudList.calls = 0
    big = Loud("a" * (1 << 20))
    for so in (
        {"regex": big},
        {"ebnf": big},
        {"json_schema": {"pattern": big}},
        {"choice": LoudList([big, big])},
        {"regex": big, "options": {"x": big}, "engine": "xgrammar"},
    ):
        SamplingParams(so_args=so, stop=[big], temperature=0.5, max_tokens=3)
    SamplingParams(stop=LoudList(["x", big]), stop_token_ids=LoudList([1, 2]))
    assert Loud.calls == 0 and LoudList.calls == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"so_args": {"regex": "x" * (1 << 20), "grammar": 1}},
        {"so_args": "x" * (1 << 20)},
        {"stop": ["x" * (1 << 20), ""]},
        {"stop": b"x" * (1 << 20)},
        {"temperature": "x" * (1 << 20)},
        {"max_tokens": 2.5},
        {"max_tokens": 10**5000},
        {"seed": -(10**5000)},
        {"ignore_eos": "x" * (1 << 20)},
        {"include_stop_str_in_output": ["x" * (1 << 20)]},
        {"stop_token_ids": "x" * (1 << 20)},
        {"stop_token_ids": [1, "x" * (1 << 20)]},
        {"top_p": float("nan")},
    ],
)
def test_a_failing_check_names_its_field_in_a_short_message(kw):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    msg = str(e.value)
    field = next(iter(kw))
    assert re.match(rf"SamplingParams\.{field}(\[\d+\])?: ", msg), msg
    assert len(msg) < 600, len(msg)


def _bad_messages():
    """(messages, tools, the field the error must name)."""
    ok = {"role": "user", "content": "hi"}
    return [
        ("hello", None, r"messages: must be a list"),
        ({"role": "user", "content": "x"}, None, r"messages: must be a list"),
        ([ok, "just text"], None, r"messages\[1\]: must be a dict"),
        ([ok, None], None, r"messages\[1\]: must be a dict"),
        ([ok, ["user", "x"]], None, r"messages\[1\]: must be a dict"),
        ([{"content": "x"}], None, r"messages\[0\]\.role: missing"),
        ([ok, {"role": None, "content": "x"}], None, r"messages\[1\]\.role=None: must be one of"),
        ([{"role": ["user"], "content": "x"}], None, r"messages\[0\]\.role=<list>: must be one of"),
        ([{"role": "user"}], None, r"messages\[0\]\.content: must be a string \(got NoneType\)"),
        ([{"role": "user", "content": 3}], None, r"messages\[0\]\.content: must be a string"),
        ([{"role": "system", "content": [{"type": "text", "text": "x"}]}], None, r"messages\[0\]\.content"),
        ([ok, {"role": "tool", "content": b"bytes"}], None, r"messages\[1\]\.content"),
        (
            [ok, {"role": "assistant", "content": 1.5}],
            None,
            r"messages\[1\]\.content: must be a string or None",
        ),
        ([{"role": "user", "content": "a\ud800b"}], None, r"messages\[0\]\.content: not valid Unicode text"),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {1, 2}}]}],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.arguments: must be a JSON string or a JSON-serialisable value",
        ),
        (
            [
                ok,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"name": "f", "arguments": {"x": math.nan}}],
                },
            ],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.arguments",
        ),
        (
            [
                ok,
                {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"b": b"x"}}]},
            ],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.arguments",
        ),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}, "g"]}],
            None,
            r"messages\[1\]\.tool_calls\[1\]: needs a 'name' string",
        ),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": [{"name": 7}]}],
            None,
            r"messages\[1\]\.tool_calls\[0\]: needs a 'name' string",
        ),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
            None,
            r"messages\[1\]\.tool_calls: must be a list",
        ),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": "f()"}],
            None,
            r"messages\[1\]\.tool_calls: must be a list",
        ),
        (
            [ok, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "\udc00"}]}],
            None,
            r"messages\[1\]\.tool_calls\[0\]\.arguments: not valid Unicode",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}],
            None,
            r"messages\[0\]\.tool_calls: only an assistant message",
        ),
        ([ok], "tools", r"tools: must be a list"),
        ([ok], [{"name": "f"}, "g"], r"tools\[1\]: must be a dict"),
        ([ok], [{"name": "f", "parameters": {1, 2}}], r"tools\[0\]: must be a JSON"),
    ]


@pytest.mark.parametrize("messages,tools,field", _bad_messages())
def test_malformed_chat_names_the_field_and_index(messages, tools, field):
    with pytest.raises(ChatError, match=field):
        TOK.encode_chat(messages, tools=tools)


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=3),
    st.frozensets(st.integers(), max_size=2),
)
_any = st.recursive(
    _json_leaf,
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c, max_size=3)),
    max_leaves=6,
)
_msg = st.one_of(
    _any,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"])},
        optional={
            "content": _any,
            "tool_calls": st.one_of(
                _any,
                st.lists(st.fixed_dictionaries({"name": _any}, optional={"arguments": _any}), max_size=2),
            ),
        },
    ),
)


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(_msg, max_size=4))
def test_random_conversations_encode_or_raise_chat_error(messages):
    """Whatever the messages, encode_chat gives ids or a ChatError naming messages[i]; nothing else."""
    try:
        ids = TOK.encode_chat(messages)
    except ChatError as e:
        assert re.match(r"messages\[\d+\]", str(e)), str(e)
    else:
        assert all(isinstance(i, int) for i in ids)
