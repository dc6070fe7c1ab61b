"""Engram: hash a batch of texts into n-gram table rows, fetch the embeddings, and size the real tables.

    python examples/engram_lookup.py [--texts 64] [--fmt fp8|bf16] [--quick]

Engram gives some layers a lookup memory: for each token, the n-grams ending at it (orders 2..max_ngram)
are hashed by several heads into prime-sized tables, and the rows found there are added to the layer's
input. Tokens are first folded to canonical ids (case and leading-space variants share one), so "The
cat" and " the cat" read the same rows. This script hashes a packed batch of random sentences, checks
that repeated n-grams always hit the same rows (the hash is a function of the n-gram only, not of the
position or the batch), fetches rows from a local table, and prints what the V4.1-Flash tables weigh.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from deepinfer_core.engram.canonical import CanonicalTokenMap
from deepinfer_core.engram.config import EngramConfig
from deepinfer_core.engram.hashing import EngramHasher
from deepinfer_core.engram.memory import plan_for_config
from deepinfer_core.engram.tables import LocalEngramTable, random_values
from deepinfer_core.tokenizer import ByteTokenizer

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "table",
    "quickly",
    "slowly",
    "red",
    "blue",
    "big",
    "small",
]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--fmt", choices=("fp8", "bf16"), default="fp8", help="table storage format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 texts (CI)")
    args = ap.parse_args(argv)
    n_texts = 8 if args.quick else args.texts
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(1)

    tok = ByteTokenizer()
    cfg = EngramConfig.tiny()
    hasher = EngramHasher(cfg, CanonicalTokenMap.from_tokenizer(tok))
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(4, 12)))).capitalize() for _ in range(n_texts)]
    ids = [torch.tensor(tok.encode(t)) for t in texts]
    lens = torch.tensor([0] + [len(t) for t in ids])
    flat = torch.cat(ids)
    rows = hasher.hash(flat, torch.cumsum(lens, 0))  # [layers, tokens, heads]: one packed batch
    layer = 0
    r = rows[layer]
    print(
        f"{n_texts} texts, {flat.numel()} tokens packed in one batch -> row ids {tuple(rows.shape)} "
        f"(layers {cfg.layer_ids}, {r.shape[1]} hash columns per token)"
    )

    # Same trailing n-gram (same previous max_ngram tokens inside one text) -> same rows, wherever it is.
    canon = hasher.token_map(flat)  # canonical ids: what the hash actually reads
    keys: dict[tuple[int, ...], torch.Tensor] = {}
    checked = mismatched = 0
    starts = torch.cumsum(lens, 0)[:-1].tolist()
    n = cfg.max_ngram
    for s, t in zip(starts, ids):
        for p in range(n - 1, len(t)):
            key = tuple(canon[s + p - n + 1 : s + p + 1].tolist())
            got = r[s + p]
            if key in keys:
                checked += 1
                mismatched += not torch.equal(keys[key], got)
            else:
                keys[key] = got
    print(f"  repeated {n}-grams: {checked} repeats, every one on the same rows: {mismatched == 0}")

    values = random_values(hasher.num_rows(cfg.layer_ids[layer]), cfg.head_dim)
    table = LocalEngramTable.from_values(values, args.fmt)
    emb = table.fetch(r)
    err = (emb.float() - values[r.long()]).abs().max().item()
    print(
        f"  {args.fmt} table, {table.num_rows:,} rows x {table.row_dim} ({table.nbytes:,} B): fetched "
        f"{tuple(emb.shape)}, largest storage error {err:.1e}"
    )
    v41 = EngramConfig.v41_flash()
    for fmt, ranks in (("fp8", 64), ("bf16", 8)):
        print("  V4.1-Flash: " + plan_for_config(v41, fmt, ranks).summary())
    return {"repeats": float(checked), "mismatched": float(mismatched), "max_err": err}


if __name__ == "__main__":
    main()
