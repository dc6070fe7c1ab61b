"""A DP group of 2-4 NORMAL ranks in lockstep over random workloads (sync and one step ahead): every step
all ranks run the same step type, a rank with prefill work it can start waits at most
``prefill_any_attempt_interval`` consecutive decode steps, and every stream equals the oracle."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.scheduler import EngineType, FinishReason, Scheduler, SchedulerConfig, StepType

from .harness import EOS, VOCAB, FakeExecutor, Oracle, Spec


def group_of(wishes: list[tuple[bool, bool]]) -> tuple[bool, bool, bool]:
    """What DistributedVote's all-reduce returns, computed in-process."""
    return (all(w[0] for w in wishes), any(w[0] for w in wishes), any(w[1] for w in wishes))


@given(data=st.data())
def test_group_agrees_and_prefill_wait_is_bounded(data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    n_ranks = data.draw(st.integers(2, 4))
    attempt = data.draw(st.integers(0, 3))
    any_interval = attempt + data.draw(st.integers(0, 5))
    lag = data.draw(st.integers(0, 1))
    cfg = SchedulerConfig(
        max_num_seqs=data.draw(st.integers(1, 6)),
        max_model_len=96,
        eos_token_id=EOS,
        prefill_attempt_interval=attempt,
        prefill_any_attempt_interval=any_interval,
        async_mode=bool(lag),
        max_num_batched_tokens=data.draw(st.integers(4, 64)),
    )
    ranks, specs, execs = [], [], []
    for r in range(n_ranks):
        pool = PagedKVPool(int(rng.integers(12, 40)), 4)
        ranks.append(Scheduler(pool, cfg))
        mine = [
            Spec(
                no=100 * r + i,
                arrive=int(rng.integers(0, 40)),
                prompt=[int(x) for x in rng.integers(1, VOCAB, size=int(rng.integers(1, 24)))],
                max_tokens=int(rng.integers(1, 24)),
                ignore_eos=bool(rng.random() < 0.5),
            )
            for i in range(int(rng.integers(0, 6)))  # some ranks get nothing at all
        ]
        specs.append(mine)
        execs.append(FakeExecutor(Oracle(mine)))
    waits = [0] * n_ranks
    inflight: list[deque] = [deque() for _ in range(n_ranks)]
    finished: list[dict] = [{} for _ in range(n_ranks)]
    for step in range(3000):
        for r, s in enumerate(ranks):
            for sp in specs[r]:
                if sp.arrive == step:
                    s.add_request(sp.request())
        busy = any(s.num_live for s in ranks)
        if busy:
            wishes = [s.step_wish() for s in ranks]
            group = group_of(wishes)
            plans = [s.schedule(group) for s in ranks]
            assert len({p.step_type for p in plans}) == 1, "ranks of one group ran different step types"
            for r, (w, p) in enumerate(zip(wishes, plans)):
                waits[r] = waits[r] + 1 if (w[0] and p.step_type is StepType.DECODE) else 0
                assert waits[r] <= any_interval, f"rank {r} waited {waits[r]} decode steps with prefill work"
                inflight[r].append((p, execs[r].run(p)))
        for r, s in enumerate(ranks):
            if inflight[r] and (len(inflight[r]) > lag or not busy):
                for f in s.update(*inflight[r].popleft()):
                    assert f.request_id not in finished[r]
                    finished[r][f.request_id] = f
        if step > 40 and not busy and not any(inflight):
            break
    for r in range(n_ranks):
        assert set(finished[r]) == {sp.rid for sp in specs[r]}
        oracle = Oracle(specs[r])
        for sp in specs[r]:
            want, why = oracle.expected(sp.rid, EngineType.NORMAL)
            got = finished[r][sp.rid]
            assert got.finish_reason is why and list(got.output_token_ids) == want
            assert why in (FinishReason.STOP, FinishReason.LENGTH)
