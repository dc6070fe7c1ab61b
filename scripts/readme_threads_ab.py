"""The README main job with ``LLM(num_threads=1)`` (the default) vs ``num_threads=None`` (torch's own thread
count), alternating A B A B in one process; prints one JSON line: per run (wall s, process CPU s, tokens).

    python scripts/readme_threads_ab.py [--rounds 3]

Run it alone on the machine (e.g. under ``flock /tmp/heavy.lock``): CPU time counts every thread.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer_core.engine import LLM
from deepinfer_core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res: dict[str, list[tuple[float, float, int]]] = {"1": [], "default": []}
    for _ in range(args.rounds):
        for name, nt in (("1", 1), ("default", None)):
            t0, c0 = time.perf_counter(), time.process_time()
            llm = LLM(model="tiny", num_threads=nt)
            out = llm.generate(
                ["import os\n\n\ndef "], SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False
            )[0]
            res[name].append((time.perf_counter() - t0, time.process_time() - c0, len(out.token_ids)))
    print(json.dumps({"torch_default_threads": torch.get_num_threads(), **res}))


if __name__ == "__main__":
    main()
