"""``DistributedEngine``: one DP rank of an instance, wrapping :class:`~deepinfer_core.engine.LLMEngine`.

Each rank has its own engine (scheduler, KV / state pools, requests); the wrapper adds, without
changing the engine's code:

- the step-type vote over the DP group (a :class:`~deepinfer_core.scheduler.DistributedVote` set as the
  scheduler's ``vote``; a rank with nothing queued still votes, "no work");
- the EP MoE (:class:`~deepinfer_core.distributed.ep.ExpertParallel` in place of every block's MoE) and
  the lock-step rounds (:class:`~deepinfer_core.distributed.ep.StepSync`) through an executor proxy, so a
  rank with fewer forwards, or none, joins the others' MoE collectives with an empty batch;
- Engram tables sharded by rows over the engram-parallel group;
- online EPLB: per-step expert counts into a sliding window; on schedule the group's window (summed
  over ranks) is re-planned with the migration-aware planner and the moved expert weights cross the EP
  group between two steps (requests stay in flight; no token changes, replicas hold the same bits);
- failure rule: any exception in a step (a dead peer's closed connection, a collective timing out after
  ``timeout_s``, or a local error) fails every in-flight request of this rank with an error naming the
  rank and the cause, the group is torn down (so peers fail fast too) and later requests fail at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.distributed.ep import ExpertParallel, StepSync
from deepinfer_core.distributed.groups import ParallelGroups, shutdown
from deepinfer_core.distributed.placement import (
    Replan,
    plan_group,
    plan_placement,
    replan_ep,
)
from deepinfer_core.engine import EngineConfig, LLMEngine, RequestOutput
from deepinfer_core.engine.outputs import ERROR
from deepinfer_core.envs import Envs
from deepinfer_core.eplb import DECODE, PREFILL, EPLBConfig, ExpertPlacement, moe_lb
from deepinfer_core.scheduler import DistributedVote, EngineType

log = logging.getLogger(__name__)


class GroupFailedError(RuntimeError):
    """The instance's group failed; ``outputs`` holds this rank's outputs, the failed ones included."""

    def __init__(self, msg: str, outputs: list[RequestOutput]) -> None:
        super().__init__(msg)
        self.outputs = outputs


@attrs.frozen(kw_only=True)
class DistConfig:
    """What the distributed wrapper adds to an :class:`EngineConfig`.

    ``eplb``: window / re-plan interval / redundant replicas (None: :data:`~deepinfer_core.eplb.PREFILL`
    for a PROMPT engine, :data:`~deepinfer_core.eplb.DECODE` otherwise, i.e. re-plan every 1,000 /
    10,000 steps); ``online_eplb`` False keeps the first placement. ``tolerance``: the migration-aware
    planner's allowed balance loss. ``initial_load``: load [layers, experts] the first placement is
    planned on (a restarted group passes the failed group's window), or ``initial_placement`` itself.
    ``engram_sharded``: Engram tables by rows over the engram group (else every rank holds them whole).
    ``moves_per_step``: None moves a re-plan's weights at once, between two steps; an int spreads them
    over the following steps, that many moves after each step, staged while the old placement serves,
    then switched (:mod:`deepinfer_core.distributed.migrate`; a re-plan falling due meanwhile is skipped).
    ``engine_type``: NORMAL, or one side of a P/D pair (:mod:`deepinfer_core.distributed.pd`): a PROMPT
    instance leaves its hand-offs in ``DistributedEngine.handoffs`` (``pd_mode`` "full" / "replay"), a
    COMPLETION instance takes them with ``add_handoff`` (``replay``: "exact" / "bounded").
    """

    eplb: EPLBConfig | None = None
    online_eplb: bool = True
    tolerance: float = 0.01
    initial_load: Any = None
    initial_placement: ExpertPlacement | None = None
    engram_sharded: bool = True
    move_batch_size: int = 32
    moves_per_step: int | None = None
    engine_type: EngineType = EngineType.NORMAL
    pd_mode: str = "full"
    replay: str = "exact"

    def __attrs_post_init__(self) -> None:
        if self.eplb is not None and not isinstance(self.eplb, EPLBConfig):
            raise ValueError(f"DistConfig.eplb: {self.eplb!r} must be an eplb.EPLBConfig or None")
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < 1):
            raise ValueError(f"DistConfig.tolerance: {self.tolerance!r} must be a float in [0, 1)")
        if (
            isinstance(self.move_batch_size, bool)
            or not isinstance(self.move_batch_size, int)
            or self.move_batch_size < 1
        ):
            raise ValueError(f"DistConfig.move_batch_size: {self.move_batch_size!r} must be an int >= 1")
        if self.moves_per_step is not None and (
            isinstance(self.moves_per_step, bool)
            or not isinstance(self.moves_per_step, int)
            or self.moves_per_step < 1
        ):
            raise ValueError(
                f"DistConfig.moves_per_step: {self.moves_per_step!r} must be None or an int >= 1"
            )
        if not isinstance(self.engine_type, EngineType):
            raise ValueError(f"DistConfig.engine_type: {self.engine_type!r} must be a scheduler.EngineType")
        if self.pd_mode not in ("full", "replay"):
            raise ValueError(f"DistConfig.pd_mode: {self.pd_mode!r} must be 'full' or 'replay'")

    def eplb_config(self) -> EPLBConfig:
        if self.eplb is not None:
            return self.eplb
        return PREFILL if self.engine_type is EngineType.PROMPT else DECODE


class _CountingVote:
    """The DP vote, counted per step and remembering a failed collective (the engine's step catches
    exceptions to fail a batch; the wrapper must still learn that the group broke)."""

    def __init__(self, inner: DistributedVote) -> None:
        self.inner, self.calls = inner, 0
        self.broken: BaseException | None = None

    def decide(self, has_prefill: bool, has_decode: bool) -> tuple[bool, bool, bool]:
        self.calls += 1
        try:
            return self.inner.decide(has_prefill, has_decode)
        except Exception as e:
            self.broken = e
            raise


class _CollectiveExecutor:
    """The engine's executor, each call that runs the model (``execute``, ``replay_encoder``: the prefix
    cache's encoder replay) bracketed by the lock-step rounds. ``execute`` validates first, so a refused
    batch raises before any collective and the engine's retry stays in step; ``replay_encoder`` refuses
    bad input before it computes, and then finishes the opened forward as a dummy one."""

    def __init__(self, inner: Any, sync: StepSync, ep: ExpertParallel, dummy: Any) -> None:
        self._inner, self._sync, self._ep, self._dummy = inner, sync, ep, dummy
        self.forwards = 0
        self.broken: BaseException | None = None

    def replay_encoder(self, *args: Any, **kw: Any) -> Any:
        from deepinfer_core.model import BatchError

        try:
            self._sync.begin_forward()
            try:
                out = self._inner.replay_encoder(*args, **kw)
            except BatchError:  # refused before computing: complete the forward the others are in
                self._dummy()
                raise
            self._ep.drain()
        except BatchError:
            raise
        except Exception as e:  # see _CountingVote.broken
            self.broken = e
            raise
        self.forwards += 1
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, batch: Any) -> Any:
        self._inner.validate(batch)
        try:
            self._sync.begin_forward()
            out = self._inner.execute(batch)
            self._ep.drain()
        except Exception as e:  # see _CountingVote.broken
            self.broken = e
            raise
        self.forwards += 1
        return out


class DistributedEngine:
    """One rank of a DP-attention / EP-MoE instance (see the module docstring).

    Every rank of the instance calls :meth:`step` the same number of times (``generate`` does): each
    step is one vote and one lock-step exchange, so ranks with no requests keep stepping while others
    have work. ``config.batch_invariant`` True gives each request the tokens a single-process engine in
    batch-invariant mode gives it.
    """

    def __init__(
        self,
        groups: ParallelGroups,
        config: EngineConfig | None = None,
        dist_config: DistConfig | None = None,
        *,
        envs: Envs | None = None,
    ) -> None:
        self.groups = g = groups
        self.dist_config = dc = dist_config if dist_config is not None else DistConfig()
        cfg = config if config is not None else EngineConfig()
        if cfg.speculative:
            raise ValueError(
                "EngineConfig.speculative: not supported by DistributedEngine yet (docs/distributed.md)"
            )
        self.engine = eng = LLMEngine(cfg, envs=envs)
        mc = eng.model_config
        self._vote = _CountingVote(DistributedVote(g.dp, g.device))
        self._install_vote()
        self.eplb_config = dc.eplb_config()
        placement = dc.initial_placement
        if placement is None:
            placement = plan_placement(
                mc.num_hidden_layers, mc.n_routed_experts, g.group_size, self.eplb_config, dc.initial_load
            )
        self.ep = ExpertParallel(eng.model, g.ep, placement, g.device)
        self.engram_tables: dict[int, Any] = {}
        if dc.engram_sharded and mc.engram_layer_ids:
            from deepinfer_core.model.engram_context import make_engram_tables

            self.engram_tables = make_engram_tables(eng.model, "sharded", g.engram)
            eng.executor.engram_tables = self.engram_tables
        self._engram_order = [lid for lid in mc.engram_layer_ids if lid in self.engram_tables]
        self.sync = StepSync(g.dp, g.device, self._dummy_forward)
        inner = eng.executor
        # the EP layer synchronises with the host (split sizes) and runs collectives: no CUDA-graph capture,
        # no sync-free decode path on the cuda backend (both are off on the CPU anyway)
        for flag in ("cuda_graphs", "sync_free"):
            if getattr(inner, flag, False):
                setattr(inner, flag, False)
                log.info("rank %d: executor %s off under expert parallelism", g.rank, flag)
        self.executor = _CollectiveExecutor(inner, self.sync, self.ep, self._dummy_forward)
        eng.executor = self.executor
        # helpers the engine built around its executor (the prefix cache's encoder-only calls) must go
        # through the proxy too, or their MoE all-to-alls would skip the lock-step rounds
        for helper in list(vars(eng).values()):
            if getattr(helper, "ex", None) is inner:
                helper.ex = self.executor
        self.pd: Any = None  # the P/D side wrapping the engine (PROMPT / COMPLETION instances)
        self.handoffs: list[Any] = []  # PROMPT instance: requests handed over, for the caller to take
        if dc.engine_type is not EngineType.NORMAL:
            from deepinfer_core.distributed.pd import CompletionEngine, PromptEngine

            if dc.engine_type is EngineType.PROMPT:
                self.pd = PromptEngine(mode=dc.pd_mode, replay=dc.replay, engine=eng)
            else:
                self.pd = CompletionEngine(replay=dc.replay, engine=eng)
            self._install_vote()
        from deepinfer_core.eplb.stats import ExpertLoadWindow

        self.window = ExpertLoadWindow(
            mc.num_hidden_layers, mc.n_routed_experts, self.eplb_config.window_steps
        )
        self.replans: list[Replan] = []
        self._migration: Any = None  # a StagedMigration in flight
        self.steps = 0
        self.failed: str | None = None
        self._late: list[RequestOutput] = []  # requests added after a failure
        self._group_busy = True
        log.info(
            "rank %d: DistributedEngine, EP %d x %d slots/rank, engram %s, EPLB %s",
            g.rank,
            g.group_size,
            placement.slots_per_gpu,
            "sharded" if self.engram_tables else "replicated",
            self.eplb_config if dc.online_eplb else "off",
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None) -> None:
        if self.failed is not None:
            self._late.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=(),
                    finish_reason=ERROR,
                    error=self.failed,
                )
            )
            return
        if self.pd is not None and not hasattr(self.pd, "add_request"):
            raise ValueError("add_request: a COMPLETION instance takes hand-offs (add_handoff), not prompts")
        (self.pd if self.pd is not None else self.engine).add_request(request_id, prompt, params)

    def has_unfinished(self) -> bool:
        """Whether this rank must keep stepping: some rank of the group had work after the last step."""
        if self.failed is not None:
            return bool(self._late)
        return self._group_busy or self._local_busy()

    def _local_busy(self) -> bool:
        return self.pd.has_unfinished() if self.pd is not None else self.engine.has_unfinished()

    def add_handoff(self, h: Any) -> None:
        """COMPLETION instance: queue a request handed over by a PROMPT engine (see ``pd``)."""
        if self.pd is None or not hasattr(self.pd, "add_handoff"):
            raise ValueError("add_handoff: this instance is not a COMPLETION engine (DistConfig.engine_type)")
        self.pd.add_handoff(h)

    @property
    def placement(self) -> ExpertPlacement:
        return self.ep.placement

    # ------------------------------------------------------------------ the step
    def _dummy_forward(self) -> None:
        empty = torch.zeros(0, dtype=torch.int64)
        for lid in self._engram_order:  # the order model.engram_rows fetches in
            self.engram_tables[lid].fetch(empty)
        self.ep.drain()

    def step(self) -> list[RequestOutput]:
        """One group step (collective: every rank of the instance calls it)."""
        if self.failed is not None:
            late, self._late = self._late, []
            return late
        out: list[RequestOutput] = []
        try:
            self._install_vote()
            self._vote.calls = 0
            if self.dist_config.engine_type is EngineType.PROMPT:
                out, ready = self.pd.step()
                self.handoffs += ready
            elif self.pd is not None:
                out = self.pd.step()
            else:
                out = self.engine.step()
            broken = self._vote.broken or self.executor.broken
            if broken is not None:  # the engine caught it (failing a batch); the group is gone anyway
                raise broken
            if self._vote.calls == 0:  # nothing queued here: the group still needs this rank's vote
                self._vote.decide(False, False)
            self._group_busy = self.sync.end_step(self._local_busy())
            self.steps += 1
            self._eplb_step()
        except Exception as e:  # a dead / stuck peer, or a local failure: the whole group is gone
            return self._fail(e, out)
        return out

    def _install_vote(self) -> None:
        """The DP vote as the scheduler's ``vote`` (again after an engine ``reset`` rebuilt it)."""
        s = self.engine.scheduler
        s = getattr(s, "_inner", s)  # under a P/D proxy: the scheduler itself
        if s.vote is not self._vote:
            s.vote = self._vote
            if hasattr(s, "_local"):  # the scheduler caches "is the vote local?" when it is built
                s._local = False

    def _eplb_step(self) -> None:
        self.window.record(self.ep.take_step_counts())
        mig = self._migration
        if mig is not None:  # a staged migration in flight: one more batch after this step
            mig.advance()
            if mig.done:
                mig.commit()
                r = self.replans[-1]
                r.commit_step, r.batches, r.bytes_sent = self.steps, mig.batches, mig.bytes_sent
                self._migration = None
            return
        cfg = self.eplb_config
        s, w = self.window.steps_recorded, cfg.window_steps
        if not self.dist_config.online_eplb or s < w or (s - w) % cfg.replan_interval:
            return
        t0 = time.perf_counter()
        old = self.ep.placement
        g, dc = self.groups, self.dist_config
        if dc.moves_per_step is None:
            plan, rep, load_np = replan_ep(
                self.ep,
                self.window.load(),
                g.ep,
                g.device,
                tolerance=dc.tolerance,
                batch_size=dc.move_batch_size,
            )
            sent, commit = rep.bytes_sent, self.steps
        else:
            from deepinfer_core.distributed.migrate import StagedMigration

            plan, load_np = plan_group(self.ep, self.window.load(), g.ep, g.device, tolerance=dc.tolerance)
            self._migration = StagedMigration(self.ep, plan.moves, plan.placement, g.ep, dc.moves_per_step)
            sent, commit = 0, -1
        r = Replan(
            step=self.steps,
            live_requests=self.engine.scheduler.num_live,
            moves=len(plan.moves),
            remote_moves=plan.moves.num_remote,
            bytes_sent=sent,
            moe_lb_before=moe_lb(load_np, old),
            moe_lb_after=moe_lb(load_np, plan.placement),
            seconds=time.perf_counter() - t0,
            commit_step=commit,
        )
        self.replans.append(r)
        log.info(
            "rank %d: EPLB re-plan at step %d: %d moves (%d remote), moe_lb %.4f -> %.4f%s",
            g.rank,
            r.step,
            r.moves,
            r.remote_moves,
            r.moe_lb_before,
            r.moe_lb_after,
            "" if dc.moves_per_step is None else f", staged {dc.moves_per_step} moves per step",
        )

    def window_load(self) -> np.ndarray:
        """This rank's expert load window [layers, experts] (a restarted group sums the survivors')."""
        return self.window.load()

    def _fail(self, e: BaseException, done: list[RequestOutput]) -> list[RequestOutput]:
        """Fail every live request of this rank (and those the engine failed in this step) with one
        message naming the rank and the cause; tear the group down."""
        g = self.groups
        self.failed = (
            f"distributed group failed (rank {g.rank} of instance {g.instance}, {g.group_size} ranks, "
            f"collective timeout {g.timeout_s:g}s): {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        )
        log.error("%s; failing %d in-flight requests", self.failed, self.engine.num_live)
        outs = [
            attrs.evolve(o, error=self.failed, finish_reason=ERROR) if o.error is not None else o
            for o in done
        ]
        outs += self.engine.reset(self.failed)
        shutdown()  # peers' collectives then fail at once instead of waiting for their timeout
        return outs

    # ------------------------------------------------------------------ offline API
    def generate(
        self, prompts: Sequence[Any], params: Any = None, *, scatter: bool = True
    ) -> list[RequestOutput]:
        """Serve ``prompts`` over the instance (collective).

        ``scatter`` True: every rank passes the same full list; rank r serves items r, r + size, ...
        and every rank gets all outputs back in input order. False: each rank passes its own requests
        and gets its own outputs. Raises :class:`GroupFailedError` (with this rank's outputs) when the
        group fails.
        """
        if self.pd is not None:
            raise ValueError(
                "generate: a PROMPT / COMPLETION instance is driven with add_request / add_handoff "
                "and step() (hand-offs in .handoffs); generate serves NORMAL instances"
            )
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
        g = self.groups
        mine = [i for i in range(len(prompts)) if not scatter or i % g.group_size == g.group_rank]
        for i in mine:
            self.add_request(str(i), prompts[i], plist[i])
        done: dict[str, RequestOutput] = {}
        self._group_busy = True
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
        local = [done[str(i)] for i in mine]
        if self.failed is not None:
            raise GroupFailedError(self.failed, local)
        if not scatter:
            return local
        parts: list[Any] = [None] * g.group_size
        dist.all_gather_object(parts, {i: o for i, o in zip(mine, local)}, group=g.dp)
        merged = {i: o for part in parts for i, o in part.items()}
        return [merged[i] for i in range(len(prompts))]
