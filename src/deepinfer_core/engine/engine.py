"""``LLMEngine``: the step loop wiring the components through their public APIs.

One step: ``Scheduler.schedule()`` -> a ``ForwardBatch`` built from the plan's arrays (placeholders filled
from each sequence's last sampled token, state slots from the ``StatePool``) -> ``ModelExecutor.execute``
-> grammar bitmask (``StructuredOutputManager`` + ``apply_token_bitmask``) -> ``sample`` (counter-based
RNG keyed by request seed and position) -> ``Scheduler.update`` -> finished requests become
``RequestOutput`` s. With ``async_scheduling`` the next plan is made before the previous step's tokens
are applied (one step ahead), exactly as the scheduler's contract allows.
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

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.outputs import ABORT, ERROR, LENGTH, STOP, RequestOutput
from deepinfer_core.engine.prefix import known_tokens, make_prefix_caching
from deepinfer_core.engine.requests import (
    EngineRequest,
    RequestError,
    SeqTable,
    derived_seed,
    normalize_params,
    normalize_prompt,
)
from deepinfer_core.engine.speculative import DraftBook
from deepinfer_core.engine.stops import StopStrings
from deepinfer_core.engine.structured_spec import VerifyMasks
from deepinfer_core.envs import Envs, get_envs
from deepinfer_core.kv import PagedKVPool, StatePool
from deepinfer_core.model import (
    BatchError,
    DeepSeekV41,
    ForwardBatch,
    ForwardOutput,
    ModelExecutor,
)
from deepinfer_core.model.checkpoint import load_model
from deepinfer_core.scheduler import (
    FinishedRequest,
    FinishReason,
    Plan,
    PreemptionPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
    StepType,
)
from deepinfer_core.spec import make_policy
from deepinfer_core.tokenizer import ByteTokenizer
from deepinfer_kernels import get_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
VIOLATION = "grammar_violation"  # structured.FinishReason.VIOLATION: the document check failed
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
    """

    def __init__(self, config: EngineConfig | None = None, *, envs: Envs | None = None,
                 model: DeepSeekV41 | None = None) -> None:
        """``model``: a prebuilt model (its own config) instead of the tiny one drawn from ``seed``: a
        test hook (e.g. a drafter built to copy the target); it must match ``dtype`` / ``backend``."""
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
        self.executor = ModelExecutor(self.model, cfg.num_blocks, cfg.block_size, cfg.max_num_seqs,
                                      backtrack_tokens=self.envs.max_backtracking_tokens, quantize=cfg.quantize,
                                      backend=self.backend if cfg.backend == "cuda" else None,
                                      cuda_graphs=self.envs.cuda_graphs)
        self._build_scheduler()
        self._sample = self.backend.op("sample")
        self._apply_mask = self.backend.op("apply_token_bitmask")
        self._grammar: Any = None  # StructuredOutputManager, built on the first constrained request
        self._serial = 0
        self._failed: list[RequestOutput] = []  # failed before reaching the scheduler
        self._clear_tables()
        self.stats = StepStats()
        if self.drafts is not None:
            log.info("engine: speculative decoding, up to %d drafts per request (%s), synchronous scheduling",
                     self.num_speculative_tokens, type(self.drafts.policy).__name__)
        log.info("engine: tiny model (seed %d, %s, quantize=%s) on %s, pool %d x %d, max_num_seqs %d, async=%s, "
                 "batch_invariant=%s", cfg.seed, cfg.dtype, cfg.quantize, self.device, cfg.num_blocks,
                 cfg.block_size, cfg.max_num_seqs, cfg.async_scheduling, self.batch_invariant)

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
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None) -> None:
        """Queue a request; a bad one fails alone (its output, with ``error``, comes from ``step``).

        Raises only for the caller's own bookkeeping errors: a ``request_id`` that is not a non-empty str,
        or one that is already live."""
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
            req = EngineRequest(request_id, text, ids, sp)
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
            return sum(self.abort(rid) for rid in list(self._reqs))

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
            self._build_scheduler()
            self._clear_tables()
            log.warning("engine reset (%s): %d live requests failed", reason, len(out))
            return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._failed or self._compiling or self.scheduler.has_unfinished())

    def is_live(self, request_id: str) -> bool:
        """Added and not yet reported by ``step``."""
        with self._lock:
            return request_id in self._reqs or any(o.request_id == request_id for o in self._failed)

    def hand_back(self, outputs: list[RequestOutput]) -> None:
        """Outputs taken out of ``step`` by a caller they do not belong to (``LLM.generate`` stepping an
        engine that another thread also feeds): the next ``step`` returns them."""
        if outputs:
            with self._lock:
                self._failed.extend(outputs)

    @property
    def num_live(self) -> int:
        """Requests added and not yet reported by ``step``."""
        return len(self._reqs) + len(self._failed)

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
        """Run one engine step; return the requests that finished (or failed) in it.

        Never raises for a request's fault: an unexpected error inside the step fails the requests of
        this step's batch (``error`` says what happened) and the engine serves the rest; if even that is
        impossible the engine ``reset`` s itself and fails every live request."""
        with self._lock:
            try:
                return self._step()
            except Exception as e:  # the engine must outlive a failed step
                log.exception("engine: step failed; the engine resets")
                return self.reset(f"engine step failed and the engine was reset: {type(e).__name__}: {e}")

    def _step(self) -> list[RequestOutput]:
        self._admit_compiled()
        out, self._failed = self._failed, []
        sched, st = self.scheduler, self.stats
        if not sched.has_unfinished():
            return out
        t0 = time.perf_counter()
        ask = self.drafts.ask(self._by_seq) if self.drafts is not None else None
        plan = sched.schedule() if ask is None else sched.schedule(draft_seq_ids=ask[0], draft_counts=ask[1])
        st.schedule_s += time.perf_counter() - t0
        if self._inflight is not None:  # async: apply the previous step's tokens after planning this one
            prev, self._inflight = self._inflight, None
            out += self._update(*prev)
        if plan.num_rows == 0:
            out += self._update(plan, np.zeros(0, np.int32))
            self._idle_steps += 1
            if self._idle_steps > 1000:
                raise RuntimeError("engine: 1000 idle steps in a row with requests pending (scheduler stuck)")
            return out
        self._idle_steps = 0
        try:
            sampled = self._run(plan)
        except Exception as e:  # fail this batch's requests, keep the engine
            log.exception("engine: step %d failed; its batch's requests fail", plan.step_id)
            sampled = self._fail_plan(plan, f"engine step failed: {type(e).__name__}: {e}")
        st.steps += 1
        st.verify_rows += int((plan.num_drafts > 0).sum())
        if self.scheduler.config.async_mode:
            self._inflight = (plan, sampled)
        else:
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

    # ------------------------------------------------------------------ build, execute, sample
    def _run(self, plan: Plan) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Execute ``plan`` and sample. Returns one token per plan row (0 for rows that sample nothing),
        or with speculation (flat tokens, count per row): a verify row yields its accepted drafts and
        the executor's next token."""
        st, seqs, book = self.stats, self._seqs, self.drafts
        t0 = time.perf_counter()
        for rid in plan.preempted:  # its caches restart at position 0 when it is admitted again
            seq = self._reqs[rid].seq if rid in self._reqs else -1
            if seq >= 0 and self.state_pool.contains(seq):
                self.state_pool.release(seq)
            if seq >= 0 and book is not None:
                book.drop(seq)  # the executor forgets its drafts when the slot restarts
            if seq >= 0 and self.prefix is not None:
                self.prefix.drop(seq)  # it re-hits its own prefix when it is admitted again
        seq_ids = plan.seq_ids
        ix = seqs.ix(seq_ids)  # each row's place in the per-sequence arrays
        ntok = plan.num_tokens.astype(np.int64)
        tokens = plan.token_ids.astype(np.int64)
        if book is not None:
            book.fill(plan, tokens, seq_ids)
        hole = tokens < 0
        if hole.any():  # one step ahead: the token the previous step sampled for that sequence
            tokens[hole] = seqs.last_token[np.repeat(ix, ntok)[hole]]
        # only a sequence's first chunk (an admission: new, or recomputed after preemption; it starts
        # after its shared prefix hit) needs a slot; every later row holds one already, so this is no
        # per-row loop in decode steps
        for r in np.flatnonzero((plan.cached >= 0) & ~seqs.dead[ix]).tolist():
            seq = int(seq_ids[r])
            if not self.state_pool.contains(seq) and self.state_pool.acquire(seq) is None:
                # cannot happen while slots are returned before seats (see _end); fail it alone if it does
                log.error("engine: no free state slot for seq %d (%d slots)", seq, self.state_pool.num_slots)
                self._fail_row(seq, f"no free state slot ({self.state_pool.num_slots} slots)")
        rows = np.flatnonzero(~seqs.dead[ix])  # rows of requests that already ended are discarded
        pre = None  # prefix caching: hit tokens skipped, encoder-only parts run, the tail's decoder floor
        if self.prefix is not None and rows.size:
            pre = self.prefix.prepare(plan.step_type == StepType.PREFILL, rows, seq_ids, plan.start, ntok, tokens,
                                      plan.block_tables, self.state_pool.slots, lambda q: known_tokens(self, q),
                                      plan.cached)
            for seq, msg in pre.failed:
                self._fail_row(seq, msg)
            rows = pre.rows
        sampled = np.zeros(plan.num_rows, np.int32)
        nd = plan.num_drafts.astype(np.int64)
        # rows whose token comes from the executor (greedy verify / draft); the rest sample here
        spec_row = (plan.sample > 0) & (DraftBook.eligible(seqs, ix) if book is not None else False)
        got: dict[int, list[int]] = {}
        while rows.size:
            tok_keep = np.repeat(np.isin(np.arange(plan.num_rows), rows), ntok)
            qn, qs = (ntok, plan.start) if pre is None else (pre.ntok, pre.start)
            spec_kw: dict[str, Any] = {}
            if pre is not None:
                tok_keep &= pre.tok_mask
                spec_kw.update(decoder_floor=pre.floor[rows], snapshot_pos=pre.snap[rows])
            if book is not None:
                spec_kw.update(verify_lens=nd[rows], draft=spec_row[rows],
                               temperature=np.where(spec_row[rows], seqs.temperature[ix[rows]], 0.0))
                self._spec_masks(plan, rows, spec_row, tokens, ntok, ix)
            batch = ForwardBatch(token_ids=tokens[tok_keep], query_lens=qn[rows], start_pos=qs[rows],
                                 block_tables=plan.block_tables[rows], state_slots=self.state_pool.slots(seq_ids[rows]),
                                 num_logits=plan.sample[rows] + nd[rows], **spec_kw)
            st.build_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            try:
                logits, spec_out = self._execute(batch)
            except BatchError as e:  # one bad request: fail it, rerun the others (nothing was written)
                self._spec_masks_off()
                if e.request is None:
                    raise
                self._fail_row(int(seq_ids[rows[e.request]]), f"executor refused the request: {e}")
                rows = np.delete(rows, e.request)
                continue
            self._spec_masks_off()
            st.execute_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            last = np.cumsum(batch.num_logits) - 1  # each request's last logits row
            plain = np.flatnonzero((plan.sample[rows] > 0) & ~spec_row[rows])
            srows = rows[plain]
            sampled[srows] = self._sample_rows(logits[torch.as_tensor(last[plain], device=logits.device)],
                                               seq_ids[srows], ix[srows], plan.context_lens[srows].astype(np.int64))
            if book is not None:
                got = self._collect(plan, rows, spec_row, spec_out, tokens, ntok, ix)
            if pre is not None:  # publish completed exact blocks and the encoder rings at their end
                first = tokens[np.concatenate(([0], np.cumsum(ntok)[:-1]))]
                self.prefix.after(pre, rows, seq_ids, plan.block_tables, self._snapshots,
                                  lambda q: known_tokens(self, q), first)
            st.sample_s += time.perf_counter() - t0
            break
        if book is None:
            return sampled
        flat: list[int] = []
        counts = np.zeros(plan.num_rows, np.int32)
        for i in range(plan.num_rows):
            if i in got:
                flat += got[i]
                counts[i] = len(got[i])
            elif plan.sample[i]:  # sampled here, or a dropped row (its request ended: the token is ignored)
                flat.append(int(sampled[i]))
                counts[i] = 1
        return np.asarray(flat, np.int32), counts

    def _spec_masks(self, plan: Plan, rows: np.ndarray, spec_row: np.ndarray, tokens: np.ndarray,
                    ntok: np.ndarray, ix: np.ndarray) -> None:
        """Before the executor verifies: grammar masks for structured spec rows, and every spec row's seed
        (verification keyed by (seed, position)); engine/structured_spec.py, SpecState.counter_seeds."""
        spec = self.executor.spec
        self._verify_masks = None
        self._spec_masks_off()  # nothing of an earlier step's (e.g. one that raised) may stay
        if spec is None:
            return
        sr = rows[spec_row[rows]]
        if sr.size == 0:
            return
        slots = self.state_pool.slots(plan.seq_ids[sr])
        spec.counter_seeds = {int(sl): int(self._seqs.seed[ix[i]]) for sl, i in zip(slots.tolist(), sr.tolist())}
        con = [(int(sl), int(i)) for sl, i in zip(slots.tolist(), sr.tolist()) if self._seqs.structured[ix[i]]]
        if not con:
            return
        ends = np.cumsum(ntok)
        items = []
        for sl, i in con:
            k = int(plan.num_drafts[i])
            items.append((sl, self._by_seq[int(plan.seq_ids[i])].request_id, tokens[ends[i] - k : ends[i]].tolist()))
        vm = VerifyMasks(self._grammar, self._apply_mask)
        vm.build(items)
        for rid in vm.dead:
            req = self._reqs[rid]
            req.reason, req.error = str(self._grammar.finish_reason(rid)), "grammar dead end: no token can continue"
        self._verify_masks = vm
        spec.logits_hook = vm.hook

    def _spec_masks_off(self) -> None:
        spec = self.executor.spec
        if spec is not None:
            spec.logits_hook = None
            spec.counter_seeds = None

    def _collect(self, plan: Plan, rows: np.ndarray, spec_row: np.ndarray, out: dict[str, np.ndarray],
                 tokens: np.ndarray, ntok: np.ndarray, ix: np.ndarray) -> dict[int, list[int]]:
        """Executor-verified rows: [accepted drafts..., next token] per plan row; keep the new drafts."""
        book, seqs = self.drafts, self._seqs
        assert book is not None
        ends = np.cumsum(ntok)
        got: dict[int, list[int]] = {}
        for j, i in enumerate(rows.tolist()):
            if not spec_row[i]:
                continue
            k, a, seq = int(plan.num_drafts[i]), int(out["num_accepted"][j]), int(plan.seq_ids[i])
            row = [*tokens[ends[i] - k : ends[i] - k + a].tolist(), int(out["next_token"][j])]
            req = self._by_seq[seq]
            if self._verify_masks is not None and req.request_id in self._verify_masks.dead:
                row = [-1]  # the grammar allows no token: the scheduler fails the request (reason set)
                seqs.dead[ix[i]] = True
            elif seqs.structured[ix[i]]:
                self._grammar_commit(req, int(ix[i]), row)
            if row[-1] >= 0:
                self._feed_stops(req, int(ix[i]), row)
            got[i] = row
            book.verified += k
            book.accepted += a
            book.store(seq, out["drafts"][j], out["draft_confidence"][j])
            seqs.last_token[ix[i]] = row[-1]
            seqs.n_out[ix[i]] += len(row)
            self.stats.tokens_sampled += len(row)
        return got

    def _execute(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Logits of the sampled rows, request by request, and the DSpark outputs (numpy; empty when
        nothing drafts or verifies)."""
        if not self.batch_invariant or batch.num_requests == 1:
            outs = [self.executor.execute(batch)]
        else:
            # batch-invariant mode: every request alone, so no kernel's reduction order depends on the batch
            self.executor.validate(batch)  # refuse before any cache is written, as a batched call would
            off = batch.offsets
            outs = []
            for i in range(batch.num_requests):
                sl = slice(i, i + 1)
                opt = {n: None if getattr(batch, n) is None else getattr(batch, n)[sl]
                       for n in ("verify_lens", "draft", "temperature", "decoder_floor", "snapshot_pos")}
                one = ForwardBatch(token_ids=batch.token_ids[off[i]:off[i + 1]], query_lens=batch.query_lens[sl],
                                   start_pos=batch.start_pos[sl], block_tables=batch.block_tables[sl],
                                   state_slots=batch.state_slots[sl], num_logits=batch.num_logits[sl], **opt)
                outs.append(self.executor.execute(one))
        logits = outs[0].logits if len(outs) == 1 else torch.cat([o.logits for o in outs])
        self._snapshots = (outs[0].snapshots if len(outs) == 1
                           else {i: o.snapshots[0] for i, o in enumerate(outs) if o.snapshots})
        spec: dict[str, np.ndarray] = {}
        if self.drafts is not None:
            for name in ("num_accepted", "next_token", "drafts", "draft_confidence"):
                parts = [_spec_field(o, name, batch.num_requests if len(outs) == 1 else 1) for o in outs]
                spec[name] = np.concatenate(parts)
        return logits, spec

    def _sample_rows(self, logits: torch.Tensor, seq: np.ndarray, ix: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Mask (min_tokens, grammar) and sample one token per logits row; advance the grammars.
        ``seq``: the rows' seq ids; ``ix``: their places in the per-sequence arrays."""
        s, dev = self._seqs, logits.device
        n = seq.shape[0]
        if n == 0:
            return np.zeros(0, np.int32)
        early = np.flatnonzero(s.n_out[ix] < s.min_tokens[ix])
        for r in early.tolist():  # EOS and stop tokens may not end the text before min_tokens
            req = self._by_seq[int(seq[r])]
            ban = [] if req.params.ignore_eos else [self.tokenizer.eos_token_id]
            logits[r, ban + list(req.params.stop_token_ids)] = float("-inf")
        con = np.flatnonzero(s.structured[ix])
        failed = np.zeros(n, bool)  # rows whose grammar raised: they fail alone
        dead_end = np.zeros(0, np.int64)
        if con.size:
            full, dead_end = self._grammar_masks(seq, con, n, failed)
            self._apply_mask(logits, full, torch.as_tensor(con))
        tok = self._sample(logits, torch.as_tensor(s.temperature[ix], device=dev),
                           torch.as_tensor(s.top_k[ix], device=dev), torch.as_tensor(s.top_p[ix], device=dev),
                           torch.as_tensor(s.seed[ix], device=dev), torch.as_tensor(positions, device=dev))
        tok = tok.cpu().numpy().astype(np.int64)
        for r in dead_end.tolist():  # the grammar allows no token: the request ends (FAILED -> reason below)
            req = self._by_seq[int(seq[r])]
            req.reason, req.error = str(self._grammar.finish_reason(req.request_id)), "grammar dead end: no token can continue"
            tok[r] = -1  # the scheduler fails the request on a negative token
            s.dead[ix[r]] = True  # a row already planned one step ahead is dropped
        tok[failed] = -1
        s.last_token[ix] = tok
        s.n_out[ix] += 1
        self.stats.tokens_sampled += n
        for r in con.tolist():
            t = int(tok[r])
            if t < 0:
                continue
            req = self._by_seq[int(seq[r])]
            g = self._grammar
            try:
                g.advance(req.request_id, [t])
                why = g.finish_reason(req.request_id)
            except Exception as e:  # a grammar library error fails that request alone
                req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
                tok[r] = -1
                s.dead[ix[r]] = True
                continue
            if why is None:
                continue
            s.dead[ix[r]] = True  # the grammar is done: a row already planned one step ahead is dropped
            # the grammar accepted its end: EOS was sampled, which the scheduler stops on unless
            # ignore_eos; then the engine ends it itself once this token is applied
            if req.params.ignore_eos or str(why) != STOP:
                req.reason = str(why)
                if str(why) == VIOLATION:  # the document check failed: say what it found
                    req.error = f"SamplingParams.so_args: {g.error(req.request_id)}"
                elif str(why) != STOP:
                    lib = g.error(req.request_id)  # the library's own message, when it failed itself
                    req.error = f"grammar: {why}" if not lib else f"SamplingParams.so_args: grammar library error: {lib}"
                    if lib:
                        req.reason = ERROR
                self._to_abort.append(req.request_id)
        if self._stops:
            for r in range(n):
                if tok[r] >= 0:
                    self._feed_stops(self._by_seq[int(seq[r])], int(ix[r]), [int(tok[r])])
        return tok.astype(np.int32)

    def _feed_stops(self, req: EngineRequest, ixr: int, toks: list[int]) -> None:
        """Stop strings (engine/stops.py): a match ends the request once these tokens are applied."""
        stops = self._stops.get(req.request_id)
        if stops is None or stops.hit is not None or req.reason is not None:  # already ending otherwise
            return
        if stops.feed(toks) is not None:
            req.reason = STOP
            self._seqs.dead[ixr] = True  # a row already planned one step ahead is dropped
            self._to_abort.append(req.request_id)

    def _grammar_commit(self, req: EngineRequest, ixr: int, toks: list[int]) -> bool:
        """A verify row's tokens into the request's grammar (as ``_sample_rows`` does for one token);
        False when the request ended here."""
        g = self._grammar
        try:
            g.advance(req.request_id, toks)
            why = g.finish_reason(req.request_id)
        except Exception as e:  # a grammar library error fails that request alone
            self._seqs.dead[ixr] = True
            req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
            self._to_abort.append(req.request_id)
            return False
        if why is None:
            return True
        self._seqs.dead[ixr] = True
        if req.params.ignore_eos or str(why) != STOP:
            req.reason = str(why)
            if str(why) != STOP:
                lib = g.error(req.request_id)
                req.error = f"SamplingParams.so_args: {lib}" if lib else f"grammar: {why}"
            self._to_abort.append(req.request_id)
        return False

    def _grammar_masks(self, seq: np.ndarray, con: np.ndarray, n: int,
                       failed: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Bitmask rows for the constrained rows ``con`` (others allow all) and the dead-end rows. The
        batch is filled in one call; if the library raises, row by row, so only the failing requests
        fail (marked in ``failed``, their rows allow nothing)."""
        g = self._grammar
        rids = [self._by_seq[int(q)].request_id for q in seq[con]]
        try:
            masks = g.fill_bitmask([(rid, ()) for rid in rids])
            full = torch.full((n, masks.bitmask.shape[1]), -1, dtype=torch.int32)
            full[torch.as_tensor(con)] = masks.bitmask
            return full, con[masks.dead_end]
        except Exception:  # find the request(s) at fault
            log.exception("engine: grammar fill failed for a batch of %d; retrying request by request", len(rids))
        full = torch.full((n, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        dead: list[int] = []
        for r, rid in zip(con.tolist(), rids):
            try:
                m = g.fill_bitmask([(rid, ())])
            except Exception as e:
                req = self._reqs[rid]
                req.reason, req.error = ERROR, f"SamplingParams.so_args: grammar library error: {e}"
                self._seqs.dead[self._seqs.row(req.seq)] = True
                failed[r] = True
                full[r] = 0
                continue
            full[r] = m.bitmask[0]
            if m.dead_end[0]:
                dead.append(r)
        return full, np.asarray(dead, np.int64)


def _spec_field(out: ForwardOutput, name: str, r: int) -> np.ndarray:
    """A DSpark output of ``out`` as numpy (filled with "nothing" when no row drafted or verified)."""
    v = getattr(out, name)
    if v is not None:
        return v.detach().cpu().numpy()
    if name in ("drafts", "draft_confidence"):
        return np.full((r, 5), -1 if name == "drafts" else np.nan)
    return np.full(r, 0 if name == "num_accepted" else -1)
