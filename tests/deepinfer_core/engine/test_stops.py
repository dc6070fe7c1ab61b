"""Stop strings: ``StopStrings`` against a brute-force oracle over the whole text, and through the engine."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TB = TOK.token_bytes()


def oracle(
    tokens: list[int], stops: list[str], include: bool, min_tokens: int
) -> tuple[str, int, int] | None:
    """The first token count n >= min_tokens at which some stop string occurs in the text ending inside
    token n's bytes; the earliest such occurrence. (stop, cut, n)."""
    text = b""
    for n, t in enumerate(tokens, 1):
        before = len(text)
        text += TB[t]
        if n < min_tokens:
            continue
        found = []
        for s in stops:
            p = s.encode()
            start = text.find(p)
            while start >= 0:
                if start + len(p) > before:
                    found.append((start, s))
                    break
                start = text.find(p, start + 1)
        if found:
            start, s = min(found, key=lambda x: x[0])
            return s, start + (len(s.encode()) if include else 0), n
    return None


ALPHA = "ab\u00e9\u4e2d\n"  # ASCII, 2- and 3-byte characters


@given(
    text=st.text(alphabet=ALPHA, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(0, 12),
)
def test_matches_the_oracle(text: str, stops: list[str], include: bool, min_tokens: int) -> None:
    toks = TOK.encode(text)
    want = oracle(toks, stops, include, min_tokens)
    s = StopStrings(stops, TB, include=include, min_tokens=min_tokens)
    # fed in random chunks (a verify row commits several tokens at once)
    rng, i, hit = random.Random(len(toks)), 0, None
    while i < len(toks) and hit is None:
        k = rng.randint(1, 4)
        hit = s.feed(toks[i : i + k])
        i += k
    if want is None:
        assert hit is None and s.text() == text
    else:
        assert hit is not None and (hit.stop, hit.cut, hit.tokens) == want
        assert s.text() == text.encode()[: want[1]].decode("utf-8", errors="replace")


def test_needs_a_string() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
        StopStrings([], TB)
