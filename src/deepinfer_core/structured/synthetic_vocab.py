"""A synthetic byte-level BPE vocabulary for tests and benchmarks (no download).

Real model vocabularies (~128k tokens) cannot be fetched on CI, yet mask cost depends on the vocabulary
size and on how tokens straddle grammar boundaries. A byte-level BPE trained with HuggingFace
``tokenizers`` on generated text (JSON-like records, English-like words, digits, punctuation, some
non-ASCII) has the same shape: multi-character tokens with leading spaces, quotes glued to words, and the
full 256-byte base alphabet, so every text stays encodable.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<|pad|>", "<|tool|>")


def _corpus(num_lines: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    accents = "éèàüöñçøåßłžğışαβγδλμπσжяшюк中文字日本語한국어"
    # A large random lexicon makes many distinct merges available, so big vocabularies fill up.
    lexicon = [
        "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
        + (rng.choice(accents) if rng.random() < 0.1 else "")
        for _ in range(max(2000, num_lines // 2))
    ]
    for _ in range(num_lines):
        r = rng.random()
        if r < 0.4:
            rec = {
                rng.choice(lexicon): rng.choice(
                    [rng.randint(-999, 99999), rng.choice(lexicon), rng.random() < 0.5, None]
                )
                for _ in range(rng.randint(1, 4))
            }
            yield json.dumps(rec, ensure_ascii=False, separators=(",", ":") if rng.random() < 0.5 else None)
        elif r < 0.8:
            words = [rng.choice(lexicon) for _ in range(rng.randint(3, 12))]
            if rng.random() < 0.3:
                words[0] = words[0].capitalize()
            yield " ".join(words) + rng.choice([".", ",", "!", "?", ":", ""])
        else:
            yield " ".join(f"{rng.randint(0, 10 ** rng.randint(1, 7))}" for _ in range(rng.randint(1, 6)))


def train_bpe(vocab_size: int, *, num_lines: int | None = None, seed: int = 0) -> object:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of about ``vocab_size`` tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = num_lines if num_lines is not None else max(2000, vocab_size * 3)
    tok.train_from_iterator(_corpus(lines, seed), trainer=trainer, length=lines)
    return tok


def cached_bpe(path: str | Path, vocab_size: int, **kwargs: object) -> object:
    """Load ``path`` if it exists, else train with :func:`train_bpe` and save it there."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.exists():
        return Tokenizer.from_file(str(p))
    log.info("training a %d-token synthetic BPE into %s", vocab_size, p)
    tok = train_bpe(vocab_size, **kwargs)  # type: ignore[arg-type]
    p.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(p))  # type: ignore[attr-defined]
    return tok
