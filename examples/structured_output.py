"""Structured outputs through the engine: regex, JSON schema, choice and EBNF constraints via so_args.

    python examples/structured_output.py [--backend auto|xgrammar|llguidance]

The built-in tiny model is a small model trained on Python sources, so the grammar is what gives the
text its shape: every completion below matches its constraint (checked here with re / json), and an
invalid grammar fails its request alone.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "grace", "linus"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{4}"


def _holds(kind: str, so: dict, text: str) -> bool:
    if kind == "regex":
        return bool(re.fullmatch(REGEX, text))
    if kind == "json_schema":
        doc = json.loads(text)
        return set(doc) == set(SCHEMA["required"]) and doc["name"] in ("ada", "grace", "linus")
    if kind == "choice":
        return text in so["choice"]
    return text in ("yes", "no")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # auto (the engine's default): the installed engines, llguidance from the structured extra,
    # xgrammar from its own extra
    ap.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(seed=0, num_blocks=256, max_num_seqs=16, structured_backend=args.backend)
    requests = [
        ("A flight code: ", {"regex": REGEX}),
        ("A user record: ", {"json_schema": SCHEMA}),
        ("Pick a colour: ", {"choice": ["red", "green", "blue"]}),
        ("Yes or no? ", {"ebnf": 'root ::= "yes" | "no"'}),
        ("Broken: ", {"regex": "(unclosed"}),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, so_args=so)
        for i, (_, so) in enumerate(requests)
    ]
    outs = llm.generate([p for p, _ in requests], params)
    for (prompt, so), o in zip(requests, outs):
        if not o.ok:
            print(f"{prompt!r} {so} -> ERROR ({o.finish_reason}): {o.error}")
            continue
        kind = next(iter(so))
        print(
            f"{prompt!r} {kind} -> {o.text!r} ({o.finish_reason}; constraint holds: {_holds(kind, so, o.text)})"
        )


if __name__ == "__main__":
    main()
