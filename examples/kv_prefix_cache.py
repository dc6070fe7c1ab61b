"""KV memory: a chat workload on the paged pool with prefix caching, and the V4.1-Flash memory plan.

    python examples/kv_prefix_cache.py [--conversations 20] [--turns 4] [--quick]

Conversations share one system prompt and each turn resends the whole history (what a chat client
does), so most of every prompt is a prefix seen before. ``PrefixIndex`` finds it block by block (a chained
64-bit hash per 16-token block, every hit verified against the stored tokens), the pool hands out
refcounted blocks, and only the new tail is "prefilled". Printed: cached vs new tokens, blocks in use,
and what one V4.1-Flash sequence costs in each cache (``plan_memory``).
"""

from __future__ import annotations

import argparse

import numpy as np

from deepinfer_core.kv import KVModelConfig, PagedKVPool, PrefixIndex, plan_memory

BLOCK = 16


def main(argv: list[str] | None = None) -> dict[str, int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="5 conversations x 3 turns (CI)")
    args = ap.parse_args(argv)
    convs, turns = (5, 3) if args.quick else (args.conversations, args.turns)
    rng = np.random.default_rng(args.seed)

    pool = PagedKVPool(num_blocks=args.blocks, block_size=BLOCK)
    index = PrefixIndex(pool)
    system = rng.integers(1, 129_280, 300).tolist()  # a 300-token system prompt
    history = {c: list(system) for c in range(convs)}
    cached = new = 0
    seq = 0
    for t in range(turns):
        for c in range(convs):
            history[c] += rng.integers(1, 129_280, int(rng.integers(20, 120))).tolist()  # the user's turn
            prompt = history[c]
            seq += 1
            hit = index.allocate(seq, prompt)  # reuses the cached prefix's blocks, allocates the rest
            cached, new = cached + hit, new + len(prompt) - hit
            answer = rng.integers(1, 129_280, int(rng.integers(30, 200))).tolist()  # "generated"
            pool.append_slots(seq, len(answer))
            history[c] = prompt + answer
            index.insert_seq(seq, history[c])  # publish the full blocks for the next turn
            pool.free(seq)  # the request ends; its published blocks stay cached until evicted
        print(
            f"  turn {t + 1}: {convs} requests done; {index.num_cached_blocks} blocks kept as cached prefixes "
            f"(reusable, evictable when the pool runs short: {pool.num_free_blocks} of {args.blocks - 1} allocatable)"
        )
    total = cached + new
    print(
        f"{convs} conversations x {turns} turns: {total:,} prompt tokens, {cached:,} found cached "
        f"({100 * cached / total:.0f} %), {new:,} to prefill"
    )

    cfg = KVModelConfig()
    plan = plan_memory(cfg, 80 * 2**30, max_num_seqs=256, block_size=64)
    print(
        f"V4.1-Flash on 80 GiB of cache memory, 256 sequences: {plan.paged_bytes_per_token:.0f} B per cached "
        f"token (main {plan.main_kv_bytes_per_token:.0f} + indexer {plan.indexer_bytes_per_token:.0f}), "
        f"{plan.max_cached_tokens:,} tokens in all; {plan.state_bytes_per_seq:,} B of per-sequence state"
    )
    return {"cached": cached, "new": new}


if __name__ == "__main__":
    main()
