"""``RequestTable.end``, the one way the engine ends a request, in each of its three ways (``EndHow``),
against an engine that ended nothing: what the output reports, which tokens it keeps, and that the
request's rows, state slot and blocks are gone when they should be, in every step order."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.engine import LLMEngine, RequestOutput
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.outputs import ERROR, STOP
from deepinfer_core.engine.overlap import Launched
from deepinfer_core.engine.request_table import EndHow
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import drain

ORDERS = {"sync": dict(async_scheduling=False), "async": dict(async_overlap=False), "overlap": {}}
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(order: str) -> LLMEngine:
    eng = LLMEngine(
        EngineConfig(
            model="tiny-random", seed=3, num_blocks=48, block_size=8, max_num_seqs=4, **ORDERS[order]
        )
    )
    assert eng.step_mode == order
    return eng


def _clean(order: str) -> dict[str, RequestOutput]:
    eng = _engine(order)
    eng.add_request("a", [5, 6, 7, 8], SP)
    eng.add_request("b", [9, 10, 11], SP)
    return drain(eng)


def _applied(eng: LLMEngine, rid: str) -> list[int]:
    return list(eng.scheduler.output_token_ids(rid))


@pytest.mark.parametrize("order", list(ORDERS))
def test_end_now(order: str) -> None:
    """NOW (an abort, a failed row): the slot comes back at once, no later token is kept."""
    ref = _clean(order)
    eng = _engine(order)
    eng.add_request("a", [5, 6, 7, 8], SP)
    eng.add_request("b", [9, 10, 11], SP)
    out: dict[str, RequestOutput] = {}
    for _ in range(3):
        out.update({o.request_id: o for o in eng.step()})
    req = eng.requests.reqs["a"]
    seq = req.seq
    assert eng.state_pool.contains(seq)
    applied = _applied(eng, "a")
    assert eng.requests.end(req, ERROR, "ended by the test")  # aborted in the scheduler now
    assert not eng.state_pool.contains(seq)
    assert eng.requests.seqs.dead[eng.requests.seqs.row(seq)]
    out.update(drain(eng))
    a, b = out["a"], out["b"]
    assert (a.finish_reason, a.error) == (ERROR, "ended by the test")
    assert list(a.token_ids) == applied  # nothing after the end: a row in flight is dropped
    assert list(a.token_ids) == list(ref["a"].token_ids[: len(applied)])
    assert b.ok and b.token_ids == ref["b"].token_ids  # the other request never noticed
    assert eng.num_live == 0 and len(eng.requests.seqs) == 0
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1


def _end_at_landing(
    eng: LLMEngine, rid: str, landing: int, how: EndHow, reason: str, error: str | None
) -> list[int]:
    """End ``rid`` as a stop string or the grammar would: right after the ``landing``-th step that sampled a
    token for it is on the host, before ``Scheduler.update`` applies it. Returns [tokens applied before]."""
    real, seen, before = eng.runner.land, [0], []

    def land(step: Launched) -> Launched:
        done = real(step)
        req = eng.requests.reqs.get(rid)
        if req is None or req.reason is not None or done.tokens is None:
            return done
        rows = np.flatnonzero(done.plan.seq_ids == req.seq)
        if rows.size and done.plan.sample[rows[0]]:
            seen[0] += 1
            if seen[0] == landing:
                before.append(len(_applied(eng, rid)))
                if how is EndHow.BY_TOKEN:
                    done.tokens.tokens[rows[0]] = -1  # what a dead end or a failing grammar samples
                eng.requests.end(req, reason, error, how)
        return done

    eng.runner.land = land  # type: ignore[method-assign]
    return before


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("how", [EndHow.AFTER_UPDATE, EndHow.BY_TOKEN])
def test_end_with_this_steps_token(order: str, how: EndHow) -> None:
    """AFTER_UPDATE (a stop string, a grammar end under ignore_eos): the token being applied counts, then
    the request is aborted. BY_TOKEN with a -1 (a grammar dead end or library error): the scheduler fails
    it on that token, which is not kept. Both report the engine's reason and error."""
    ref = _clean(order)
    eng = _engine(order)
    reason, error = (STOP, None) if how is EndHow.AFTER_UPDATE else ("grammar_dead_end", "dead end (test)")
    before = _end_at_landing(eng, "a", 3, how, reason, error)
    eng.add_request("a", [5, 6, 7, 8], SP)
    eng.add_request("b", [9, 10, 11], SP)
    out = drain(eng)
    a = out["a"]
    assert (a.finish_reason, a.error) == (reason, error)
    assert len(before) == 1
    assert len(a.token_ids) == before[0] + (1 if how is EndHow.AFTER_UPDATE else 0)
    assert list(a.token_ids) == list(ref["a"].token_ids[: len(a.token_ids)])
    assert out["b"].token_ids == ref["b"].token_ids
    assert eng.num_live == 0 and eng.state_pool.num_free_slots == eng.config.max_num_seqs
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1


def test_end_before_the_scheduler_reports_at_the_next_step() -> None:
    """A request that never reached the scheduler (here: still compiling its grammar) ends at once and is
    reported by the next step, as an abort unless a reason is given."""
    pytest.importorskip("xgrammar")
    eng = _engine("sync")
    eng.add_request("g", [5, 6], SamplingParams(temperature=0.0, max_tokens=4, so_args={"regex": "[ab]{2}"}))
    req = eng.requests.reqs["g"]
    assert req.seq < 0 and eng.requests.compiling == ["g"]
    assert eng.requests.end(req, ERROR, "refused by the test")
    assert not eng.requests.compiling and eng.is_live("g")
    (o,) = eng.step()
    assert (o.request_id, o.finish_reason, o.error) == ("g", ERROR, "refused by the test")
    assert not eng.is_live("g") and not eng.has_unfinished()
