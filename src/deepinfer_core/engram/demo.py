"""A few lines showing Engram at work on the tiny model's tokenizer (well under a second on a CPU)."""

from __future__ import annotations

import torch

from deepinfer_core.engram.canonical import CanonicalTokenMap
from deepinfer_core.engram.config import EngramConfig
from deepinfer_core.engram.hashing import EngramHasher
from deepinfer_core.engram.memory import plan_for_config
from deepinfer_core.engram.tables import LocalEngramTable, random_values


def demo() -> None:
    from deepinfer_core.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    cfg = EngramConfig.tiny()
    cmap = CanonicalTokenMap.from_tokenizer(tok)
    hasher = EngramHasher(cfg, cmap)
    print(
        f"  tiny config: Engram at layers {cfg.layer_ids}, n-grams of 2..{cfg.max_ngram} tokens x "
        f"{cfg.heads_per_order} hash heads, table sizes (primes) {hasher.primes[0].reshape(-1).tolist()} "
        f"at layer {cfg.layer_ids[0]}; tokens folded to {cmap.num_canonical} canonical ids of {cmap.vocab_size} "
        f"(case and spacing variants share one)"
    )
    texts = ["The cat sat", "the CAT sat"]
    ids = [torch.tensor(tok.encode(t)) for t in texts]
    cu = torch.tensor([0, len(ids[0]), len(ids[0]) + len(ids[1])])
    rows = hasher.hash(torch.cat(ids), cu)  # one packed batch of two sequences
    a, b = rows[0, : len(ids[0])], rows[0, len(ids[0]) :]
    print(
        f"  one packed batch {texts}: table row ids {tuple(rows.shape)} (layers, tokens, heads); the two "
        f"case variants hash to the same rows: {int((a == b).sum())} of {a.numel()} at layer {cfg.layer_ids[0]}"
    )
    values = random_values(hasher.num_rows(cfg.layer_ids[0]), cfg.head_dim)
    table = LocalEngramTable.from_values(values, "fp8")
    emb = table.fetch(a)
    err = (emb.float() - values[a.long()]).abs().max().item()
    print(
        f"  fp8 table of {table.num_rows} rows x {table.row_dim} values ({table.nbytes:,} B): fetched "
        f"{tuple(emb.shape)} embeddings, largest fp8 rounding error {err:.2e}"
    )
    v41 = EngramConfig.v41_flash()
    for fmt, group in (("fp8", 64), ("bf16", 4)):
        print("  full-size V4.1-Flash tables: " + plan_for_config(v41, fmt, group).summary())


if __name__ == "__main__":
    demo()
