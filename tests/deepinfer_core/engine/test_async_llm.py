"""AsyncLLM (engine/async_llm.py): random interleavings of add / consume / cancel / abort across tasks.

Oracle: each request alone through ``LLM.generate`` (batch-invariant mode): a completed stream's tokens
equal it, a cancelled or aborted one's are a prefix of it; invariants: one finished output per completed
stream, no token lost or repeated, and once everything ended every block, state slot, stream and table
entry is free.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import LLM, AsyncLLM, EngineDeadError, RequestOutputKind
from deepinfer_core.sampling_params import SamplingParams

_ids = itertools.count()
CFG = dict(seed=5, num_blocks=48, block_size=8, max_num_seqs=3, batch_invariant=True)


@pytest.fixture(scope="module", params=["overlap", "sync"])
def served(request: pytest.FixtureRequest):
    """An AsyncLLM (async scheduling with the overlap, or synchronous) and the offline reference."""
    kw = dict(CFG, async_scheduling=request.param == "overlap")
    llm = AsyncLLM("tiny-random", **kw)
    ref = LLM("tiny-random", **kw)
    yield llm, ref
    llm.shutdown()


@functools.cache
def _alone(ref: LLM, prompt: str, params: tuple) -> tuple[tuple[int, ...], str]:
    before = torch.get_num_threads()
    (o,) = ref.generate([prompt], SamplingParams(**dict(params)), use_tqdm=False)
    torch.set_num_threads(before)
    return o.token_ids, o.finish_reason


def wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    """Everything ended: every block, slot, stream and table entry is free."""
    eng = llm.engine
    t0 = time.monotonic()
    while eng.num_live or eng.has_unfinished() or llm.num_streams or llm._inbox:
        assert time.monotonic() - t0 < timeout, "the engine did not become idle"
        time.sleep(0.01)
    time.sleep(0.05)  # a step in progress (the idle check races it) finishes
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs
    assert len(eng.requests.seqs) == 0 and eng.outputs.num_tracked == 0 and llm.num_streams == 0


actor = st.fixed_dictionaries(
    {
        "prompt": st.text(alphabet="abc é中", min_size=1, max_size=10),
        "max_tokens": st.integers(1, 8),
        "seed": st.integers(0, 50),
        "temperature": st.sampled_from([0.0, 0.8]),
        "kind": st.sampled_from([RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA]),
        "action": st.sampled_from(["full", "full", "slow", "break", "cancel", "abort"]),
        "after": st.integers(0, 4),  # outputs read before the action
        "delay": st.integers(0, 3),  # event-loop turns before the request starts
    }
)


async def _run_actor(llm: AsyncLLM, rid: str, a: dict) -> dict:
    for _ in range(a["delay"]):
        await asyncio.sleep(0.002)
    sp = SamplingParams(
        max_tokens=a["max_tokens"], seed=a["seed"], temperature=a["temperature"], output_kind=a["kind"]
    )
    toks: tuple[int, ...] = ()
    last = None
    n = 0
    async for o in llm.generate(a["prompt"], sp, request_id=rid):
        if a["kind"] == RequestOutputKind.DELTA:
            toks += o.token_ids
        else:
            assert o.token_ids[: len(toks)] == toks, "a cumulative output lost a token"
            toks = o.token_ids
        last = o
        n += 1
        if a["action"] == "slow":
            await asyncio.sleep(0.01)  # lags the engine: its deltas are merged, never dropped
        if n > a["after"] and a["action"] == "break":
            break
        if n > a["after"] and a["action"] == "abort":
            llm.abort(rid)
    return {"tokens": toks, "last": last}


@given(actors=st.lists(actor, min_size=1, max_size=7))
@settings(
    max_examples=int(os.environ.get("ASYNC_EXAMPLES", "6")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_interleavings_equal_offline_and_leak_nothing(served, actors: list[dict]) -> None:
    llm, ref = served

    async def main() -> list:
        tasks = [asyncio.create_task(_run_actor(llm, f"t{next(_ids)}", a)) for a in actors]
        cancel = [t for t, a in zip(tasks, actors) if a["action"] == "cancel"]
        for _ in range(max([a["after"] for a in actors] + [0]) + 1):
            await asyncio.sleep(0.01)
        for t in cancel:
            t.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for a, r in zip(actors, results):
        want, reason = _alone(
            ref,
            a["prompt"],
            (("max_tokens", a["max_tokens"]), ("seed", a["seed"]), ("temperature", a["temperature"])),
        )
        if isinstance(r, asyncio.CancelledError):
            continue  # cancelled before any output: nothing to compare
        assert not isinstance(r, BaseException), r
        toks = r["tokens"]
        assert toks == want[: len(toks)], (a, toks, want)
        if a["action"] in ("full", "slow"):
            assert toks == want and r["last"].finished and r["last"].finish_reason == reason, (a, r, want)
        if r["last"] is not None and r["last"].finished and r["last"].finish_reason != "abort":
            assert toks == want
    wait_idle(llm)


def test_slow_consumer_gets_merged_deltas_and_stalls_no_one(served) -> None:
    llm, ref = served
    sp = SamplingParams(max_tokens=12, seed=3, temperature=0.8, output_kind="delta")
    want, _ = _alone(ref, "slow one", (("max_tokens", 12), ("seed", 3), ("temperature", 0.8)))

    async def main() -> tuple:
        slow = llm.generate("slow one", sp, request_id="slow")
        first = await slow.__anext__()  # the request is in; now it lags
        fast_done = None
        async for o in llm.generate("fast one", SamplingParams(max_tokens=12, seed=4), request_id="fast"):
            fast_done = o.finished
        while llm.engine.is_live("slow"):
            await asyncio.sleep(0.01)
        rest = [o async for o in slow]
        return first, rest, fast_done

    first, rest, fast_done = asyncio.run(main())
    assert fast_done
    assert len(rest) == 1 and rest[0].finished  # everything it missed, merged into one output
    assert first.token_ids + rest[0].token_ids == want
    wait_idle(llm)


def test_errors_reach_their_own_stream_only(served) -> None:
    llm, _ = served

    async def collect(p: object, params: object, rid: str) -> list:
        return [o async for o in llm.generate(p, params, request_id=rid)]

    async def main() -> tuple:
        return await asyncio.gather(
            collect("x", {"temperature": -1}, "bad"),
            collect([], None, "empty"),
            collect("ok", {"max_tokens": 3}, "good"),
        )

    bad, empty, good = asyncio.run(main())
    assert len(bad) == 1 and bad[0].finished and bad[0].error.startswith("SamplingParams.temperature")
    assert empty[0].error.startswith("prompt_token_ids") and good[-1].ok and len(good[-1].token_ids) == 3

    async def dup() -> None:
        gen = llm.generate("a", {"max_tokens": 50}, request_id="dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already live"):
            await llm.generate("b", None, request_id="dup").__anext__()
        await gen.aclose()

    asyncio.run(dup())
    wait_idle(llm)


def test_parallel_sampling_through_asyncllm(served) -> None:
    llm, ref = served

    async def main() -> list:
        return [
            o
            async for o in llm.generate(
                "n of three", SamplingParams(max_tokens=5, seed=9, n=3, output_kind="delta")
            )
        ]

    outs = asyncio.run(main())
    for i in range(3):
        want, _ = _alone(ref, "n of three", (("max_tokens", 5), ("seed", 9 + i), ("temperature", 1.0)))
        assert sum((s.token_ids for o in outs for s in o.samples if s.index == i), ()) == want
    wait_idle(llm)


def test_shutdown_returns_everything() -> None:
    llm = AsyncLLM("tiny-random", **CFG)

    async def main() -> list:
        async def one(i: int) -> object:
            try:
                return [o async for o in llm.generate(f"p{i}", {"max_tokens": 200, "ignore_eos": True})][-1]
            except EngineDeadError as e:
                return e

        tasks = [asyncio.create_task(one(i)) for i in range(5)]
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return await asyncio.gather(*tasks)

    res = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) or (r.finished and r.finish_reason == "abort") for r in res), (
        res
    )
    eng = llm.engine
    assert not llm.is_running and eng.num_live == 0 and not eng.has_unfinished()
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs

    async def late() -> None:
        await llm.generate("x").__anext__()

    with pytest.raises(EngineDeadError):
        asyncio.run(late())
