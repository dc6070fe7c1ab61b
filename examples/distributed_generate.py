"""A 2-rank DP-attention / EP-MoE instance of the tiny model, on CPU (gloo), started either way:

    torchrun --nproc-per-node 2 examples/distributed_generate.py      # torchrun starts the ranks
    python examples/distributed_generate.py --nproc 2                  # spawn() starts them from Python
    (--check: compare with one process; --quick: 4 tokens per prompt)

Each rank serves every other prompt (DP), routes every MoE layer's tokens to the rank holding the
chosen expert replica (EP all-to-all), and every rank prints all completions. ``--check`` compares the
tokens with a single-process engine in batch-invariant mode (they must be equal) and exits non-zero if
not. The weights are random, so the text is noise; what this shows is the instance.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from deepinfer_core.distributed import (
    DistConfig,
    DistributedEngine,
    ParallelGroups,
    init_groups,
    shutdown,
    spawn,
)
from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.sampling_params import SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "DeepSeek-V4.1-Flash uses a sliding window of",
    "Expert parallelism sends each token to",
    "A sharded Engram table is fetched by",
]
PARAMS = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
QUICK = SamplingParams(temperature=0.8, seed=1234, max_tokens=4, ignore_eos=True)
CONFIG = EngineConfig(seed=0, num_blocks=256, max_num_seqs=8, batch_invariant=True)


def serve(groups: ParallelGroups, params: SamplingParams = PARAMS) -> list[list[int]]:
    eng = DistributedEngine(groups, CONFIG, DistConfig())
    outs = eng.generate(PROMPTS, params)  # every rank gets all outputs back, in order
    if groups.rank == 0:
        for p, o in zip(PROMPTS, outs):
            print(f"{p!r} -> {o.text!r}")
        print(
            f"rank 0: EP placement {eng.placement.num_replicas} slots over {eng.placement.num_gpus} ranks, "
            f"{eng.ep.rows_remote} token-expert rows sent to the other rank, "
            f"{eng.sync.dummies} empty-batch forwards joined"
        )
    return [list(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--check", action="store_true", help="compare with the single-process engine")
    ap.add_argument("--quick", action="store_true", help="4 tokens per prompt (CI)")
    args = ap.parse_args()
    params = QUICK if args.quick else PARAMS
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # under torchrun
        got = serve(init_groups(backend="gloo", timeout_s=60), params)
        rank = int(os.environ["RANK"])
        shutdown()
    else:
        got = spawn(serve, args.nproc, args=(params,), backend="gloo", timeout_s=60)[0]
        rank = 0
    if args.check and rank == 0:
        want = [
            list(o.token_ids)
            for o in LLM(
                **{k: getattr(CONFIG, k) for k in ("seed", "num_blocks", "max_num_seqs", "batch_invariant")}
            ).generate(PROMPTS, params, use_tqdm=False)
        ]
        ok = got == want
        print("tokens equal to the single-process engine:", ok)
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
