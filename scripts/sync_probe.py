"""Where a steady-state engine decode step synchronises (device diagnostic, issue #24): torch's sync debug
mode set to "warn" after warm-up; each distinct synchronising call site's Python stack is printed.
Usage: python scripts/sync_probe.py [--batch 4]"""

from __future__ import annotations

import argparse
import traceback
import warnings

import torch

from deepinfer_core.engine import EngineConfig, LLMEngine
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    eng = LLMEngine(
        EngineConfig(backend="cuda", num_blocks=256, max_num_seqs=16), envs=Envs(use_nextn_decode=0)
    )
    sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"w{i}", [5 + i] * 30, sp)
    for _ in range(12):
        eng.step()
    seen: dict[str, int] = {}

    def show(
        message: object,
        category: object,
        filename: str,
        lineno: int,
        file: object = None,
        line: object = None,
    ) -> None:
        if "synchroniz" not in str(message):
            return
        stack = "".join(traceback.format_stack()[-9:-1])
        seen[stack] = seen.get(stack, 0) + 1
        if seen[stack] == 1:
            print("==== sync site\n", stack, flush=True)

    warnings.simplefilter("always")
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(20):
        eng.step()
    torch.cuda.set_sync_debug_mode("default")
    print(f"{len(seen)} distinct sync sites, {sum(seen.values())} calls in 20 steps; stats {eng.stats}")


if __name__ == "__main__":
    main()
