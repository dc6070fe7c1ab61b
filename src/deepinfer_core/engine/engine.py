"""``LLMEngine``: the step loop wiring the components through their public APIs.

One step (``LLMEngine.step``), each stage owned by one object:

1. schedule: ``Scheduler.schedule()`` (the ``DraftBook``'s verify lengths asked first);
2. land the previous step when this one cannot be launched behind it (the ``StepOrder``: sync, async or
   overlap, chosen once at construction, engine/step_order.py);
3. run: ``StepRunner.run`` builds the ``ForwardBatch`` from the plan's arrays (placeholders filled from each
   sequence's last sampled token, state slots from the ``StatePool``), calls ``ModelExecutor.execute`` and
   has the ``TokenSampler`` mask (grammar bitmask, min_tokens bans) and sample (counter-based RNG keyed by
   request seed and position); with the overlap the tokens stay on the device;
4. land: the ``StepOrder`` hands back the steps whose tokens are applied now (``StepRunner.land``);
5. update: ``Scheduler.update``; the ``OutputBuilder`` notes each streamed request's new tokens, the
   ``RequestTable`` retires the finished requests and the ``OutputBuilder`` builds their final outputs;
6. outputs: ``OutputBuilder.collect`` turns the step into one ``RequestOutput`` per request that produced
   tokens or ended, as its ``output_kind`` asks (streamed, engine/output_builder.py).

With ``async_scheduling`` the next plan is made before the previous step's tokens are applied (one step
ahead), exactly as the scheduler's contract allows; with ``async_overlap`` (the default) the next step is
also launched before the previous step's tokens are read, its placeholder inputs fed from them on the
device (engine/overlap.py). docs/architecture.md ("The engine's step") draws the stages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from deepinfer_core.engine import sizing
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.grammar import Grammars
from deepinfer_core.engine.output_builder import OutputBuilder
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.engine.overlap import Launched, StepTokens
from deepinfer_core.engine.parallel_sampling import SampleGroups
from deepinfer_core.engine.prefix import PrefixCaching, make_prefix_caching
from deepinfer_core.engine.request_table import RequestTable
from deepinfer_core.engine.requests import EngineRequest, RequestError, normalize_params, normalize_prompt
from deepinfer_core.engine.run import StepRunner
from deepinfer_core.engine.sample import TokenSampler
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stats import StepStats
from deepinfer_core.engine.step_order import StepOrder, choose_mode, make_step_order
from deepinfer_core.envs import Envs, get_envs
from deepinfer_core.kv import PagedKVPool, StatePool
from deepinfer_core.model import DeepSeekV41, ModelExecutor
from deepinfer_core.model.checkpoint import load_model
from deepinfer_core.sampling_params import RequestOutputKind
from deepinfer_core.scheduler import Plan, PreemptionPolicy, Scheduler, SchedulerConfig
from deepinfer_core.spec import make_policy
from deepinfer_core.tokenizer import ByteTokenizer
from deepinfer_kernels import get_backend

if TYPE_CHECKING:
    from deepinfer_core.kvstore.guard import StoreGuard

__all__ = ["LLMEngine", "StepStats"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _checked_threads(num_threads: int | None) -> int | None:
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1, or None (torch's setting)")
    return num_threads


class LLMEngine:
    """The reference engine: the tiny model on one rank, requests in, ``RequestOutput`` s out.

    ``add_request`` never raises for a bad request: the request fails alone and its ``RequestOutput``
    (with ``error`` naming the field) comes out of the next ``step``. ``envs`` defaults to
    :func:`deepinfer_core.envs.get_envs`, read once here.

    Threads: every public method takes the engine's lock, so a server's front end may call
    ``add_request`` / ``abort`` from its threads while one loop calls ``step`` (a call waits for the step
    in progress). Recovery: an unexpected error inside a step fails the requests of that step's batch
    (their outputs carry the error) and the engine keeps serving the rest; ``abort_all`` ends every live
    request and ``reset`` rebuilds the scheduler and pools (docs/engine.md).

    Owned collaborators (docs/architecture.md, "The engine's step"): ``requests`` (``RequestTable``: the
    live requests and the one way one ends), ``sampler`` (``TokenSampler``), ``runner`` (``StepRunner``),
    ``order`` (``StepOrder``: sync / async / overlap), ``outputs`` (``OutputBuilder``: final and streamed
    outputs), ``groups`` (``SampleGroups``: n > 1) and ``grammars`` (the lazily built grammar manager).
    ``reset`` rebuilds the pools, the scheduler and the per-run collaborators; the executor, the grammar
    manager, the output builder, the KV store's guard and ``stats`` outlive it. ``AsyncLLM`` (async_llm.py)
    and ``LLM`` (llm.py) run on top of ``add_request`` / ``step``.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        envs: Envs | None = None,
        model: DeepSeekV41 | None = None,
        num_threads: int | None = 1,
    ) -> None:
        """``model``: a prebuilt model (its own config) instead of the tiny one drawn from ``seed``: a
        test hook (e.g. a drafter built to copy the target); it must match ``dtype`` / ``backend``.

        ``num_threads``: torch's CPU threads, as ``LLM``'s default (1): the reference model is
        dispatch-bound, and on a shared machine torch's default (every core) ran the step API 3-50x slower
        than ``LLM`` did. Torch's setting is process-wide and the step API has no call to restore it
        after, so the engine sets it when built and again at a ``step`` that finds it changed; None
        leaves torch's setting alone (``LLM`` passes None and sets it around its own calls)."""
        self.num_threads = _checked_threads(num_threads)
        self._pin_threads()
        self.config = cfg = config if config is not None else EngineConfig()
        self.envs = envs if envs is not None else get_envs()
        self.batch_invariant = (
            self.envs.batch_invariant if cfg.batch_invariant is None else cfg.batch_invariant
        )
        self.backend = get_backend(cfg.backend)
        self.device = self.backend.device
        if model is None:  # "tiny" (shipped checkpoint), "tiny-random" (weights from seed) or a directory
            model, self.tokenizer = load_model(
                cfg.model, seed=cfg.seed, dtype=_DTYPES[cfg.dtype], device=self.device
            )
        else:
            self.tokenizer = ByteTokenizer(model.cfg.vocab_size)
        self.model_config = model.cfg
        self.vocab_size = self.model_config.vocab_size
        self.model = model
        self.num_speculative_tokens = self._spec_tokens()
        self.drafts: DraftBook | None = None
        if (k := self.num_speculative_tokens) > 0:
            self.drafts = DraftBook(make_policy(self.envs.enable_mtp_varlen, k), k)
        self._lock = threading.RLock()
        # num_blocks / max_num_seqs left None: from the device's memory (engine/sizing.py), before the executor
        self.config, size = self._sized(cfg)
        self.num_blocks, self.max_num_seqs = size.num_blocks, size.max_num_seqs  # the pool's resolved sizes
        self._executor = self._build_executor()
        self._sample_op = self.backend.op("sample")
        self._apply_mask = self.backend.op("apply_token_bitmask")
        self.grammars = Grammars(cfg.structured_backend, self.tokenizer, self.vocab_size)
        self.outputs = OutputBuilder(self.tokenizer)
        self._kv_store_guard: StoreGuard | None = None  # kept across reset(): so is its breaker's state
        self._stats = StepStats()
        # "sync" / "async" / "overlap": the StepOrder's, fixed here
        self.step_mode = choose_mode(cfg.async_scheduling, cfg.async_overlap, self.drafts, self._executor)
        self._build()
        self._log_start()

    def _log_start(self) -> None:
        cfg = self.config
        log.info(
            "engine: tiny model (seed %d, %s, quantize=%s) on %s, pool %d x %d, max_num_seqs %d, async=%s, "
            "batch_invariant=%s",
            cfg.seed,
            cfg.dtype,
            cfg.quantize,
            self.device,
            self.num_blocks,
            cfg.block_size,
            self.max_num_seqs,
            cfg.async_scheduling,
            self.batch_invariant,
        )

    def _pin_threads(self) -> None:
        """torch's CPU threads to ``num_threads`` (at construction, and at a ``step`` that finds them changed)."""
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _sized(self, cfg: EngineConfig) -> tuple[EngineConfig, sizing.PoolSize]:
        """``cfg`` with the pool's sizes (engine/sizing.py), and those sizes: on the GPU from the memory
        left after the weights, the per-block / per-slot bytes from two small probe executors' own accounting."""

        def memory() -> tuple[int, int]:
            torch.cuda.synchronize(self.device)
            return torch.cuda.mem_get_info(self.device)

        return sizing.resolve(
            cfg,
            on_gpu=self.device.type == "cuda",
            cost=lambda: sizing.probe_cache_bytes(self._make_executor),
            memory=memory,
            hidden_size=self.model_config.hidden_size,
            dtype_bytes=next(self.model.parameters()).element_size(),
        )

    def _make_executor(self, num_blocks: int, num_slots: int) -> ModelExecutor:
        cfg = self.config
        return ModelExecutor(
            self.model,
            num_blocks,
            cfg.block_size,
            num_slots,
            backtrack_tokens=self.envs.max_backtracking_tokens,
            quantize=cfg.quantize,
            backend=self.backend if cfg.backend == "cuda" else None,
            cuda_graphs=self.envs.cuda_graphs,
            fuse_glue=self.envs.fuse_glue,
            draft_context=self.num_speculative_tokens > 0,
        )

    def _build_executor(self) -> ModelExecutor:
        ex = self._make_executor(self.num_blocks, self.max_num_seqs)
        for switch in ("fused_attention", "fused_moe", "fused_head"):  # unset: the executor's default
            if (on := getattr(self.envs, switch)) is not None:
                setattr(ex, switch, on and ex.sync_free)
        return ex

    def _build(self) -> None:
        """Fresh pools, scheduler and per-run collaborators (at start, and by ``reset``)."""
        cfg = self.config
        self.kv_pool = PagedKVPool(self.num_blocks, cfg.block_size)
        self.state_pool = StatePool(self.max_num_seqs)
        self._scheduler = Scheduler(
            self.kv_pool,
            SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                eos_token_id=self.tokenizer.eos_token_id,
                async_mode=self.step_mode != "sync",
                preemption_policy=PreemptionPolicy[cfg.preemption_policy.upper()],
            ),
        )
        # prefix caching + SWA bounded replay (docs/swa.md)
        self.prefix: PrefixCaching | None = make_prefix_caching(
            cfg,
            self.model_config,
            self.kv_pool,
            self._executor,
            self._scheduler,
            keep_default=self.envs.yoco_prefill_keep_tokens,
            pending_drafts=self.num_speculative_tokens,
            guard=self._kv_store_guard,
        )
        if self.prefix is not None and self.prefix.link is not None:
            self._kv_store_guard = self.prefix.link.guard
        self.requests = RequestTable(
            self._scheduler, self.state_pool, self.drafts, self.prefix, self.grammars, self.outputs, cfg.seed
        )
        # n > 1: samples 1..n-1 of a prompt of a block or more wait for sample 0's prefill (prefix caching)
        self.groups = SampleGroups(
            self.requests, self.outputs, hold_min_prompt=cfg.block_size if self.prefix is not None else None
        )
        self.sampler = TokenSampler(
            self.requests, self.grammars, self.tokenizer, self.vocab_size, self._sample_op, self._apply_mask
        )
        self.runner = StepRunner(
            self._executor,
            self.state_pool,
            self.prefix,
            self.drafts,
            self.requests,
            self.sampler,
            self._stats,
            batch_invariant=self.batch_invariant,
            apply_mask=self._apply_mask,
        )
        self.order: StepOrder = make_step_order(self.step_mode, self.runner, self._stats)
        self._idle_steps = 0

    def _spec_tokens(self) -> int:
        cfg = self.config
        if not cfg.speculative:
            return 0
        n = self.envs.use_nextn_decode if cfg.num_speculative_tokens is None else cfg.num_speculative_tokens
        if self.model.drafter is None:
            raise ValueError(
                "EngineConfig.speculative: the model has no DSpark drafter (num_nextn_predict_layers = 0)"
            )
        block = self.model.drafter.block
        if n > block:
            raise ValueError(
                f"EngineConfig.num_speculative_tokens: {n} must be <= {block} (the drafter's block)"
            )
        if n > self.envs.max_backtracking_tokens:
            raise ValueError(
                f"EngineConfig.num_speculative_tokens: {n} must be <= DEEPINFER_MAX_BACKTRACKING_TOKENS="
                f"{self.envs.max_backtracking_tokens} (rejected drafts are rolled back)"
            )
        return n

    # ------------------------------------------------------------------ swappable parts
    # The distributed engines install wrappers over the executor and the scheduler after construction and
    # benchmarks replace ``stats``: each setter hands the new object to the collaborators that hold it.
    @property
    def executor(self) -> ModelExecutor:
        return self._executor

    @executor.setter
    def executor(self, ex: ModelExecutor) -> None:
        self._executor = self.runner.executor = ex

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @scheduler.setter
    def scheduler(self, s: Scheduler) -> None:
        self._scheduler = self.requests.scheduler = s

    @property
    def stats(self) -> StepStats:
        return self._stats

    @stats.setter
    def stats(self, st: StepStats) -> None:
        self._stats = self.runner.stats = self.order.stats = st

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: Any = None,
        *,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Queue a request; a bad one fails alone (its output, with ``error``, comes from ``step``).

        ``output_kind`` overrides ``params.output_kind`` (``LLM.generate`` asks for FINAL_ONLY). Raises
        only for the caller's own bookkeeping errors: a ``request_id`` that is not a non-empty str, or one
        that is already live."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
        with self._lock:
            if self.is_live(request_id):
                raise ValueError(f"request_id={request_id!r}: already live")
            req = self._parse(request_id, prompt, params)
            if req is None:
                return
            if req.params.n > 1:  # its n samples (engine/parallel_sampling.py)
                self.groups.add(req, output_kind)
                return
            self.outputs.add(request_id, req.prompt, req.prompt_token_ids, req.params, output_kind)
            self.requests.add(req)

    def _parse(self, request_id: str, prompt: object, params: Any) -> EngineRequest | None:
        """The engine's record of a valid request; None (its output queued) for an invalid one."""
        text = prompt if isinstance(prompt, str) else None
        try:
            text, ids = normalize_prompt(prompt, self.tokenizer)
            sp = normalize_params(params, self.vocab_size)
            if len(ids) >= self.config.max_model_len:
                raise RequestError(
                    f"prompt_token_ids: {len(ids)} tokens; must be < max_model_len="
                    f"{self.config.max_model_len} (prompts are never truncated)"
                )
            if sp.max_tokens is None:  # vLLM's rule: as many as the context leaves
                sp = attrs.evolve(sp, max_tokens=self.config.max_model_len - len(ids))
        except RequestError as e:
            self.outputs.failed(request_id, text if isinstance(text, str) else None, (), str(e))
            return None
        except Exception as e:  # a hostile value must fail its request, not the caller
            self.outputs.failed(request_id, None, (), f"prompt / sampling_params: {type(e).__name__}: {e}")
            return None
        return EngineRequest(request_id, text, ids, sp)

    def abort(self, request_id: str) -> bool:
        """End a live request; it is reported (finish_reason "abort") by a later ``step``. Its state slot
        and KV blocks are returned at once (the scheduler may admit a waiting request in the next step)."""
        with self._lock:
            if self.outputs.is_group(request_id):  # n > 1: every sample
                return self.groups.abort(request_id)
            req = self.requests.reqs.get(request_id)
            return req is not None and self.requests.end(req)

    def abort_all(self) -> int:
        """Abort every live request (reported by the next ``step`` s); returns how many. Afterwards every
        KV block and state slot is free."""
        with self._lock:
            held = sum(self.abort(rid) for rid in list(self.groups.held))  # n > 1: their held samples too
            return held + sum(self.abort(rid) for rid in list(self.requests.reqs))

    def reset(self, reason: str = "engine reset") -> list[RequestOutput]:
        """Fail every live request with ``error=reason`` and rebuild the scheduler and pools from scratch:
        the way back from a state that a failed step could not repair. Returns the failed requests'
        outputs (and any not yet collected)."""
        with self._lock:
            out = self.outputs.take_ready()
            out += [self.outputs.reset_output(req, reason) for req in self.requests.fail_all(reason)]
            out += self.groups.fail_held(reason)
            if self.drafts is not None:
                self.drafts.clear()
            self._build()
            self._executor.resolve_fed(drop=True)  # an in-flight step's tokens are never read
            log.warning("engine reset (%s): %d live requests failed", reason, len(out))
            out = self.outputs.collect(out, lambda rid: None, lambda rid: ())  # n > 1: grouped back
            self.outputs.clear()
            return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(
                self.outputs.ready
                or self.requests.compiling
                or self.groups.held
                or self.scheduler.has_unfinished()
            )

    def is_live(self, request_id: str) -> bool:
        """Added and not yet reported by ``step``."""
        with self._lock:
            return (
                request_id in self.requests.reqs
                or self.outputs.is_group(request_id)
                or self.outputs.has_ready(request_id)
            )

    def hand_back(self, outputs: list[RequestOutput]) -> None:
        """Outputs taken out of ``step`` by a caller they do not belong to (``LLM.generate`` stepping an
        engine that another thread also feeds): the next ``step`` returns them."""
        if outputs:
            with self._lock:
                self.outputs.ready.extend(outputs)

    @property
    def num_live(self) -> int:
        """Requests added and not yet reported by ``step``."""
        return len(self.requests) + len(self.outputs.ready) + self.groups.num_held

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return a ``RequestOutput`` for every request that produced tokens in it
        and every request that ended (finished, failed, aborted) in it, as its ``output_kind`` asks
        (engine/output_builder.py; ``finished`` marks a request's last output).

        Never raises for a request's fault: an unexpected error inside the step fails the requests of
        this step's batch (``error`` says what happened) and the engine serves the rest; if even that is
        impossible the engine ``reset`` s itself and fails every live request."""
        with self._lock:
            self._pin_threads()
            try:
                finals = self._step()
            except Exception as e:  # the engine must outlive a failed step
                log.exception("engine: step failed; the engine resets")
                return self.reset(f"engine step failed and the engine was reset: {type(e).__name__}: {e}")
            return self.outputs.collect(finals, self.requests.live_info, self.scheduler.output_token_ids)

    def _step(self) -> list[RequestOutput]:
        """The step's final outputs (ended requests'); ``step`` adds the streamed ones."""
        self.requests.admit_compiled()  # constrained requests whose grammar compiled
        self.groups.admit_held()  # n > 1 samples waiting for their first sample's prefill
        out = self.outputs.take_ready()  # requests that failed before reaching the scheduler
        if not self.scheduler.has_unfinished():
            return out
        plan = self._schedule()  # 1. schedule
        # 2. the previous step lands first unless this one overlaps it
        for done in self.order.land_before(plan):
            out += self._update(done)
        if plan.num_rows == 0:
            return out + self._idle(plan)
        prev, overlap = self.order.feed(plan)
        # 3. build, execute, sample (or launch: tokens on the device)
        step = self.runner.run(plan, prev, overlap, self.order.land_early)
        for done in self.order.land_after(step):  # 4. the steps whose tokens are on the host now
            out += self._update(done)  # 5. update the requests, build the finished ones' outputs
        return out

    def _schedule(self) -> Plan:
        t0 = time.perf_counter()
        ask = self.drafts.ask(self.requests.by_seq) if self.drafts is not None else None
        sched = self.scheduler
        plan = sched.schedule() if ask is None else sched.schedule(draft_seq_ids=ask[0], draft_counts=ask[1])
        self._stats.schedule_s += time.perf_counter() - t0
        if plan.num_rows:
            self._idle_steps = 0
        return plan

    def _idle(self, plan: Plan) -> list[RequestOutput]:
        """A plan with no rows (e.g. every request waits for blocks): update it; refuse to spin forever."""
        out = self._update(Launched(plan, StepTokens(np.zeros(0, np.int32))))
        self._idle_steps += 1
        if self._idle_steps > 1000:
            raise RuntimeError("engine: 1000 idle steps in a row with requests pending (scheduler stuck)")
        return out

    def _update(self, done: Launched) -> list[RequestOutput]:
        """Apply a landed step's tokens: the scheduler's update, the streamed requests' new tokens noted
        (their requests still in the table), then the final outputs of the requests that finished, then
        the engine's own ends that waited for this step's tokens."""
        assert done.tokens is not None, "only landed steps are applied"
        t0 = time.perf_counter()
        ended = done.tokens.update(self.scheduler, done.plan)
        self.outputs.note(done.plan, done.tokens.tokens, done.tokens.counts, self.requests.rid_of_seq)
        outs = [self.outputs.finished(fr, self.requests.retire(fr)) for fr in ended]
        self.requests.end_deferred()
        self._stats.update_s += time.perf_counter() - t0
        return outs
