"""A few lines showing structured outputs at work: three constrained requests decoded with random logits."""

from __future__ import annotations

import json

import torch

from deepinfer_core.display import printable
from deepinfer_core.extras import EXTRAS, install_hint
from deepinfer_core.structured import GrammarSpec, StructuredOutputManager, make_backend, require_any_engine
from deepinfer_core.tokenizer import ByteTokenizer

KIND_LABEL = {"date": "regex (a date)", "json": "JSON schema", "ebnf": "EBNF grammar (a sum)"}


def demo() -> None:
    from deepinfer_kernels import get_op

    tok = ByteTokenizer()
    apply = get_op("apply_token_bitmask")
    specs = {
        "date": GrammarSpec("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
        "json": GrammarSpec(
            "json_schema",
            {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Hangzhou", "Beijing"]},
                    "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
                },
                "required": ["city", "temp_c"],
                "additionalProperties": False,
            },
        ),
        "ebnf": GrammarSpec("ebnf", 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'),
        "bad": GrammarSpec("regex", "[unclosed"),
    }
    texts: dict[str, dict[str, str]] = {}
    engines = require_any_engine("the structured outputs demo")
    for backend_name in engines:
        mgr = StructuredOutputManager(make_backend(backend_name, tok))
        for rid, spec in specs.items():
            mgr.add_request(rid, spec)
        mgr.wait(specs)
        gen = torch.Generator().manual_seed(0)
        out: dict[str, list[int]] = {rid: [] for rid in specs}
        live = [rid for rid in specs if mgr.finish_reason(rid) is None]
        steps = 0
        while live:
            # One draft per request: the previous step's token repeated (a crude drafter); the
            # grammar cuts it where it would be invalid, the "verifier" accepts nothing here.
            batch = [(rid, out[rid][-1:]) for rid in live]
            masks = mgr.fill_bitmask(batch)
            logits = apply(torch.randn(masks.num_rows, tok.vocab_size, generator=gen) * 2, masks.bitmask)
            for j, rid in enumerate(live):
                row = logits[int(masks.offsets[j])]
                t = int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen))
                out[rid].append(t)
                mgr.advance(rid, [t])
            live = [rid for rid in live if mgr.finish_reason(rid) is None]
            steps += 1
        print(f"  {backend_name}: {len(specs)} requests decoded together in {steps} steps")
        for rid in specs:
            text = tok.decode(out[rid])
            texts.setdefault(backend_name, {})[rid] = text
            why = mgr.finish_reason(rid)
            if mgr.error(rid):
                # the invalid grammar is refused alone; the other requests are not affected
                print(
                    f"    {rid:5s} refused as expected ({why.value if why else None}): "
                    f"{(mgr.error(rid) or '').splitlines()[0]}"
                )
            else:
                print(
                    f"    {rid:5s} {KIND_LABEL[rid]:22s} -> {printable(text)!r} ({why.value if why else None})"
                )
            if rid == "json" and why == "stop":
                json.loads(text)  # the constrained text is valid JSON
        mgr.close()
    if len(texts) == 2:
        same = texts["xgrammar"] == texts["llguidance"]
        print(f"  same seed and logits give the same texts with both backends: {same}")
    else:
        (missing,) = (e for e in ("xgrammar", "llguidance") if e not in texts)
        print(f"  (the {missing} engine is not installed: {install_hint(EXTRAS[missing])} adds it)")


if __name__ == "__main__":
    demo()
