"""Probe: does the engine on the cuda backend capture and replay decode graphs? (issue #32)

Runs the trained ``tiny`` model through ``LLMEngine`` at a few batch sizes, counts the executor's graph
captures / replays / eager decode steps, and logs every capture failure with its traceback. Then the
executor alone at B = 64 followed by B = 1 in one process (the 2026-12-04 regression).

    python scripts/engine_graph_probe.py [--batches 1,16,64] [--gen 24]

Needs a CUDA device. JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import traceback

import torch

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.envs import Envs
from deepinfer_core.model import cuda_graphs
from deepinfer_core.sampling_params import SamplingParams

log = logging.getLogger("engine_graph_probe")
FAILS: list[str] = []
_orig_capture = cuda_graphs.DecodeGraphs._capture


def _capture(self, g):  # type: ignore[no-untyped-def]
    try:
        _orig_capture(self, g)
    except Exception:
        FAILS.append(traceback.format_exc(limit=30))
        raise


cuda_graphs.DecodeGraphs._capture = _capture  # type: ignore[method-assign]


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def engine_run(batch: int, gen: int, glue: bool, mode: str) -> None:
    envs = Envs(fuse_glue=glue)
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            backend="cuda",
            max_num_seqs=max(batch, 1),
            num_blocks=batch * 12 + 16,
            block_size=16,
            max_model_len=256,
            async_scheduling=mode.startswith("async"),
            async_overlap=mode == "async",
        ),
        envs=envs,
    )
    ex = eng.executor
    toks = eng.tokenizer.encode("import os\n\n\ndef main(argv):\n    return ")
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", toks, sp)
    steps = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    g = ex._graphs
    emit(
        probe="engine",
        batch=batch,
        glue=glue,
        mode=mode,
        steps=steps,
        wall_s=round(dt, 3),
        ms_per_step=round(1e3 * dt / max(steps, 1), 3),
        cuda_graphs=ex.cuda_graphs,
        sync_free=ex.sync_free,
        row_path=getattr(ex, "row_path", None),
        graphs=None if g is None else [str(k) for k in g.graphs],
        captures=None if g is None else g.captures,
        replays=None if g is None else g.replays,
        disabled=None if g is None else g.disabled,
        fails=len(FAILS),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--glue", default="0,1")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for glue in [x == "1" for x in a.glue.split(",")]:
        for mode in a.modes.split(","):
            for b in [int(x) for x in a.batches.split(",")]:
                try:
                    engine_run(b, a.gen, glue, mode)
                except Exception as e:
                    emit(probe="engine", batch=b, glue=glue, mode=mode, error=f"{type(e).__name__}: {e}")
                    traceback.print_exc()
    for i, f in enumerate(FAILS[:6]):
        print(f"---- capture failure {i}\n{f}", flush=True)


if __name__ == "__main__":
    main()
