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
    print(f"engram: layers {cfg.layer_ids}, orders 2..{cfg.max_ngram} x {cfg.heads_per_order} heads, "
          f"primes {hasher.primes[0].reshape(-1).tolist()} (layer {cfg.layer_ids[0]}), "
          f"canonical vocab {cmap.num_canonical} of {cmap.vocab_size}")
    texts = ["The cat sat", "the CAT sat"]
    ids = [torch.tensor(tok.encode(t)) for t in texts]
    cu = torch.tensor([0, len(ids[0]), len(ids[0]) + len(ids[1])])
    rows = hasher.hash(torch.cat(ids), cu)  # one packed batch of two sequences
    a, b = rows[0, : len(ids[0])], rows[0, len(ids[0]) :]
    print(f"engram: packed batch {texts}: row ids {tuple(rows.shape)}; case variants share all "
          f"{int((a == b).sum())}/{a.numel()} layer-{cfg.layer_ids[0]} rows")
    values = random_values(hasher.num_rows(cfg.layer_ids[0]), cfg.head_dim)
    table = LocalEngramTable.from_values(values, "fp8")
    emb = table.fetch(a)
    err = (emb.float() - values[a.long()]).abs().max().item()
    print(f"engram: fp8 table {table.num_rows} rows x {table.row_dim} ({table.nbytes} B): fetched {tuple(emb.shape)}, "
          f"max |fp8 - fp32| {err:.2e}")
    v41 = EngramConfig.v41_flash()
    for fmt, group in (("fp8", 64), ("bf16", 4)):
        print("engram: V4.1-Flash tables, " + plan_for_config(v41, fmt, group).summary())


if __name__ == "__main__":
    demo()
