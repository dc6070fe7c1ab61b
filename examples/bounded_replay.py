"""SWA bounded replay after a prefix hit: the plan at the released shape, then the engine on the tiny model.

Part 1 asks ``deepinfer_core.swa`` (numpy only, usable by another engine) what a 4,096-token prefix hit of a
4,608-token prompt costs to rebuild at the released V4.1-Flash shape: which tokens go through which
layers, in bounded mode (keep 140, the release default) and in exact mode, with and without the persisted
encoder state in host memory. Part 2 runs the reference engine with prefix caching: the same long prompt
twice; the second request reuses the cached blocks (``cached_tokens``) and recomputes only the replay
(``replayed_tokens``); in exact mode its tokens equal the first's.

    python examples/bounded_replay.py [--quick]
"""

from __future__ import annotations

import argparse

from deepinfer_core.engine import LLM
from deepinfer_core.model import flash_config
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.swa import BOUNDED, EXACT, ReplayConfig, plan_replay


def show_plans() -> None:
    cfg = flash_config()
    for mode in (BOUNDED, EXACT):
        for host in (True, False):
            rc = ReplayConfig.from_model(cfg, keep=140, block_size=256, mode=mode)
            p = plan_replay(rc, num_tokens=4608, hit=4096, pending_drafts=5, host_state=host)
            steps = ", ".join(
                f"{s.kind} [{s.start}, {s.end}) layers {s.layers[0]}-{s.layers[1]}" for s in p.steps
            )
            print(
                f"  {mode:7s} host copy={host!s:5s}: hit {p.hit}, replayed {p.replayed_tokens} tokens, "
                f"exact={p.exact}; {steps}"
            )


def run_engine(quick: bool) -> None:
    prefix = "def add(a, b):\n    return a + b\n\n" * (12 if quick else 40)
    sp = SamplingParams(temperature=0.0, max_tokens=8 if quick else 16)
    for mode in ("exact", "bounded"):
        # keep 22 = the tiny window (16) + 6 backtracking tokens, the release's 140 = 128 + 12 scaled down
        llm = LLM(model="tiny", swa_replay=mode, swa_keep_tokens=22, block_size=16, num_blocks=256)
        first, again = (
            llm.generate([prefix + tail], sp, use_tqdm=False)[0] for tail in ("class A:", "class B:")
        )
        (cold,) = LLM(model="tiny", prefix_caching=False, block_size=16, num_blocks=256).generate(
            [prefix + "class B:"], sp, use_tqdm=False
        )
        print(
            f"  {mode:7s}: first request cached {first.cached_tokens} tokens; second cached "
            f"{again.cached_tokens} of {len(again.prompt_token_ids)}, replayed {again.replayed_tokens}; "
            f"tokens equal a run without caching: {again.token_ids == cold.token_ids}"
            + ("" if mode == "exact" else " (bounded is approximate: equality is likely, not promised)")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shorter prompt (CI)")
    args = ap.parse_args()
    print("replay plans at the released shape (hit 4,096 of 4,608 tokens, 5 pending drafts):")
    show_plans()
    print("the engine on the built-in tiny model (window 16):")
    run_engine(args.quick)


if __name__ == "__main__":
    main()
