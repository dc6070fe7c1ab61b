"""The load test: 200 concurrent streaming chat requests through ``deepinfer serve`` on the CPU (tiny
model, batch-invariant mode), a third of them cancelled mid-stream.

Oracle: each request alone through ``LLM.generate`` (batch-invariant mode: alone == batched, tested in
engine/test_invariance.py), compared token by token through the ``return_token_ids`` extension: every
completed stream equals it (no token lost, repeated or reordered), every cancelled one is a prefix of it;
at the end every KV block and state slot is free and no request or stream is live.
"""

from __future__ import annotations

import time

import torch

from deepinfer_core.entrypoints.openai.loadgen import percentile, run_chats
from deepinfer_core.sampling_params import SamplingParams

from .conftest import wait_idle

N = 200
MAX_TOKENS = 6
WORDS = ["list", "dict", "loop", "class", "sort", "path", "json", "regex", "async", "yield"]


def bodies() -> list[dict]:
    out = []
    for i in range(N):
        msgs = [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} #{i}: explain"}]
        out.append(
            {
                "model": "tiny",
                "messages": msgs,
                "max_tokens": MAX_TOKENS,
                **({"temperature": 0} if i % 4 == 0 else {"temperature": 0.8, "seed": i}),
            }
        )
    return out


def test_200_concurrent_streams_with_cancellations(server, ref) -> None:
    reqs = bodies()
    cancel = {i: 1 + i % 2 for i in range(N) if i % 3 == 1}  # a third, after 1 or 2 token chunks
    t0 = time.monotonic()
    res = run_chats(server.base_url, reqs, cancel)
    wall = time.monotonic() - t0
    m = wait_idle(server, timeout=60)  # every block, slot, request and stream is free
    prompts = [ref.tokenizer.encode_chat(b["messages"]) for b in reqs]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=b["temperature"], seed=b.get("seed")) for b in reqs
    ]
    before = torch.get_num_threads()
    want = ref.generate(prompts, params, use_tqdm=False)
    torch.set_num_threads(before)
    done = cancelled = 0
    for r, w in zip(res, want):
        assert r.error is None, (r.index, r.error)
        if r.cancelled:
            cancelled += 1
            assert (
                0 < len(r.token_ids) <= len(w.token_ids)
                and tuple(r.token_ids) == w.token_ids[: len(r.token_ids)]
            )
        else:
            done += 1
            assert tuple(r.token_ids) == w.token_ids, (r.index, r.token_ids, w.token_ids)
            assert (
                r.finish_reason == w.finish_reason
                and r.text == ref.tokenizer.parse_assistant(list(w.token_ids))["content"]
            )
    assert cancelled >= N // 4 and done + cancelled == N
    ttft = [r.ttft for r in res if r.ttft is not None]
    itl = [g for r in res for g in r.gaps]
    step_ms = 1e3 * m["deepinfer_engine_step_seconds_total"] / max(m["deepinfer_engine_steps_total"], 1)
    print(
        f"\nload: {N} streams ({cancelled} cancelled) in {wall:.1f} s; TTFT p50 {1e3 * percentile(ttft, 50):.0f} ms "
        f"p99 {1e3 * percentile(ttft, 99):.0f} ms; inter-token p50 {1e3 * percentile(itl, 50):.0f} ms "
        f"p99 {1e3 * percentile(itl, 99):.0f} ms; engine step (mean over the server's life) {step_ms:.1f} ms"
    )
