"""Blocks held with and without prefix sharing on a shared-prefix workload (engine, tiny model, CPU).

Requests share a long prefix (a system prompt) plus a short unique suffix; a first request warms the
prefix index, then the rest arrive together. Measured per run, side by side: the peak and mean number of
KV blocks held by sequences (``num_blocks - 1 - num_free_blocks``: evictable cached blocks count free),
prompt tokens computed vs cached, and wall time. "no sharing" is ``prefix_caching=False``, which holds
exactly the blocks the earlier copy-on-hit engine held (it allocated every block of a request privately).
Same greedy tokens are asserted (exact mode, float64). One JSON line per run.

    .venv/bin/python benchmarks/prefix_sharing.py [--requests 8] [--prefix 512] [--suffix 24]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams

log = logging.getLogger("prefix_sharing")


def run(
    prefix_caching: bool, prompts: list[list[int]], params: SamplingParams, args: argparse.Namespace
) -> dict:
    llm = LLM(
        model="tiny-random",
        seed=5,
        dtype="float64",
        quantize=False,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.requests,
        async_scheduling=False,
        prefix_caching=prefix_caching,
        swa_replay="exact",
    )
    eng = llm.engine
    t0 = time.perf_counter()
    warm = llm.generate(prompts[:1], [params], use_tqdm=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    held, outs = [], {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        held.append(eng.config.num_blocks - 1 - eng.kv_pool.num_free_blocks)
    wall = time.perf_counter() - t0
    got = [outs[f"r{i}"] for i in range(len(prompts))]
    return {
        "bench": "prefix_sharing",
        "sharing": prefix_caching,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "block_size": args.block_size,
        "peak_blocks_held": int(max(held)),
        "mean_blocks_held": round(float(np.mean(held)), 1),
        "cached_tokens": int(sum(g.cached_tokens for g in got) + warm[0].cached_tokens),
        "steps": len(held),
        "wall_s": round(wall, 2),
        "tokens": [g.token_ids for g in got],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="a 128-token prefix, 4 requests (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.prefix, args.requests = 128, 4
    logging.basicConfig(level=logging.WARNING)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 259, args.prefix).tolist()
    prompts = [prefix + rng.integers(3, 259, args.suffix).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    res = [run(False, prompts, params, args), run(True, prompts, params, args)]
    assert res[0]["tokens"] == res[1]["tokens"], "sharing changed the greedy tokens"
    for r in res:
        r.pop("tokens")
        print(json.dumps(r))
    print(
        json.dumps(
            {
                "bench": "prefix_sharing",
                "peak_blocks_ratio": round(res[1]["peak_blocks_held"] / res[0]["peak_blocks_held"], 3),
                "wall_ratio": round(res[1]["wall_s"] / res[0]["wall_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
