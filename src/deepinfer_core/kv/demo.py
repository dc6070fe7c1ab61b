"""A short tour of deepinfer_core.kv on a small realistic input (runs in well under a second)."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.kv import KVModelConfig, PagedKVPool, PrefixIndex, StateLayout, formats, plan_memory, ring


def demo() -> None:
    print("  memory plan for DeepSeek-V4.1-Flash: 80 GiB for caches, 256 running sequences")
    cfg = KVModelConfig()
    plan = plan_memory(cfg, 80 * 2**30, max_num_seqs=256, block_size=64)
    print(
        f"    paged KV cache: {plan.paged_bytes_per_token:.0f} B per token (main {plan.main_kv_bytes_per_token:.0f} "
        f"+ indexer {plan.indexer_bytes_per_token:.0f}), room for {plan.num_blocks:,} blocks = "
        f"{plan.max_cached_tokens:,} cached tokens"
    )
    print(
        f"    per-sequence state (sliding-window rings, compressor state): {plan.state_bytes_per_seq:,} B; the "
        f"part saved with a cached prefix: {plan.persisted_swa_bytes_per_seq:,} B "
        f"(= 20 x {cfg.ring_tokens} tokens x {cfg.swa_bytes_per_token} B)"
    )

    print("  cache formats: bytes per token, and round-trip error on Gaussian data")
    x = torch.randn(64, 576)
    for name in ("fp4", "fp8", "mxfp4", "v32"):
        f = formats.get_format(name)
        xi = x[:, : f.dim]
        y = f.dequantize(f.quantize(xi))
        rel = float((y - xi).norm() / xi.norm())
        print(f"    {name:6s} {f.bytes_per_token:4d} B/token  relative RMS error {rel:.4f}")

    print("  prefix sharing: two requests with the same 150-token system prompt (blocks of 16 tokens)")
    pool = PagedKVPool(num_blocks=64, block_size=16)
    index = PrefixIndex(pool)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 129280, size=150).tolist()
    a = system + rng.integers(0, 129280, size=40).tolist()
    b = system + rng.integers(0, 129280, size=25).tolist()
    print(
        f"    request A: {index.allocate(1, a)} of {len(a)} tokens found cached (first request), "
        f"{pool.num_free_blocks} blocks free"
    )
    index.insert_seq(1, a)
    print(
        f"    request B: {index.allocate(2, b)} of {len(b)} tokens found cached (the system prompt's whole blocks), "
        f"{pool.num_free_blocks} blocks free"
    )
    pool.fork(2, 3)  # e.g. n=2 sampling
    pool.append_slots(3, 1)
    ops = pool.take_copy_ops()
    print(
        f"    fork B (a second sample) and append a token: copy-on-write of the shared last block "
        f"{ops.tolist()} (src, dst, tokens); block tables {tuple(pool.block_tables([2, 3]).shape)}"
    )

    print("  sliding-window ring (window 128 + 6 for rollback): 1,000 tokens written, then 5 drafts rejected")
    n = ring.rollback(1000, 5, 128, 6, high_water=1000)
    lo, hi = ring.live_range(n, 128)
    print(
        f"    next write at ring slot {ring.write_index(n, 128, 6)}, positions [{lo}, {hi}) live, "
        f"{ring.max_rollback(n, 128, 6, high_water=1000)} more token(s) can be rolled back; "
        f"per-sequence state block {StateLayout.build(cfg).bytes_per_seq:,} B"
    )


if __name__ == "__main__":
    demo()
