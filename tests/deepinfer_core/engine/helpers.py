"""Shared helpers of the engine tests: the independent greedy oracle, small prompt sets, stepping to the end."""

from __future__ import annotations

import random
from typing import Any

import torch

from deepinfer_core.model import DeepSeekV41


def greedy_oracle(model: DeepSeekV41, prompt_ids: list[int] | tuple[int, ...], n: int) -> list[int]:
    """Greedy decoding by re-running the model's cache-free full forward on the growing sequence."""
    seq = list(prompt_ids)
    for _ in range(n):
        logits = model.forward_full(torch.tensor(seq))[0][-1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt_ids) :]


def random_prompts(seed: int, count: int, lo: int, hi: int) -> list[str]:
    """Fresh ASCII prompts of random lengths in [lo, hi] characters (byte tokenizer: one token each)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.;:-0123456789"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi))) for _ in range(count)]


def teacher_forced_argmax(
    model: DeepSeekV41, prompt_ids: list[int] | tuple[int, ...], output_ids: list[int] | tuple[int, ...]
) -> list[int]:
    """Argmax after each prefix of prompt + output[:-1], from one cache-free forward (it is causal)."""
    seq = list(prompt_ids) + list(output_ids)
    logits = model.forward_full(torch.tensor(seq[:-1]))[0]
    return torch.argmax(logits[len(prompt_ids) - 1 :], dim=-1).tolist()


def drain(eng: Any, limit: int = 2000) -> dict:
    """Step ``eng`` until nothing is left (at most ``limit`` steps); {request id: output}. Fails if a request
    is reported twice or work remains after ``limit`` steps."""
    done: dict = {}
    for _ in range(limit):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if not o.finished:  # a streamed output (engine/output_builder.py)
                continue
            assert o.request_id not in done, f"{o.request_id} reported twice"
            done[o.request_id] = o
    assert not eng.has_unfinished()
    return done
