"""``LLMEngine``: the step loop wiring the components through their public APIs.

One step: ``Scheduler.schedule()`` -> a ``ForwardBatch`` built from the plan's arrays (placeholders filled
from each sequence's last sampled token, state slots from the ``StatePool``) -> ``ModelExecutor.execute``
-> grammar bitmask (``StructuredOutputManager`` + ``apply_token_bitmask``) -> ``sample`` (counter-based
RNG keyed by request seed and position) -> ``Scheduler.update`` -> finished requests become
``RequestOutput`` s. With ``async_scheduling`` the next plan is made before the previous step's tokens
are applied (one step ahead), exactly as the scheduler's contract allows; with ``async_overlap`` (the
default) the next step is also launched before the previous step's tokens are read, its placeholder
inputs fed from them on the device (engine/overlap.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from deepinfer_core.engine import sizing
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.output_builder import OutputBuilder
from deepinfer_core.engine.outputs import ABORT, ERROR, LENGTH, STOP, RequestOutput
from deepinfer_core.engine.overlap import PendingStep
from deepinfer_core.engine.parallel_sampling import SampleGroups
from deepinfer_core.engine.prefix import make_prefix_caching
from deepinfer_core.engine.requests import (
    EngineRequest,
    RequestError,
    SeqTable,
    derived_seed,
    normalize_params,
    normalize_prompt,
)
from deepinfer_core.engine.run import StepRunner
from deepinfer_core.engine.sample import RowSampler
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.engine.structured_spec import VerifyMasks
from deepinfer_core.envs import Envs, get_envs
from deepinfer_core.kv import PagedKVPool, StatePool
from deepinfer_core.model import (
    DeepSeekV41,
    ModelExecutor,
)
from deepinfer_core.model.checkpoint import load_model
from deepinfer_core.sampling_params import RequestOutputKind
from deepinfer_core.scheduler import (
    FinishedRequest,
    FinishReason,
    Plan,
    PreemptionPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
)
from deepinfer_core.spec import make_policy
from deepinfer_core.tokenizer import ByteTokenizer
from deepinfer_kernels import get_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_REASONS = {FinishReason.STOP: STOP, FinishReason.LENGTH: LENGTH, FinishReason.ABORT: ABORT,
            FinishReason.FAILED: ERROR}


@attrs.define
class StepStats:
    """Cumulative wall time per stage (seconds) and counts; the benchmark reads the ratios."""

    steps: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0
    execute_s: float = 0.0
    sample_s: float = 0.0  # mask + sample + grammar advance
    update_s: float = 0.0
    tokens_sampled: int = 0
    verify_rows: int = 0  # decode rows that verified drafts
    overlap_steps: int = 0  # launched before the previous step's tokens were read (engine/overlap.py)
    host_wait_steps: int = 0  # async steps that waited for the previous tokens first (structured rows, host Engram)
    land_wait_s: float = 0.0  # host time blocked on a step's tokens after the next one was launched


class LLMEngine(StepRunner, RowSampler):
    """The reference engine: the tiny model on one rank, requests in, ``RequestOutput`` s out.

    ``add_request`` never raises for a bad request: the request fails alone and its ``RequestOutput``
    (with ``error`` naming the field) comes out of the next ``step``. ``envs`` defaults to
    :func:`deepinfer_core.envs.get_envs`, read once here.

    Threads: every public method takes the engine's lock, so a server's front end may call
    ``add_request`` / ``abort`` from its threads while one loop calls ``step`` (a call waits for the step
    in progress). Recovery: an unexpected error inside a step fails the requests of that step's batch
    (their outputs carry the error) and the engine keeps serving the rest; ``abort_all`` ends every live
    request and ``reset`` rebuilds the scheduler and pools (docs/engine.md).
    """

    def __init__(self, config: EngineConfig | None = None, *, envs: Envs | None = None,
                 model: DeepSeekV41 | None = None, num_threads: int | None = 1) -> None:
        """``model``: a prebuilt model (its own config) instead of the tiny one drawn from ``seed``: a
        test hook (e.g. a drafter built to copy the target); it must match ``dtype`` / ``backend``.

        ``num_threads``: torch's CPU threads, as ``LLM``'s default (1): the reference model is
        dispatch-bound, and on a shared machine torch's default (every core) ran the step API 3-50x slower
        than ``LLM`` did. Torch's setting is process-wide and the step API has no call to restore it
        after, so the engine sets it when built and again at a ``step`` that finds it changed; None
        leaves torch's setting alone (``LLM`` passes None and sets it around its own calls)."""
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1, or None (torch's setting)")
        self.num_threads = num_threads
        if num_threads is not None and torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        self.config = cfg = config if config is not None else EngineConfig()
        self.envs = envs if envs is not None else get_envs()
        self.batch_invariant = self.envs.batch_invariant if cfg.batch_invariant is None else cfg.batch_invariant
        self.backend = get_backend(cfg.backend)
        self.device = self.backend.device
        if model is None:  # "tiny" (shipped checkpoint), "tiny-random" (weights from seed) or a directory
            model, self.tokenizer = load_model(cfg.model, seed=cfg.seed, dtype=_DTYPES[cfg.dtype], device=self.device)
        else:
            self.tokenizer = ByteTokenizer(model.cfg.vocab_size)
        self.model_config = model.cfg
        self.vocab_size = self.model_config.vocab_size
        self.model = model
        self.num_speculative_tokens = self._spec_tokens()
        self.drafts: DraftBook | None = None
        if self.num_speculative_tokens > 0:
            self.drafts = DraftBook(make_policy(self.envs.enable_mtp_varlen, self.num_speculative_tokens),
                                    self.num_speculative_tokens)
        self._lock = threading.RLock()
        self.config = cfg = self._sized(cfg)  # num_blocks / max_num_seqs left None: from the device's memory
        self.executor = self._make_executor(cfg.num_blocks, cfg.max_num_seqs)
        for switch in ("fused_attention", "fused_moe", "fused_head"):  # unset: the executor's default
            if (on := getattr(self.envs, switch)) is not None:
                setattr(self.executor, switch, on and self.executor.sync_free)
        self._build_scheduler()
        self._sample = self.backend.op("sample")
        self._apply_mask = self.backend.op("apply_token_bitmask")
        self._grammar: Any = None  # StructuredOutputManager, built on the first constrained request
        self._serial = 0
        self._failed: list[RequestOutput] = []  # failed before reaching the scheduler
        # streamed outputs (engine/output_builder.py): what each step returns, per request
        self.output_builder = OutputBuilder(self._token_bytes)
        self.groups = SampleGroups(self)  # parallel sampling (SamplingParams.n)
        self._clear_tables()
        self.stats = StepStats()
        # the asynchronous overlap (engine/overlap.py): on with async scheduling unless the executor must
        # read every step's tokens on the host before the next (drafts: synchronous scheduling anyway)
        self._overlap = self.scheduler.config.async_mode and cfg.async_overlap
        self._feed_ok: dict[Any, bool] = {}  # execute function -> takes a feed (_takes_feed)
        if self._overlap and not self.executor.token_feed_ok:
            log.info("engine: async overlap off: the executor hashes Engram n-grams from host tokens (tables "
                     "placed %r); every step waits for the previous step's tokens", self.executor.engram_placement)
            self._overlap = False
        if self.drafts is not None:
            log.info("engine: speculative decoding, up to %d drafts per request (%s), synchronous scheduling",
                     self.num_speculative_tokens, type(self.drafts.policy).__name__)
        log.info("engine: tiny model (seed %d, %s, quantize=%s) on %s, pool %d x %d, max_num_seqs %d, async=%s, "
                 "batch_invariant=%s", cfg.seed, cfg.dtype, cfg.quantize, self.device, cfg.num_blocks,
                 cfg.block_size, cfg.max_num_seqs, cfg.async_scheduling, self.batch_invariant)

    def _make_executor(self, num_blocks: int, num_slots: int) -> ModelExecutor:
        cfg = self.config
        return ModelExecutor(self.model, num_blocks, cfg.block_size, num_slots,
                             backtrack_tokens=self.envs.max_backtracking_tokens, quantize=cfg.quantize,
                             backend=self.backend if cfg.backend == "cuda" else None,
                             cuda_graphs=self.envs.cuda_graphs, fuse_glue=self.envs.fuse_glue,
                             draft_context=self.num_speculative_tokens > 0)

    def _sized(self, cfg: EngineConfig) -> EngineConfig:
        """``cfg`` with the pool's sizes (engine/sizing.py): on the GPU from the memory left after the weights,
        the per-block / per-slot bytes from two small probe executors' own accounting."""
        on_gpu = self.device.type == "cuda"

        def memory() -> tuple[int, int]:
            torch.cuda.synchronize(self.device)
            return torch.cuda.mem_get_info(self.device)

        cfg, _ = sizing.resolve(cfg, on_gpu=on_gpu, cost=lambda: sizing.probe_cache_bytes(self._make_executor),
                                memory=memory, hidden_size=self.model_config.hidden_size,
                                dtype_bytes=next(self.model.parameters()).element_size())
        return cfg

    def _build_scheduler(self) -> None:
        """Fresh pools and scheduler (at start, and by ``reset``)."""
        cfg = self.config
        self.kv_pool = PagedKVPool(cfg.num_blocks, cfg.block_size)
        self.state_pool = StatePool(cfg.max_num_seqs)
        self.scheduler = Scheduler(self.kv_pool, SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, eos_token_id=self.tokenizer.eos_token_id,
            # a verify row's next position depends on how many drafts are accepted, so with drafts the
            # engine plans each step after the previous one's tokens are applied (see docs/engine.md)
            async_mode=cfg.async_scheduling and self.drafts is None,
            preemption_policy=PreemptionPolicy[cfg.preemption_policy.upper()]))
        self.prefix = make_prefix_caching(self)  # prefix caching + SWA bounded replay (docs/swa.md)

    def _clear_tables(self) -> None:
        """Empty per-request tables (at start, and by ``reset``)."""
        self._reqs: dict[str, EngineRequest] = {}
        self._by_seq: dict[int, EngineRequest] = {}
        self._seqs = SeqTable()
        self._compiling: list[str] = []  # constrained requests whose grammar is still compiling
        self._inflight: tuple[Plan, Any] | None = None
        self._to_abort: list[str] = []  # ended by the engine in a step; aborted after its update
        self._idle_steps = 0
        self._stops: dict[str, StopStrings] = {}  # requests with stop strings (engine/stops.py)
        self._verify_masks: VerifyMasks | None = None  # this step's grammar masks of verify rows
        self.groups.held.clear()  # n > 1 samples not queued yet (engine/parallel_sampling.py)

    def _spec_tokens(self) -> int:
        cfg = self.config
        if not cfg.speculative:
            return 0
        n = self.envs.use_nextn_decode if cfg.num_speculative_tokens is None else cfg.num_speculative_tokens
        if self.model.drafter is None:
            raise ValueError("EngineConfig.speculative: the model has no DSpark drafter (num_nextn_predict_layers = 0)")
        block = self.model.drafter.block
        if n > block:
            raise ValueError(f"EngineConfig.num_speculative_tokens: {n} must be <= {block} (the drafter's block)")
        if n > self.envs.max_backtracking_tokens:
            raise ValueError(f"EngineConfig.num_speculative_tokens: {n} must be <= DEEPINFER_MAX_BACKTRACKING_TOKENS="
                             f"{self.envs.max_backtracking_tokens} (rejected drafts are rolled back)")
        return n

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None, *,
                    output_kind: RequestOutputKind | None = None) -> None:
        """Queue a request; a bad one fails alone (its output, with ``error``, comes from ``step``).

        ``output_kind`` overrides ``params.output_kind`` (``LLM.generate`` asks for FINAL_ONLY). Raises
        only for the caller's own bookkeeping errors: a ``request_id`` that is not a non-empty str, or one
        that is already live."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
        with self._lock:
            if self.is_live(request_id):
                raise ValueError(f"request_id={request_id!r}: already live")
            text = prompt if isinstance(prompt, str) else None
            try:
                text, ids = normalize_prompt(prompt, self.tokenizer)
                sp = normalize_params(params, self.vocab_size)
                if len(ids) >= self.config.max_model_len:
                    raise RequestError(f"prompt_token_ids: {len(ids)} tokens; must be < max_model_len="
                                       f"{self.config.max_model_len} (prompts are never truncated)")
                if sp.max_tokens is None:  # vLLM's rule: as many as the context leaves
                    sp = attrs.evolve(sp, max_tokens=self.config.max_model_len - len(ids))
            except RequestError as e:
                self._fail_early(request_id, text if isinstance(text, str) else None, (), str(e))
                return
            except Exception as e:  # a hostile value must fail its request, not the caller
                self._fail_early(request_id, None, (), f"prompt / sampling_params: {type(e).__name__}: {e}")
                return
            if sp.n > 1:
                self.groups.add(request_id, text, ids, sp, output_kind)
                return
            self.output_builder.add(request_id, text, ids, sp, output_kind)
            self._add_one(EngineRequest(request_id, text, ids, sp))

    def _add_one(self, req: EngineRequest) -> None:
        """A validated request to its stop strings, its grammar (compiling) or the scheduler."""
        request_id, sp = req.request_id, req.params
        self._reqs[request_id] = req
        if sp.stop:
            self._stops[request_id] = StopStrings(sp.stop, self._token_bytes(), include=sp.include_stop_str_in_output,
                                                  min_tokens=sp.min_tokens)
        if sp.so_args is not None:
            try:
                self._grammar_manager().add_request(request_id, sp.so_args)
            except ImportError as e:
                # a MissingExtraError already names the extra to install (deepinfer_core.extras)
                hint = "" if "deepinfer-components[" in str(e) else \
                    " (install the structured extra: pip install \"deepinfer-components[structured]\")"
                self._drop_early(req, f"SamplingParams.so_args: {e}{hint}")
                return
            except RecursionError:
                self._drop_early(req, "SamplingParams.so_args: nested too deeply to compile")
                return
            except Exception as e:  # the library's own message, as the request's error
                msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                self._drop_early(req, f"SamplingParams.so_args: {msg}")
                return
            req.structured = True
            self._compiling.append(request_id)  # queued once its grammar has compiled
            return
        self._queue(req)

    def abort(self, request_id: str) -> bool:
        """End a live request; it is reported (finish_reason "abort") by a later ``step``. Its state slot
        and KV blocks are returned at once (the scheduler may admit a waiting request in the next step)."""
        with self._lock:
            if self.output_builder.is_group(request_id):  # n > 1: every sample
                return self.groups.abort(request_id)
            req = self._reqs.get(request_id)
            if req is None:
                return False
            if req.seq < 0:  # still compiling its grammar
                self._compiling.remove(request_id)
                self._drop_early(req, None, ABORT)
                return True
            return self._end(req)

    def abort_all(self) -> int:
        """Abort every live request (reported by the next ``step`` s); returns how many. Afterwards every
        KV block and state slot is free."""
        with self._lock:
            held = sum(self.abort(rid) for rid in list(self.groups.held))  # n > 1: their held samples too
            return held + sum(self.abort(rid) for rid in list(self._reqs))

    def reset(self, reason: str = "engine reset") -> list[RequestOutput]:
        """Fail every live request with ``error=reason`` and rebuild the scheduler and pools from scratch:
        the way back from a state that a failed step could not repair. Returns the failed requests'
        outputs (and any not yet collected)."""
        with self._lock:
            out, self._failed = self._failed, []
            for req in list(self._reqs.values()):
                out.append(RequestOutput(request_id=req.request_id, prompt=req.prompt,
                                         prompt_token_ids=req.prompt_token_ids, finish_reason=ERROR, error=reason))
                if req.structured and self._grammar is not None:
                    self._grammar.remove_request(req.request_id)
            if self.drafts is not None:
                self.drafts.clear()
            out += self.groups.fail_held(reason)
            self._build_scheduler()
            self.executor.resolve_fed(drop=True)  # an in-flight step's tokens are never read
            self._clear_tables()
            log.warning("engine reset (%s): %d live requests failed", reason, len(out))
            out = self.output_builder.collect(out, lambda rid: None, lambda rid: ())
            self.output_builder.clear()
            return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._failed or self._compiling or self.groups.held or self.scheduler.has_unfinished())

    def is_live(self, request_id: str) -> bool:
        """Added and not yet reported by ``step``."""
        with self._lock:
            return (request_id in self._reqs or self.output_builder.is_group(request_id)
                    or any(o.request_id == request_id for o in self._failed))

    def hand_back(self, outputs: list[RequestOutput]) -> None:
        """Outputs taken out of ``step`` by a caller they do not belong to (``LLM.generate`` stepping an
        engine that another thread also feeds): the next ``step`` returns them."""
        if outputs:
            with self._lock:
                self._failed.extend(outputs)

    @property
    def num_live(self) -> int:
        """Requests added and not yet reported by ``step``."""
        return len(self._reqs) + len(self._failed) + self.groups.num_held

    def _grammar_manager(self) -> Any:
        if self._grammar is None:
            from deepinfer_core.structured import StructuredOutputManager, make_backend

            self._grammar = StructuredOutputManager(make_backend(self.config.structured_backend, self.tokenizer,
                                                                 vocab_size=self.vocab_size))
        return self._grammar

    def _fail_early(self, rid: str, text: str | None, ids: tuple[int, ...], msg: str | None,
                    reason: str = ERROR) -> None:
        if msg is not None:
            log.warning("request %r failed: %s", rid, msg)
        self._failed.append(RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids, finish_reason=reason,
                                          error=msg))

    def _token_bytes(self) -> list[bytes]:
        if getattr(self, "_tok_bytes", None) is None:
            self._tok_bytes = list(self.tokenizer.token_bytes())
        return self._tok_bytes

    def _drop_early(self, req: EngineRequest, msg: str | None, reason: str = ERROR) -> None:
        del self._reqs[req.request_id]
        self._stops.pop(req.request_id, None)
        if req.structured and self._grammar is not None:
            self._grammar.remove_request(req.request_id)
        self._fail_early(req.request_id, req.prompt, req.prompt_token_ids, msg, reason)

    def _queue(self, req: EngineRequest) -> None:
        """Hand a request to the scheduler (which checks lengths and pool fit)."""
        try:
            self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.params))
        except (ValueError, TypeError, OverflowError) as e:
            self._drop_early(req, str(e).replace(f"request {req.request_id!r}: ", ""))
            return
        req.seq = self.scheduler.seq_id(req.request_id)
        sp = req.params
        seed = sp.seed if sp.seed is not None else derived_seed(self.config.seed, self._serial)
        self._serial += 1
        self._seqs.add(req.seq, sp, seed, req.structured)
        self._by_seq[req.seq] = req

    def _admit_compiled(self) -> None:
        """Queue constrained requests whose grammar is ready; fail those whose grammar did not compile."""
        if not self._compiling:
            return
        g = self._grammar
        # nothing else to run: wait a little for a compile instead of spinning
        ready = g.ready(self._compiling) if self.scheduler.has_unfinished() else g.wait(self._compiling, 0.05)
        for rid in ready:
            self._compiling.remove(rid)
            req = self._reqs[rid]
            if g.finish_reason(rid) is not None:
                self._drop_early(req, f"SamplingParams.so_args: invalid grammar: {g.error(rid)}",
                                 str(g.finish_reason(rid)))
            else:
                self._queue(req)

    def _end(self, req: EngineRequest, reason: str | None = None, error: str | None = None) -> bool:
        """End a queued or running request from the engine's side: its later rows are dropped, its state
        slot and drafts are returned now (before the scheduler can give its seat to a waiting request),
        and the scheduler frees its blocks and reports it at the next ``update``."""
        if reason is not None:
            req.reason, req.error = reason, error
        self._release(req.seq)
        return self.scheduler.abort(req.request_id)

    def _release(self, seq: int) -> None:
        """No more rows of ``seq`` will run: mark it dead and return its state slot and drafts."""
        self._seqs.dead[self._seqs.row(seq)] = True
        if self.state_pool.contains(seq):
            self.state_pool.release(seq)
        if self.drafts is not None:
            self.drafts.drop(seq)
        if self.prefix is not None:
            self.prefix.drop(seq)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return a ``RequestOutput`` for every request that produced tokens in it
        and every request that ended (finished, failed, aborted) in it, as its ``output_kind`` asks
        (engine/output_builder.py; ``finished`` marks a request's last output).

        Never raises for a request's fault: an unexpected error inside the step fails the requests of
        this step's batch (``error`` says what happened) and the engine serves the rest; if even that is
        impossible the engine ``reset`` s itself and fails every live request."""
        with self._lock:
            if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
                torch.set_num_threads(self.num_threads)
            try:
                finals = self._step()
            except Exception as e:  # the engine must outlive a failed step
                log.exception("engine: step failed; the engine resets")
                return self.reset(f"engine step failed and the engine was reset: {type(e).__name__}: {e}")
            return self.output_builder.collect(finals, self._live_info, self.scheduler.output_token_ids)

    def _live_info(self, rid: str) -> tuple[int, int | None] | None:
        """(output tokens in the scheduler, stop-string token cap) of a live request (the builder's truth)."""
        req = self._reqs.get(rid)
        if req is None or req.seq < 0:
            return None
        try:
            n = self.scheduler.request_info(rid)["output_len"]
        except (KeyError, ValueError):  # ended in the scheduler, reported at the next update
            return None
        stops = self._stops.get(rid)
        return n, (stops.hit.tokens if stops is not None and stops.hit is not None else None)

    def _step(self) -> list[RequestOutput]:
        self._admit_compiled()
        if self.groups.held:
            self.groups.admit_held()
        out, self._failed = self._failed, []
        sched, st = self.scheduler, self.stats
        if not sched.has_unfinished():
            return out
        t0 = time.perf_counter()
        ask = self.drafts.ask(self._by_seq) if self.drafts is not None else None
        plan = sched.schedule() if ask is None else sched.schedule(draft_seq_ids=ask[0], draft_counts=ask[1])
        st.schedule_s += time.perf_counter() - t0
        prev, self._inflight = self._inflight, None
        # overlap: this step launches before the in-flight one lands, unless it needs a host token value
        overlap = self._overlap and plan.num_rows > 0 and self._takes_feed() and not self._needs_host_tokens(plan)
        if prev is not None and not (overlap and isinstance(prev[1], PendingStep)):
            # async: apply the previous step's tokens after planning this one (and before running it)
            if overlap is False and plan.num_rows and isinstance(prev[1], PendingStep):
                st.host_wait_steps += 1
            out += self._update(prev[0], self._land_step(*prev))
            prev = None
        if plan.num_rows == 0:
            out += self._update(plan, np.zeros(0, np.int32))
            self._idle_steps += 1
            if self._idle_steps > 1000:
                raise RuntimeError("engine: 1000 idle steps in a row with requests pending (scheduler stuck)")
            return out
        self._idle_steps = 0
        pend = prev[1] if prev is not None else None
        try:
            sampled = self._run(plan, pend, overlap)
        except Exception as e:  # fail this batch's requests, keep the engine
            log.exception("engine: step %d failed; its batch's requests fail", plan.step_id)
            sampled = self._fail_plan(plan, f"engine step failed: {type(e).__name__}: {e}")
        st.steps += 1
        st.overlap_steps += isinstance(sampled, PendingStep) and prev is not None
        st.verify_rows += int((plan.num_drafts > 0).sum())
        if prev is not None:  # this step is queued behind the previous one: now read that one's tokens
            t0 = time.perf_counter()
            toks = self._land_step(*prev)
            st.land_wait_s += time.perf_counter() - t0
            out += self._update(prev[0], toks)
        if self.scheduler.config.async_mode:
            self._inflight = (plan, sampled)
        else:
            assert not isinstance(sampled, PendingStep)  # the overlap's pending steps exist in async mode only
            out += self._update(plan, sampled)
        return out

    def _fail_plan(self, plan: Plan, msg: str) -> np.ndarray:
        """End every live request with a row in ``plan`` (error ``msg``); the tokens to ``update`` it with."""
        for seq in np.unique(plan.seq_ids).tolist():
            req = self._by_seq.get(int(seq))
            if req is not None and req.reason is None:
                self._end(req, ERROR, msg)
        return np.full(plan.num_rows, -1, np.int32)

    def _update(self, plan: Plan, sampled: np.ndarray | tuple[np.ndarray, np.ndarray]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        ended = self.scheduler.update(plan, *sampled) if isinstance(sampled, tuple) else self.scheduler.update(plan, sampled)
        self.output_builder.note(plan, sampled, self._rid_of_seq)
        outs = [self._finish(fr) for fr in ended]
        # the engine's own ends (a grammar that accepted its end under ignore_eos) take effect once the
        # token that ended them is applied
        for rid in self._to_abort:
            req = self._reqs.get(rid)
            if req is not None:
                self._end(req)
        self._to_abort.clear()
        self.stats.update_s += time.perf_counter() - t0
        return outs

    def _rid_of_seq(self, seq: int) -> str | None:
        req = self._by_seq.get(seq)
        return None if req is None else req.request_id

    def _finish(self, fr: FinishedRequest) -> RequestOutput:
        req = self._reqs.pop(fr.request_id)
        seq = req.seq
        self._release(seq)
        self._seqs.remove(seq)
        del self._by_seq[seq]
        metrics: dict[str, Any] = {}
        if req.structured:
            try:
                metrics = self._grammar.metrics(req.request_id)  # e.g. which grammar engine served it
            except Exception:  # never lose the output over its metrics
                log.exception("request %r: grammar metrics unavailable", req.request_id)
            self._grammar.remove_request(req.request_id)
        stops = self._stops.pop(req.request_id, None)
        hit = stops.hit if stops is not None else None
        reason = req.reason if req.reason is not None else _REASONS.get(fr.finish_reason, ERROR)
        error = req.error
        if fr.finish_reason is FinishReason.FAILED and error is None:
            error = "the sampler returned no valid token for this request"
        if error is not None:
            log.warning("request %r failed: %s", req.request_id, error)
        ids = fr.output_token_ids
        cached, replayed = self.prefix.take_metrics(seq) if self.prefix is not None else (0, 0)
        metrics.update(arrival_time=req.arrival, last_token_time=time.monotonic(), num_generated_tokens=len(fr.output_token_ids))
        if self.drafts is not None:
            metrics.update(drafts_verified=req.drafts_verified, drafts_accepted=req.drafts_accepted)
        text = None
        if hit is not None and stops is not None:  # the text ends at the stop string (vLLM's rule)
            ids, text = ids[: hit.tokens], stops.text()
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             text=self.tokenizer.decode(ids) if text is None else text, token_ids=ids,
                             finish_reason=reason, error=error, num_preemptions=fr.num_preemptions, cached_tokens=cached, replayed_tokens=replayed,
                             stop_reason=hit.stop if hit is not None else None, metrics=metrics)

    def _fail_row(self, seq: int, msg: str) -> None:
        """End a running request from inside a step (its later rows are dropped)."""
        self._end(self._by_seq[seq], ERROR, msg)
