"""Structured outputs without an engine: grammar masks for a batch, with speculative drafts.

    python examples/structured_masks.py [--requests 16] [--backend llguidance|xgrammar] [--quick]

``StructuredOutputManager`` keeps one grammar matcher per request and fills one bitmask row per request
per step, plus one row per draft token (so a verifier can mask every draft position at once; drafts the
grammar rejects cut the row list there). Here random logits stand in for a model and a crude drafter
repeats the last token as its draft; every request carries the same JSON schema, and every finished text
is parsed and checked against it. Needs the structured extra.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deepinfer_core.structured import GrammarSpec, StructuredOutputManager, make_backend
from deepinfer_core.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Hangzhou", "Beijing", "Paris"]},
        "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "temp_c", "rain"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"city", "temp_c", "rain"}
        and doc["city"] in SCHEMA["properties"]["city"]["enum"]
        and type(doc["temp_c"]) is int
        and -40 <= doc["temp_c"] <= 50
        and type(doc["rain"]) is bool
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    # llguidance comes with the structured extra; xgrammar is its own extra
    ap.add_argument("--backend", choices=("xgrammar", "llguidance"), default="llguidance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 requests (CI)")
    args = ap.parse_args(argv)
    n = 4 if args.quick else args.requests
    torch.set_num_threads(1)
    from deepinfer_kernels import get_op

    tok = ByteTokenizer()
    apply = get_op("apply_token_bitmask")
    mgr = StructuredOutputManager(make_backend(args.backend, tok))
    spec = GrammarSpec("json_schema", SCHEMA)
    ids = [f"req{i}" for i in range(n)]
    for rid in ids:
        mgr.add_request(rid, spec)  # compiled once in the background, cached for the others
    mgr.wait(ids)
    gen = torch.Generator().manual_seed(args.seed)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    live, steps, rows = list(ids), 0, 0
    while live:
        batch = [(rid, out[rid][-1:]) for rid in live]  # one draft each: the previous token again
        masks = mgr.fill_bitmask(batch)  # rows: per request, its next position then its surviving draft
        rows += masks.num_rows
        logits = apply(torch.randn(masks.num_rows, tok.vocab_size, generator=gen) * 3, masks.bitmask)
        for j, rid in enumerate(live):
            row = logits[int(masks.offsets[j])]  # this sketch samples the next token only
            t = int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen))
            out[rid].append(t)
            mgr.advance(rid, [t])
        live = [rid for rid in live if mgr.finish_reason(rid) is None]
        steps += 1
    texts = [tok.decode(out[rid]) for rid in ids]
    ok = [valid(t) for t in texts]
    for t in texts[:4]:
        print(f"  {t}")
    print(
        f"{args.backend}: {n} requests in {steps} steps, {rows} mask rows filled (drafts included); "
        f"valid against the schema: {sum(ok)}/{n}"
    )
    mgr.close()
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
