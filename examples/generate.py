"""Offline generation on the built-in tiny model (a trained checkpoint shipped in the package, no download).

    python examples/generate.py [--sync] [--temperature 0.8] [--max-tokens 32] [--model tiny-random]

The tiny model is small and was trained on Python sources for minutes on a CPU, so code prompts read best
and the text is weak; what this shows is the engine: batching, one-step-ahead scheduling, per-request
seeds, and a bad request failing alone. ``--model tiny-random`` takes random weights from ``--seed``.
"""

from __future__ import annotations

import argparse
import logging

from deepinfer_core.display import printable
from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: one step ahead)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="tiny", help="tiny (trained, default) or tiny-random")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of tiny-random")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # LLM runs torch on one CPU thread by default (num_threads=1): the tiny model is dispatch-bound
    llm = LLM(
        model=args.model,
        seed=args.seed,
        backend="reference",
        num_blocks=256,
        max_num_seqs=16,
        async_scheduling=not args.sync,
    )
    prompts = [
        "import os\n\n\ndef ",
        "class Stack:\n    def ",
        "# Read the configuration file\n",
        [72, 105, 33],  # token ids work too
        "",  # fails alone: empty prompt
    ]
    sp = SamplingParams(temperature=args.temperature, seed=1234, max_tokens=args.max_tokens, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, sp)):
        shown = repr(printable(o.text)) if o.ok else f"ERROR: {o.error}"
        print(
            f"{p!r}\n  -> {shown}\n     {len(o.token_ids)} tokens, finish_reason={o.finish_reason}, "
            f"preemptions={o.num_preemptions}"
        )


if __name__ == "__main__":
    main()
