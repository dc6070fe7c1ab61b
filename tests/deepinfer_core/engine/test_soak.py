"""Soak: 10^4 requests through one engine with random aborts; memory flat after warm-up.

A long-running server must not grow with every request it ever served: the engine's per-request tables
(request records, the per-sequence arrays, the scheduler's id maps, drafts) follow the live requests, and
the process RSS stays flat once the allocator is warm.
"""

from __future__ import annotations

import os
import random

import pytest

from deepinfer_core.engine import LLM, LLMEngine

N = int(os.environ.get("SOAK_REQUESTS", "10000"))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def table_sizes(eng: LLMEngine) -> dict[str, int]:
    s = {
        "reqs": len(eng.requests.reqs),
        "by_seq": len(eng.requests.by_seq),
        "seq_rows": eng.requests.seqs.capacity,
        "sched_ids": len(eng.scheduler._seq_of) + len(eng.scheduler._id_of),
        "failed": len(eng.outputs.ready),
        "compiling": len(eng.requests.compiling),
    }
    if eng.drafts is not None:
        s["drafts"] = len(eng.drafts._tokens) + len(eng.drafts._conf)
    return s


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS from /proc (Linux)")
def test_soak_memory_flat() -> None:
    eng = LLM(
        model="tiny-random",
        seed=0,
        num_blocks=256,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=512,
    ).engine
    rng = random.Random(1234)
    live: list[str] = []
    done = 0
    peak: dict[str, int] = {}
    samples: list[tuple[int, float]] = []
    submitted = 0
    while done < N:
        while submitted < N and len(live) < 96:  # keep the engine full, a queue waiting
            rid = f"s{submitted}"
            eng.add_request(
                rid,
                [rng.randrange(3, 259) for _ in range(rng.randint(1, 6))],
                {
                    "temperature": 0.0 if rng.random() < 0.5 else 1.0,
                    "seed": rng.randrange(2**32),
                    "max_tokens": rng.randint(1, 3),
                    "ignore_eos": True,
                },
            )
            live.append(rid)
            submitted += 1
        if live and rng.random() < 0.3:
            eng.abort(live[rng.randrange(len(live))])
        for o in [o for o in eng.step() if o.finished]:
            live.remove(o.request_id)
            done += 1
            assert o.ok, o.error
        for k, v in table_sizes(eng).items():
            peak[k] = max(peak.get(k, 0), v)
        if done and done % 1000 < 64:
            samples.append((done, rss_mib()))
    assert not eng.has_unfinished()
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs
    # tables: bounded by the live requests (96 in flight at most), not by the 10^4 served
    assert peak["reqs"] <= 96 and peak["by_seq"] <= 96 and peak["sched_ids"] <= 2 * 96 + 2, peak
    assert peak["seq_rows"] <= 512, peak
    assert all(v == 0 for k, v in table_sizes(eng).items() if k != "seq_rows"), table_sizes(eng)
    print(f"soak: {N} requests, table peaks {peak}, RSS MiB by requests done {samples}")
    warm = [r for d, r in samples if d >= N // 4]
    assert warm and max(warm) - min(warm) < 32, samples  # MiB: flat after warm-up
