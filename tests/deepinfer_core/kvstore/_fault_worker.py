"""Runs an engine on a FileKVStore under a fault that needs its own process, and prints one JSON line.

``readonly POPULATED EMPTY``: run as a user who may read but not write the store directories (the
test starts it as nobody when it is root): every touch and put is refused.
``fsize STORE``: a file-size limit of 4 KiB (RLIMIT_FSIZE, soft; a block record is ~24 KiB) makes every
put fail with EFBIG, as a full disk would; then the limit is lifted and the hit rate must recover.

The oracle is the same prompts on an engine without a store, in this process.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from deepinfer_core.engine import LLM
from deepinfer_core.kvstore import FileKVStore, StoreGuardConfig
from deepinfer_core.kvstore.guard import PROBE_KEY
from deepinfer_core.sampling_params import SamplingParams

EXACT = {"model": "tiny-random", "seed": 5, "dtype": "float64", "quantize": False}
ENGINE = {
    "num_blocks": 256,
    "block_size": 16,
    "max_num_seqs": 4,
    "async_scheduling": False,
    "swa_replay": "exact",
}
GUARD = StoreGuardConfig(read_timeout_s=1.0, write_timeout_s=1.0, backoff_s=0.02, max_backoff_s=0.1)


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, 150).tolist()
    return [
        prefix + rng.integers(3, 259, 7).tolist(),
        prefix + rng.integers(3, 259, 20).tolist(),
        rng.integers(3, 259, 40).tolist(),
    ]  # an unrelated short prompt in the same batch


def run(store: FileKVStore, ps: list[list[int]], ref: LLM) -> dict:
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = LLM(kv_store=store, kv_store_guard=GUARD, **ENGINE, **EXACT)
    got = llm.generate(ps, p, use_tqdm=False)
    want = ref.generate(ps, p, use_tqdm=False)
    eng = llm.engine
    return {
        "errors": [g.error for g in got if g.error],
        "equal": [g.token_ids for g in got] == [w.token_ids for w in want],
        "cached": [g.cached_tokens for g in got],
        "kv_store_errors": dict(eng.prefix.stats.kv_store_errors),
        "free": eng.kv_pool.num_free_blocks == ENGINE["num_blocks"] - 1
        and eng.state_pool.num_free_slots == ENGINE["max_num_seqs"],
        "write_state": eng.prefix.link.guard.state("write"),
        "llm": llm,
    }


def tmp_files(root: str) -> int:
    return sum(1 for f in Path(root).rglob("*") if f.name.startswith(".tmp."))


def main() -> None:
    mode = sys.argv[1]
    ref = LLM(prefix_caching=False, **ENGINE, **EXACT)
    out: dict = {}
    if mode == "readonly":
        populated, empty = sys.argv[2], sys.argv[3]
        for name, root in (("populated", populated), ("empty", empty)):
            r = run(FileKVStore(root, fsync=False), prompts(3), ref)
            r.pop("llm")
            out[name] = r
    else:
        root = sys.argv[2]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        store = FileKVStore(root, fsync=False)
        r = run(store, prompts(4), ref)
        llm = r.pop("llm")
        r["tmp_left"] = tmp_files(root)
        r["blocks"] = sum(
            1 for f in Path(root).rglob("*.kvb") if f != store.path(PROBE_KEY)
        )  # (a probe's empty record fits)
        out["full"] = r
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        )  # space again
        g = llm.engine.prefix.link.guard
        end = time.monotonic() + 10
        while not g.allows("write") and time.monotonic() < end:  # past the back-off a probe finds room
            time.sleep(0.01)
        p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        ps = prompts(5)
        llm.generate(ps, p, use_tqdm=False)  # written back now (the breaker closed after its probe)
        written = llm.engine.prefix.link.written_blocks
        llm.engine.reset()  # an empty GPU index: the same prompts can only hit the store
        again = llm.generate(ps, p, use_tqdm=False)
        want = ref.generate(ps, p, use_tqdm=False)
        out["recovered"] = {
            "written": written,
            "cached": [g.cached_tokens for g in again],
            "equal": [g.token_ids for g in again] == [w.token_ids for w in want],
            "errors": [g.error for g in again if g.error],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
