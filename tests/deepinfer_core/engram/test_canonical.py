"""Canonical token map: normalisation, merging of variants, distinct specials and partial bytes."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engram import CanonicalTokenMap, normalize_token_text
from deepinfer_core.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Apple", "apple"),
        (" apple", "apple"),
        ("\tAPPLE\n", "apple"),
        ("ﬁ", "fi"),  # NFKC folds the ligature
        ("Ａ", "a"),  # NFKC folds full-width forms
        ("a  \t b", "a b"),  # whitespace runs fold to one space
        ("   ", " "),  # whitespace-only stays one space
        ("\n", " "),
        ("", ""),
    ],
)
def test_normalize(text: str, want: str) -> None:
    assert normalize_token_text(text) == want


def test_strip_accents_is_optional() -> None:
    assert normalize_token_text("Café") == "café"
    assert normalize_token_text("Café", strip_accents=True) == "cafe"


def test_from_token_texts_merges_variants_and_keeps_others_apart() -> None:
    texts = ["Apple", " apple", "APPLE", "pear", None, None, b"\xe2\x82", b"\xe2", " ", "\n\n", b" Pear"]
    m = CanonicalTokenMap.from_token_texts(texts)
    lk = m.lookup.tolist()
    assert lk[0] == lk[1] == lk[2]
    assert lk[3] == lk[10]  # bytes that decode are normalised like text
    assert lk[4] != lk[5]  # each control token keeps its own id
    assert len({lk[6], lk[7], lk[0], lk[3]}) == 4  # partial UTF-8 never merges
    assert lk[8] == lk[9]  # whitespace-only tokens fold together
    assert m.num_canonical == len(set(lk)) == max(lk) + 1
    # canonical ids are dense and numbered by first appearance
    seen: list[int] = []
    for x in lk:
        if x not in seen:
            seen.append(x)
    assert seen == list(range(m.num_canonical))


def test_from_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    m = CanonicalTokenMap.from_tokenizer(tok)
    assert m.vocab_size == tok.vocab_size
    a, upper_a = tok.encode("a")[0], tok.encode("A")[0]
    space, newline = tok.encode(" ")[0], tok.encode("\n")[0]
    assert m.lookup[a] == m.lookup[upper_a]
    assert m.lookup[space] == m.lookup[newline]
    specials = sorted(tok.special_token_ids)
    assert len({int(m.lookup[s]) for s in specials}) == len(specials)
    # bytes >= 0x80 alone are partial UTF-8: all distinct
    high = [int(m.lookup[b + 3]) for b in range(0x80, 0x100)]
    assert len(set(high)) == 128


def test_identity_and_call() -> None:
    m = CanonicalTokenMap.identity(10)
    assert m.is_identity() and m.num_canonical == 10
    x = torch.tensor([[3, 9], [0, 1]])
    assert torch.equal(m(x), x)
    with pytest.raises(ValueError, match="token_ids: id 10"):
        m(torch.tensor([10]))
    with pytest.raises(ValueError, match="lookup"):
        CanonicalTokenMap([0, -1])


def test_from_hf_byte_level_vocabulary() -> None:
    """A byte-level BPE-style vocabulary ('Ġ' = space, 'Ċ' = newline) through the HF tokenizer wrapper."""
    tokenizers = pytest.importorskip("tokenizers")
    from deepinfer_core.tokenizer import HFTokenizer

    vocab = {
        "hello": 0,
        "Hello": 1,
        "Ġhello": 2,
        "ĠHELLO": 3,
        "world": 4,
        "Ċ": 5,
        "Ġ": 6,
        "ĠĠ": 7,
        "[UNK]": 8,
    }
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(["<eos>"])
    hf = HFTokenizer(tok, eos_token="<eos>")
    m = CanonicalTokenMap.from_tokenizer(hf)
    lk = m.lookup
    assert lk[0] == lk[1] == lk[2] == lk[3]  # case and leading-space variants of one word
    assert lk[5] == lk[6] == lk[7]  # newline, space, two spaces: one whitespace id
    assert len({int(lk[0]), int(lk[4]), int(lk[5]), int(lk[hf.eos_token_id])}) == 4
