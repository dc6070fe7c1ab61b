"""Prefill / decode disaggregation: a PROMPT engine hands a request's KV to a COMPLETION engine.

:class:`PromptEngine` runs the scheduler as a PROMPT engine: a request's prompt is prefilled, its first
token sampled, and the request leaves with HANDOFF. At that moment (inside the scheduler's ``update``,
before the engine frees the state slot, and before any later plan may reuse the freed blocks) its
:class:`Handoff` is taken: the prompt's block KV (main compressed KV and indexer keys of every source
layer, whole blocks) and the sequence's state block (SWA rings of every layer, compressor accumulators,
the Engram token ring, the slot's end position). :class:`CompletionEngine` runs the scheduler as a
COMPLETION engine: the request arrives as prompt + first token, admission reserves blocks and lists it in
``plan.kv_load_seq_ids``, and the package is written into those blocks and a fresh state slot before
the step runs; decoding then continues at the position the PROMPT engine stopped. Sampling is keyed by
(seed, position), so with batch-invariant mode the tokens (first + the rest) equal a NORMAL engine's.

Transport: in process, pass the object; over torch.distributed, :func:`send_handoff` /
:func:`recv_handoff` (metadata as a pickled object, tensors point to point; gloo or NCCL).

Two modes. ``"full"``: the whole state block is handed, and decoding continues bit for bit. ``"replay"``
(DeepInfer's shape): only the blocks before the *hit* (the prompt trimmed as ``swa.plan_replay`` trims a
prefix hit: whole blocks and compression groups, the tail left to replay) and the persisted half of the
state, the encoder SWA rings at the hit (captured during the prefill with ``snapshot_pos``); the
COMPLETION side restores them (``restore_encoder``), runs the plan's encoder-only prefill and the tail
with truncated decoder windows (``decoder_floor``) up to the last prompt token, then decodes. With
``replay="exact"`` the tail is the decoder's whole dependency span and the tokens equal a NORMAL
engine's (up to summation order); ``"bounded"`` replays ``keep`` tokens (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS,
140), DeepInfer's approximate setting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.engine import EngineConfig, LLMEngine, RequestOutput
from deepinfer_core.engine.outputs import ERROR
from deepinfer_core.engine.requests import derived_seed, normalize_params
from deepinfer_core.model.replay import SLOT_ARRAYS
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import EngineType, FinishReason, Scheduler

MODES = ("full", "replay")

log = logging.getLogger(__name__)

HANDOFF = "handoff"  # RequestOutput.finish_reason of a request the PROMPT engine handed over


@attrs.frozen(eq=False)
class Handoff:
    """One request's state at the end of its prefill (see the module docstring).

    ``num_tokens``: positions with KV (the prompt); ``blocks``: name -> uint8 [prompt blocks, block
    size, bytes]; ``state``: name -> the state block's tensors; ``params``: as given, seed resolved.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    num_tokens: int
    block_size: int
    blocks: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    mode: str = "full"
    hit: int = 0  # replay mode: positions [0, hit) handed as blocks, encoder rings at hit in state["rings"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.blocks.values(), *self.state.values()))


def _state_tensors(ex: Any, slot: int) -> dict[str, torch.Tensor]:
    """Copies of everything the executor keeps per state slot (``ModelExecutor.slot_state``)."""
    return ex.slot_state(slot)


def _load_state(ex: Any, slot: int, state: dict[str, torch.Tensor]) -> None:
    """Put a handed-off slot state into ``slot`` (ValueError naming the fields when they do not match)."""
    ex.load_slot_state(slot, state)


def _block_caches(ex: Any) -> dict[str, torch.Tensor]:
    return {**{f"kv.{k}": v for k, v in ex.kv.items()}, **{f"index.{k}": v for k, v in ex.index_keys.items()}}


def _with_type(engine: LLMEngine, kind: EngineType) -> Scheduler:
    s = engine.scheduler
    return Scheduler(engine.kv_pool, attrs.evolve(s.config, engine_type=kind))


def _check_engine(engine: LLMEngine, who: str) -> None:
    if engine.drafts is not None:
        raise ValueError(f"{who}: EngineConfig.speculative is not supported with P/D hand-off")


class _PromptScheduler:
    """The PROMPT scheduler, its ``update`` taking each HANDOFF's package before the engine frees it."""

    def __init__(self, owner: PromptEngine, inner: Scheduler) -> None:
        self._owner, self._inner = owner, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def update(self, plan: Any, *args: Any) -> Any:
        ended = self._inner.update(plan, *args)
        for fr in ended:
            if fr.finish_reason is FinishReason.HANDOFF:
                self._owner._take(fr)
        return ended


class PromptEngine:
    """A PROMPT (prefill-only) engine: ``step()`` returns (outputs, handoffs).

    Outputs are requests that ended here (their first token stopped them, or they failed); every other
    request comes back as a :class:`Handoff` for a :class:`CompletionEngine`.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        mode: str = "full",
        replay: str = "exact",
        keep: int | None = None,
        engine: LLMEngine | None = None,
        **kw: Any,
    ) -> None:
        """``mode``: "full" hands the whole state block; "replay" hands the blocks before the hit and the
        encoder rings at it, for a COMPLETION engine made with the same ``replay`` / ``keep``.
        ``engine``: wrap this engine (e.g. a ``DistributedEngine``'s) instead of building one."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {list(MODES)}")
        self.engine = eng = engine if engine is not None else LLMEngine(config, **kw)
        _check_engine(eng, "PromptEngine")
        eng.scheduler = _PromptScheduler(self, _with_type(eng, EngineType.PROMPT))  # type: ignore[assignment]
        self.mode = mode
        self._ready: list[Handoff] = []
        self._params: dict[str, SamplingParams] = {}
        self._rings: dict[str, torch.Tensor] = {}  # replay mode: encoder rings at each request's hit
        self._serial = 0
        if mode == "replay":
            self.replay_config = _replay_config(eng, replay, keep)
            eng.executor = _SnapshotExecutor(self, eng.executor)

    def hit_of(self, num_tokens: int) -> int:
        """Replay mode: positions of a prompt of ``num_tokens`` whose blocks and encoder rings are handed
        (the COMPLETION side replays the rest; 0: it recomputes the prompt). Planned as a prefix hit on
        the prompt itself, the position the engine's prefix cache also keeps rings at, so one snapshot
        serves both; the COMPLETION side's plan (prompt + first token) never moves a hit it is given."""
        from deepinfer_core.swa import plan_replay

        return plan_replay(self.replay_config, num_tokens, num_tokens, 0, host_state=True).hit

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Any = None) -> None:
        try:
            sp = normalize_params(params, self.engine.vocab_size)
        except ValueError:
            sp = None  # the engine reports the bad field itself
        if sp is not None and sp.seed is None:  # the COMPLETION engine must sample with the same seed
            sp = attrs.evolve(sp, seed=derived_seed(self.engine.config.seed, self._serial))
        self._serial += 1
        if sp is not None:
            self._params[request_id] = sp
        self.engine.add_request(request_id, prompt, sp if sp is not None else params)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def _take(self, fr: Any) -> None:
        eng = self.engine
        req = eng.requests.reqs[fr.request_id]
        ex = eng.executor
        slot = int(eng.state_pool.slots([req.seq])[0])
        n = len(req.prompt_token_ids)
        nb = -(-n // eng.config.block_size)
        hit, mode = 0, self.mode
        rings = self._rings.pop(fr.request_id, None)
        if mode == "replay":
            hit = self.hit_of(n)
            if hit and rings is None:
                # the position ran outside this proxy (e.g. skipped by a prefix hit, or an encoder-only part
                # of the prefix cache): no rings there, so this request hands its full state block
                log.debug(
                    "prompt engine: %r: no encoder rings at %d, handing the full state", fr.request_id, hit
                )
                hit, mode = 0, "full"
        if mode == "replay":
            nb = hit // eng.config.block_size
            # a hit here has its rings (a missing one switched to "full" above)
            state = {"rings": rings} if hit and rings is not None else {}
        else:
            state = _state_tensors(ex, slot)
        blocks = torch.as_tensor(np.asarray(fr.handoff_block_ids, dtype=np.int64)[:nb], device=ex.device)
        self._ready.append(
            Handoff(
                request_id=fr.request_id,
                prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids,
                first_token=int(fr.output_token_ids[0]),
                params=self._params.pop(fr.request_id, req.params),
                num_tokens=n,
                block_size=eng.config.block_size,
                blocks={k: v[blocks].clone() for k, v in _block_caches(ex).items()},
                state=state,
                mode=mode,
                hit=hit,
            )
        )

    def step(self) -> tuple[list[RequestOutput], list[Handoff]]:
        outs = [o for o in self.engine.step() if o.finished]  # streamed outputs stay local (docs/engine.md)
        ready, self._ready = self._ready, []
        gone = {h.request_id for h in ready}
        for rid in gone:
            self._params.pop(rid, None)
        return [o for o in outs if o.request_id not in gone], ready


def _replay_config(engine: LLMEngine, replay: str, keep: int | None) -> Any:
    from deepinfer_core.swa import ReplayConfig

    k = engine.envs.yoco_prefill_keep_tokens if keep is None else keep
    return ReplayConfig.from_model(
        engine.model_config, keep=k, block_size=engine.config.block_size, mode=replay
    )


def _plan(cfg: Any, num_tokens: int, hit: int) -> Any:
    """The replay plan of a handed-over prompt of ``num_tokens``: as the prefill of prompt + first token
    (that token is the COMPLETION engine's first decode row) after a hit with encoder rings persisted."""
    from deepinfer_core.swa import plan_replay

    return plan_replay(cfg, num_tokens + 1, hit, 0, host_state=True)


class _SnapshotExecutor:
    """PROMPT side, replay mode: asks the executor for the encoder rings at each prompt's hit position."""

    def __init__(self, owner: PromptEngine, inner: Any) -> None:
        self._owner, self._inner = owner, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, batch: Any) -> Any:
        eng = self._owner.engine
        live = [r for r in eng.requests.reqs.values() if r.seq >= 0 and eng.state_pool.contains(r.seq)]
        rid_of = dict(zip(eng.state_pool.slots([r.seq for r in live]).tolist(), live)) if live else {}
        # the engine's prefix cache may ask for snapshots of its own (to publish rings): keep those, add
        # ours where the row asks for none; a row wanting two positions hands its full state instead
        theirs = batch.snapshot_pos
        snap = np.zeros(batch.num_requests, np.int64) if theirs is None else theirs.copy()
        mine = []
        for i, (slot, s, n) in enumerate(
            zip(batch.state_slots.tolist(), batch.start_pos.tolist(), batch.query_lens.tolist())
        ):
            req = rid_of.get(int(slot))
            if req is None:
                continue
            hit = self._owner.hit_of(len(req.prompt_token_ids))
            if s < hit <= s + n and snap[i] in (0, hit):
                snap[i] = hit
                mine.append(i)
        if mine:
            batch = attrs.evolve(batch, snapshot_pos=snap)
        out = self._inner.execute(batch)
        for i in mine:
            if i in out.snapshots:
                self._owner._rings[rid_of[int(batch.state_slots[i])].request_id] = (
                    out.snapshots[i].detach().clone()
                )
        return out


class _CompletionScheduler:
    """The COMPLETION scheduler, loading each admitted request's KV and state before its first step."""

    def __init__(self, owner: CompletionEngine, inner: Scheduler) -> None:
        self._owner, self._inner = owner, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def schedule(self, *args: Any, **kw: Any) -> Any:
        plan = self._inner.schedule(*args, **kw)
        for seq, n in zip(plan.kv_load_seq_ids.tolist(), plan.kv_load_num_tokens.tolist()):
            self._owner._load(int(seq), int(n))
        return plan


class CompletionEngine:
    """A COMPLETION (decode-only) engine fed with :class:`Handoff` s; outputs carry every token of the
    request (the PROMPT engine's first one included), as a NORMAL engine's would."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        replay: str = "exact",
        keep: int | None = None,
        engine: LLMEngine | None = None,
        **kw: Any,
    ) -> None:
        """``replay`` / ``keep``: how replay-mode hand-offs are rebuilt (as the PROMPT side's); ``engine``:
        wrap this engine instead of building one."""
        self.engine = eng = engine if engine is not None else LLMEngine(config, **kw)
        _check_engine(eng, "CompletionEngine")
        self.replay_config = _replay_config(eng, replay, keep)
        self.replayed_tokens = 0
        self._inner = _with_type(eng, EngineType.COMPLETION)
        eng.scheduler = _CompletionScheduler(self, self._inner)  # type: ignore[assignment]
        self._pending: dict[str, Handoff] = {}
        self._rid_of: dict[int, str] = {}  # scheduler seq id -> request id
        self._errors: dict[str, str] = {}  # requests this wrapper ended, and why
        self._failed: list[RequestOutput] = []

    def add_handoff(self, h: Handoff) -> None:
        """Queue a handed-over request (it decodes from its first token on)."""
        eng = self.engine
        if h.block_size != eng.config.block_size:
            raise ValueError(
                f"handoff {h.request_id!r}: block_size {h.block_size}, this engine's is "
                f"{eng.config.block_size} (the blocks are copied whole)"
            )
        sp = h.params
        if sp.max_tokens is not None and sp.max_tokens <= 1:  # the first token was the last: nothing to do
            self._failed.append(self._output(h, None))
            return
        rest = attrs.evolve(
            sp,
            max_tokens=None if sp.max_tokens is None else sp.max_tokens - 1,
            min_tokens=max(0, sp.min_tokens - 1),
        )
        self._pending[h.request_id] = h
        eng.add_request(h.request_id, [*h.prompt_token_ids, h.first_token], rest)
        try:
            self._rid_of[self._inner.seq_id(h.request_id)] = h.request_id
        except KeyError:  # refused by the engine (it reports why)
            self._pending.pop(h.request_id)

    def has_unfinished(self) -> bool:
        return bool(self._failed) or self.engine.has_unfinished()

    def _load(self, seq: int, n: int) -> None:
        eng = self.engine
        rid = self._rid_of[seq]
        h = self._pending[rid]
        if n != h.num_tokens:  # e.g. re-admitted after a preemption: its decoded tokens' KV is gone
            why = f"KV for {n} tokens asked, the hand-off holds {h.num_tokens} (re-admitted after a preemption?)"
            log.warning("completion engine: request %r: %s", rid, why)
            self._errors[rid] = f"P/D hand-off: {why}"
            eng.abort(rid)
            return
        ex = eng.executor
        if not eng.state_pool.contains(seq) and eng.state_pool.acquire(seq) is None:
            raise RuntimeError(f"completion engine: no free state slot for {rid!r}")
        slot = int(eng.state_pool.slots([seq])[0])
        nb = next(iter(h.blocks.values())).shape[0]
        full_table = eng.kv_pool.block_table(seq).astype(np.int64)
        table = torch.as_tensor(full_table[:nb], device=ex.device)
        caches = _block_caches(ex)
        if set(caches) != set(h.blocks):
            raise ValueError(
                f"handoff {rid!r}: block caches {sorted(h.blocks)}, this executor has {sorted(caches)}"
            )
        for k, t in caches.items():
            t[table] = h.blocks[k].to(t.device)
        if h.mode == "full":
            _load_state(ex, slot, h.state)
        else:
            self._rebuild(h, slot, full_table)

    def _rebuild(self, h: Handoff, slot: int, table: np.ndarray) -> None:
        """Replay mode: encoder rings restored at the hit, then the plan's encoder-only prefill and tail
        (decoder windows truncated at the tail's start) up to the last prompt token; the decode row at
        the prompt's end then runs with that floor (the executor keeps it per slot)."""
        from deepinfer_core.model.batch import ForwardBatch
        from deepinfer_core.swa import ENCODER_PREFILL, ENCODER_RESTORE, PREFILL, TAIL

        ex, p = self.engine.executor, h.num_tokens
        plan = _plan(self.replay_config, p, h.hit)
        if plan.hit != h.hit:
            raise ValueError(
                f"handoff {h.request_id!r}: the PROMPT side handed {h.hit} positions, this engine's "
                f"replay config plans {plan.hit} (use the same replay / keep / block_size)"
            )
        toks = np.asarray(h.prompt_token_ids, dtype=np.int64)
        if h.hit:
            ex.restore_encoder(slot, h.hit, h.state["rings"], toks[: h.hit])
        for st in plan.steps:
            end = min(st.end, p)  # the last position is the engine's first decode row
            if st.kind == ENCODER_RESTORE or end <= st.start:
                continue
            if st.kind not in (ENCODER_PREFILL, TAIL, PREFILL):
                raise RuntimeError(f"handoff {h.request_id!r}: unexpected replay step {st.kind}")
            floor = st.floor if st.kind == TAIL and h.hit else 0
            ex.execute(
                ForwardBatch(
                    token_ids=toks[st.start : end],
                    query_lens=[end - st.start],
                    start_pos=[st.start],
                    block_tables=table[None],
                    state_slots=[slot],
                    num_logits=[0],
                    encoder_only=st.kind == ENCODER_PREFILL,
                    decoder_floor=[floor],
                )
            )
            self.replayed_tokens += end - st.start

    def _output(self, h: Handoff, o: RequestOutput | None) -> RequestOutput:
        tok = self.engine.tokenizer
        if o is None:
            ids: tuple[int, ...] = (h.first_token,)
            return RequestOutput(
                request_id=h.request_id,
                prompt=h.prompt,
                prompt_token_ids=h.prompt_token_ids,
                text=tok.decode(ids),
                token_ids=ids,
                finish_reason="length",
            )
        ids = (h.first_token, *o.token_ids)
        return attrs.evolve(
            o, prompt=h.prompt, prompt_token_ids=h.prompt_token_ids, token_ids=ids, text=tok.decode(ids)
        )

    def step(self) -> list[RequestOutput]:
        out, self._failed = self._failed, []
        for o in self.engine.step():
            if not o.finished:  # the decode side reports whole outputs (first token prepended)
                continue
            h = self._pending.pop(o.request_id, None)
            err = self._errors.pop(o.request_id, None)
            if err is not None:
                o = attrs.evolve(o, finish_reason=ERROR, error=err)
            out.append(o if h is None else self._output(h, o))
        self._rid_of = {s: r for s, r in self._rid_of.items() if r in self._pending}
        return out


# ---------------------------------------------------------------------- over torch.distributed
def send_handoff(h: Handoff, dst: int, group: Any = None, device: Any = "cpu") -> None:
    """Send ``h`` to global rank ``dst`` (which calls :func:`recv_handoff`)."""
    names = [*(f"b:{k}" for k in h.blocks), *(f"s:{k}" for k in h.state)]
    tensors = [*h.blocks.values(), *h.state.values()]
    meta = {
        "request_id": h.request_id,
        "prompt": h.prompt,
        "prompt_token_ids": h.prompt_token_ids,
        "first_token": h.first_token,
        "params": h.params,
        "num_tokens": h.num_tokens,
        "block_size": h.block_size,
        "mode": h.mode,
        "hit": h.hit,
        "tensors": [(n, tuple(t.shape), str(t.dtype).split(".")[-1]) for n, t in zip(names, tensors)],
    }
    dist.send_object_list([meta], dst=dst, group=group)
    for t in tensors:
        if t.numel():  # (an empty tensor is rebuilt from its shape)
            dist.send(t.contiguous().to(device), dst=dst, group=group)


def recv_handoff(src: int, group: Any = None, device: Any = "cpu") -> Handoff:
    """Receive a :class:`Handoff` sent by global rank ``src``."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    meta = box[0]
    blocks: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, shape, dtype in meta["tensors"]:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        if t.numel():
            dist.recv(t, src=src, group=group)
        # the executor's host arrays (model.replay.SLOT_ARRAYS) come back to the host
        (blocks if name.startswith("b:") else state)[name[2:]] = t.cpu() if name[2:] in SLOT_ARRAYS else t
    return Handoff(
        request_id=meta["request_id"],
        prompt=meta["prompt"],
        prompt_token_ids=meta["prompt_token_ids"],
        first_token=meta["first_token"],
        params=meta["params"],
        num_tokens=meta["num_tokens"],
        block_size=meta["block_size"],
        blocks=blocks,
        state=state,
        mode=meta["mode"],
        hit=meta["hit"],
    )
