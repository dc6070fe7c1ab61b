"""A short tour of deepinfer_core.kv on a small realistic input (runs in well under a second)."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.kv import KVModelConfig, PagedKVPool, PrefixIndex, StateLayout, formats, plan_memory, ring


def demo() -> None:
    print("== kv: memory plan for DeepSeek-V4.1-Flash on an 80 GiB budget, 256 running sequences")
    cfg = KVModelConfig()
    plan = plan_memory(cfg, 80 * 2**30, max_num_seqs=256, block_size=64)
    print(
        f"paged KV {plan.paged_bytes_per_token:.0f} B/token (main {plan.main_kv_bytes_per_token:.0f} + indexer "
        f"{plan.indexer_bytes_per_token:.0f}); {plan.num_blocks:,} blocks = {plan.max_cached_tokens:,} tokens"
    )
    print(
        f"state {plan.state_bytes_per_seq:,} B/seq, persisted SWA prefix {plan.persisted_swa_bytes_per_seq:,} B "
        f"(= 20 x {cfg.ring_tokens} x {cfg.swa_bytes_per_token})"
    )

    print("== formats: bytes per token and round-trip error on Gaussian data")
    x = torch.randn(64, 576)
    for name in ("fp4", "fp8", "mxfp4", "v32"):
        f = formats.get_format(name)
        xi = x[:, : f.dim]
        y = f.dequantize(f.quantize(xi))
        rel = float((y - xi).norm() / xi.norm())
        print(f"  {name:6s} {f.bytes_per_token:4d} B/token  relative RMS error {rel:.4f}")

    print("== prefix sharing: two chat turns with a common 150-token system prompt (block size 16)")
    pool = PagedKVPool(num_blocks=64, block_size=16)
    index = PrefixIndex(pool)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 129280, size=150).tolist()
    a = system + rng.integers(0, 129280, size=40).tolist()
    b = system + rng.integers(0, 129280, size=25).tolist()
    print(f"  request A: cached {index.allocate(1, a)} of {len(a)} tokens, free blocks {pool.num_free_blocks}")
    index.insert_seq(1, a)
    print(f"  request B: cached {index.allocate(2, b)} of {len(b)} tokens, free blocks {pool.num_free_blocks}")
    pool.fork(2, 3)  # e.g. n=2 sampling
    pool.append_slots(3, 1)
    ops = pool.take_copy_ops()
    print(f"  fork + append: copy-on-write {ops.tolist()} (src, dst, tokens); tables {pool.block_tables([2, 3]).shape}")

    print("== SWA ring (window 128 + backtracking 6): 1000 tokens, then reject 5 drafts")
    n = ring.rollback(1000, 5, 128, 6, high_water=1000)
    lo, hi = ring.live_range(n, 128)
    print(
        f"  write index {ring.write_index(n, 128, 6)}, live positions [{lo}, {hi}), max further rollback "
        f"{ring.max_rollback(n, 128, 6, high_water=1000)}; StateBlock {StateLayout.build(cfg).bytes_per_seq:,} B"
    )


if __name__ == "__main__":
    demo()
