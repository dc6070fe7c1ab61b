from __future__ import annotations

import random

import pytest

from deepinfer_core.protocols import Tokenizer
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.tokenizer import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_round_trip_random_text() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    rng = random.Random()
    for _ in range(50):
        text = "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x400, 0x4FF), 0x1F600])) for _ in range(40)
        )
        ids = tok.encode(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert not set(ids) & tok.special_token_ids
        assert tok.decode(ids) == text
    tb = tok.token_bytes()
    assert len(tb) == tok.vocab_size and tb[tok.eos_token_id] == b"" and tb[3 + ord("a")] == b"a"


def _tiny_bpe():
    from tokenizers import Tokenizer as T
    from tokenizers import models, pre_tokenizers, trainers

    t = T(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(['hello world, the quick brown fox {"a": 1}'] * 50, trainer)
    return t


def test_hf_tokenizer_bytes_and_special_injection() -> None:
    pytest.importorskip("tokenizers")
    tok = HFTokenizer(_tiny_bpe())
    assert isinstance(tok, Tokenizer)
    eos = tok.eos_token_id
    assert eos in tok.special_token_ids
    ids = tok.encode("hello <|endoftext|> world")
    assert eos not in ids  # control token typed as text stays text
    tb = tok.token_bytes()
    assert b"".join(tb[i] for i in ids) == b"hello <|endoftext|> world"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"so_args": {"sql": "x"}}, "so_args"),
        ({"seed": -3}, "seed"),
    ],
)
def test_sampling_params_errors_name_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)
