"""Golden outputs of the reference engine on fixed seeds, for refactors that must not change a token
(issue #31: the engine split into collaborators).

Seven engine configurations (overlap, plain async, sync, speculative, batch-invariant, no prefix cache,
speculative float64) each serve one workload: greedy, seeded sampled, top-k / top-p, min_tokens, stop
strings and stop ids, two structured requests, two requests sharing a 40-token prefix, staggered arrivals
and an abort. Writes every output (token ids, text, finish reason, error, stop reason, cached / replayed
tokens) and each run's step count as JSON; compare two commits with ``cmp``:

    python scripts/engine_golden.py /tmp/before.json   # on the old commit
    python scripts/engine_golden.py /tmp/after.json    # on the new one
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from deepinfer_core.engine import EngineConfig, LLMEngine
from deepinfer_core.sampling_params import SamplingParams as SP

CONFIGS: dict[str, dict[str, Any]] = {
    "overlap": {},
    "async": {"async_overlap": False},
    "sync": {"async_scheduling": False},
    "spec": {"speculative": True, "num_speculative_tokens": 3},
    "inv": {"batch_invariant": True},
    "nocache": {"prefix_caching": False, "async_scheduling": False},
    "spec-f64": {"speculative": True, "dtype": "float64", "quantize": False},
}


def workload() -> list[tuple[str, Any, SP]]:
    reqs: list[tuple[str, Any, SP]] = []
    for i in range(10):
        prompt = [3 + (7 * i + 13 * j) % 250 for j in range(5 + 3 * i)]
        sp = [
            SP(temperature=0.0, max_tokens=12, ignore_eos=True),
            SP(temperature=0.8, seed=i, max_tokens=10, min_tokens=4),
            SP(temperature=1.0, top_k=20, top_p=0.9, max_tokens=9),
            SP(temperature=0.0, max_tokens=14, stop=["e", "ab"], stop_token_ids=[7]),
            SP(temperature=0.7, max_tokens=11),
        ][i % 5]
        reqs.append((f"r{i}", prompt, sp))
    reqs.append(("s0", "json: ", SP(temperature=0.0, max_tokens=16, so_args={"regex": "[a-c]{3,5}"})))
    reqs.append(("s1", "x", SP(temperature=0.9, seed=3, max_tokens=16, so_args={"regex": "(ab|cd)+e"})))
    reqs.append(("shared", [5] * 40 + [6, 7], SP(temperature=0.0, max_tokens=6)))
    reqs.append(("shared2", [5] * 40 + [8, 9, 10], SP(temperature=0.0, max_tokens=6)))
    return reqs


def run(name: str, **kw: Any) -> dict[str, Any]:
    eng = LLMEngine(EngineConfig(model="tiny-random", seed=1, num_blocks=128, max_num_seqs=6, **kw))
    wl = workload()
    for rid, prompt, sp in wl[:6]:
        eng.add_request(rid, prompt, sp)
    pending, out, n = wl[6:], {}, 0
    while eng.has_unfinished() or pending:
        if pending and n % 3 == 0:  # staggered arrivals
            eng.add_request(*pending.pop(0))
        if n == 5:
            eng.abort("r3")
        for o in eng.step():
            if not o.finished:  # a streamed progress output (#33): the final one is compared
                continue
            out[o.request_id] = [
                list(o.token_ids),
                o.text,
                o.finish_reason,
                o.error,
                o.stop_reason,
                o.cached_tokens,
                o.replayed_tokens,
            ]
        n += 1
    return {"name": name, "steps": n, "stats": eng.stats.steps, "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = [run(name, **kw) for name, kw in CONFIGS.items()]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=0, sort_keys=True)
    print("ok", [(r["name"], r["steps"]) for r in res])


if __name__ == "__main__":
    main()
