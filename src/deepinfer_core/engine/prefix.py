"""The engine's prefix caching: the KV pool's prefix index for block KV, SWA bounded replay for the state.

Per sequence, when it is admitted (a new request, or one recomputed after preemption, which then
re-hits its own prefix):

1. The scheduler (``Scheduler.set_prefix_sharing``, set up here) matched the pool's prefix index over
   the longest hit the :mod:`deepinfer_core.swa` planner keeps (whole blocks and compression groups,
   at most ``known - tail`` tokens so the tail is new), took those cached blocks into the request's
   table by refcount (shared, no copy, no new memory: a hit also saves blocks, and admission can no
   longer evict the blocks it is about to hit), and started the prefill after them; ``plan.cached``
   reports the hit. Every write of the request goes to its own fresh blocks after the hit.
2. An external block store (``EngineConfig.kv_store``) may continue the hit block by block into the
   request's private blocks; the planner then trims the whole hit and says how to rebuild the
   sliding-window state.
3. The encoder rings at the hit are restored from the host SWA store when present, else replayed.
4. The scheduler's chunks then run as planned, except that tokens inside the hit are skipped, tokens
   before the tail run encoder-only (one extra executor call per step, before the main batch), and the
   tail runs with ``decoder_floor`` at its start (bounded replay, or the exact span in exact mode).

After every step, each sequence whose KV is exact (no approximate encoder replay behind it) publishes
the whole blocks it completed to the prefix index and the encoder rings at the newest block boundary to
the host store (``snapshot_pos``), so later requests, and this one after a preemption, can hit them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.kv import PagedKVPool, PrefixIndex
from deepinfer_core.model.config import ModelConfig
from deepinfer_core.protocols import ModelExecutor
from deepinfer_core.scheduler import Scheduler
from deepinfer_core.swa import (
    ENCODER_REPLAY,
    ENCODER_RESTORE,
    HostSWAStore,
    ReplayConfig,
    ReplayPlan,
    plan_replay,
)
from deepinfer_core.swa import prefix_digests as _digests

if TYPE_CHECKING:
    from deepinfer_core.kvstore.guard import StoreGuard

log = logging.getLogger(__name__)


@attrs.define
class _Seq:
    tokens: np.ndarray  # the known tokens when its prefill started (prompt + outputs so far)
    digests: list[bytes]
    plan: ReplayPlan | None
    exact: bool  # its KV equals a no-cache run's (so its blocks and rings may be published)
    published: int = 0  # tokens of whole blocks already offered to the index


@attrs.define
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    replayed_tokens: int = 0
    host_restores: int = 0
    encoder_replays: int = 0
    # the external store's faults by kind (kvstore.KINDS), the engine's kv_store_errors: the live dict of
    # its StoreGuard (GuardStats.errors; engine.prefix.link.guard.stats has the rest)
    kv_store_errors: dict[str, int] = attrs.field(factory=dict)


@attrs.define
class StepRows:
    """What the main batch runs of each plan row: ``rows`` (the plan rows it keeps), per plan row the new
    ``start`` / ``ntok``, ``tok_mask`` over the plan's flat tokens, ``floor`` (decoder_floor) and ``snap``
    (snapshot_pos); ``failed``: (seq, message) of sequences whose encoder-only part was refused."""

    rows: np.ndarray
    start: np.ndarray
    ntok: np.ndarray
    tok_mask: np.ndarray
    floor: np.ndarray
    snap: np.ndarray
    decode: bool = False
    failed: list[tuple[int, str]] = attrs.field(factory=list)


@attrs.frozen
class RowParts:
    """How the engine runs one plan row ``[start, end)`` of a sequence with a replay plan."""

    skip_to: int  # tokens before this are in the hit (not computed)
    encoder_end: int  # [skip_to, encoder_end) runs encoder-only
    floor: int  # the rest [encoder_end, end) runs with this decoder_floor (0: none)


class PrefixCaching:
    """Prefix caching for one engine (one pool, one executor)."""

    def __init__(
        self,
        pool: PagedKVPool,
        executor: ModelExecutor,
        model_cfg: ModelConfig,
        *,
        block_size: int,
        mode: str,
        keep: int,
        host_bytes: int,
        pending_drafts: int,
    ) -> None:
        self.index = PrefixIndex(pool)
        self.ex = executor
        self.bs = block_size
        self.cfg = ReplayConfig.from_model(model_cfg, keep=keep, block_size=block_size, mode=mode)
        self.al = self.cfg.align  # hits (and so snapshots) are whole blocks and whole compression groups
        self.store = HostSWAStore(host_bytes)
        self.pending = pending_drafts
        self.stats = PrefixStats()
        self._seq: dict[int, _Seq] = {}
        self._metrics: dict[int, list[int]] = {}  # seq -> [cached, replayed], summed over its restarts
        self._ctx = int(executor.tok_ring)
        # tokens a hit always leaves to compute (plan_replay's tail; the model has a decoder here)
        self.tail = (
            self.cfg.exact_tail(pending_drafts)
            if self.cfg.mode == "exact"
            else max(self.cfg.keep, self.cfg.window + pending_drafts)
        )
        self.link: Any = None  # a kvstore.StoreLink when EngineConfig.kv_store is set
        # encoder-ring snapshots on their way to the host store (CUDA): copied without a synchronisation,
        # put in order before the store is next read (begin), so every lookup sees the same store as if
        # each put had been immediate (a .cpu() here would stall the asynchronous overlap every block)
        self._puts: list[tuple[Any, int, torch.Tensor, Any]] = []

    # ------------------------------------------------------------------ a (re)start
    def begin(self, seq: int, known: np.ndarray, table: np.ndarray, slot: int, shared: int = 0) -> None:
        """Sequence ``seq`` was admitted with ``known`` tokens in ``slot`` / ``table``, its first ``shared``
        tokens on cached blocks the scheduler shared into ``table``: continue the hit in the external
        store, plan the replay, rebuild the encoder rings."""
        self.flush_puts()
        toks = np.ascontiguousarray(np.asarray(known, dtype=np.int64))
        n = int(toks.shape[0])
        dig = _digests(toks, self.bs)
        self.stats.lookups += 1
        ng = shared // self.bs
        lim = max(0, n - self.tail) // self.al * self.al  # the planner keeps no more: fetch nothing past it
        fetched = self.link.fetch(toks[:lim], ng) if self.link is not None and lim > shared else []
        # the external store continues the GPU hit block by block (a store fault is a miss: kvstore.guard)
        plan = self._plan(n, shared + len(fetched) * self.bs, dig)
        nb = plan.hit // self.bs
        if nb > ng and not self.link.land(table[ng:nb], fetched[: nb - ng]):  # a failed swap-in is a miss too
            plan = self._plan(n, shared, dig)
        if plan.hit < shared:  # the scheduler's cap is the planner's: a shared block is never recomputed
            raise RuntimeError(
                f"prefix caching: seq {seq} was admitted on {shared} shared tokens but the replay "
                f"plan keeps only {plan.hit} (scheduler prefix_align / prefix_tail out of step)"
            )
        m = self._metrics.setdefault(seq, [0, 0])
        if plan.hit == 0:
            self._seq[seq] = _Seq(toks, dig, None, True)
            return
        nb = plan.hit // self.bs
        self._rebuild_encoder(plan, toks, dig[nb - 1], slot, table)
        exact_enc = (
            plan.encoder_restored
            or plan.steps[0].start == 0
            or plan.encoder_replay_tokens >= self.cfg.exact_encoder_replay()
        )
        self._seq[seq] = _Seq(toks, dig, plan, exact_enc, published=plan.hit)
        self.stats.hits += 1
        self.stats.cached_tokens += plan.hit
        self.stats.replayed_tokens += plan.replayed_tokens
        m[0] += plan.hit
        m[1] += plan.replayed_tokens
        log.debug(
            "prefix hit seq %d: %d of %d tokens cached (%s), %d replayed",
            seq,
            plan.hit,
            n,
            "host rings" if plan.encoder_restored else "encoder replayed",
            plan.replayed_tokens,
        )

    def _plan(self, n: int, hit: int, dig: list[bytes]) -> ReplayPlan:
        plan = plan_replay(self.cfg, n, hit, self.pending)
        if plan.hit > 0 and self.store.has(dig[plan.hit // self.bs - 1], plan.hit):
            plan = plan_replay(self.cfg, n, hit, self.pending, host_state=True)
        return plan

    def parts(self, seq: int, start: int, end: int) -> RowParts | None:
        """The split of a prefill row of a sequence with a replay plan (None: run it as planned)."""
        st = self._seq.get(seq)
        if st is None or st.plan is None:
            return None
        t0 = st.plan.tail_start
        a = max(start, st.plan.hit)
        return RowParts(skip_to=min(a, end), encoder_end=min(max(a, t0), end), floor=t0)

    # ------------------------------------------------------------------ publishing
    def snapshot_pos(self, seq: int, start: int, end: int, decode: bool) -> int:
        """The block boundary whose encoder rings this row should capture (0: none).

        Decode rows: the boundary right after the row's first (verified) token, the newest end of the
        sequence (what a follow-up turn hits). Prefill rows: the position a request repeating this prompt
        would hit (its tail left new), when inside the row, else the row's newest boundary.
        """
        st = self._seq.get(seq)
        if st is None or not st.exact:
            return 0
        if decode:  # only the row's first token is verified (the rest may be drafts)
            return start + 1 if (start + 1) % self.al == 0 else 0
        n = st.tokens.shape[0]
        x = (n - self.tail) // self.al * self.al
        if start < x <= end:
            return x
        x = min(end, n) // self.al * self.al
        return x if x > start else 0

    def publish(
        self,
        seq: int,
        upto: int,
        snap: int,
        rings: torch.Tensor | None,
        table: np.ndarray,
        tokens: Callable[[], np.ndarray],
    ) -> None:
        """``seq`` has computed its first ``upto`` tokens exactly: insert its whole blocks below ``upto`` in the
        prefix index, and keep ``rings`` (its encoder rings at ``snap``) in the host store.
        ``tokens()`` gives the sequence's tokens when more are needed than it started with."""
        st = self._seq.get(seq)
        if st is None or not st.exact:
            return
        pos = max(upto // self.al * self.al, snap)
        toks = st.tokens
        if pos > toks.shape[0]:
            toks = np.asarray(tokens(), dtype=np.int64)
            if toks.shape[0] < pos:
                return
            st.tokens = toks
        if len(st.digests) < pos // self.bs:
            st.digests = _digests(toks, self.bs, start=st.digests)
        blocks = upto // self.al * self.al
        if blocks > st.published:
            self.index.insert(toks[:blocks], table[: blocks // self.bs])
            if self.link is not None:  # exact finished blocks go to the external store too (decode's as well)
                self.link.write_back(toks, table, st.published // self.bs, blocks // self.bs)
            st.published = blocks
        if rings is not None and snap:
            self._put_rings(st.digests[snap // self.bs - 1], snap, rings)

    def _put_rings(self, digest: Any, snap: int, rings: torch.Tensor) -> None:
        if rings.device.type != "cuda":
            self.store.put(digest, snap, rings.cpu().numpy())
            return
        host = torch.empty(rings.shape, dtype=rings.dtype, pin_memory=True)
        host.copy_(rings, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._puts.append((digest, snap, host, ev))

    def flush_puts(self) -> None:
        """Put the snapshots still being copied into the host store (each waits for its own copy only)."""
        for digest, snap, host, ev in self._puts:
            ev.synchronize()
            self.store.put(digest, snap, host.numpy().copy())  # pageable: the pinned block goes back to torch
        self._puts.clear()

    # ------------------------------------------------------------------ one engine step
    def prepare(
        self,
        prefill: bool,
        rows: np.ndarray,
        seq_ids: np.ndarray,
        start: np.ndarray,
        ntok: np.ndarray,
        tokens: np.ndarray,
        tables: np.ndarray,
        slots: Callable[[np.ndarray], np.ndarray],
        known: Callable[[int], np.ndarray],
        cached: np.ndarray | None = None,
    ) -> StepRows:
        """Before a step's main batch: (re)start lookups, skipped hit tokens, the encoder-only parts (run
        here, one executor call), and what the main batch runs of each plan row (``StepRows``).

        ``rows``: the plan rows to run; ``start`` / ``ntok`` / ``tokens`` / ``tables``: the plan's
        (placeholders filled); ``slots(seq_ids)``: state slots; ``known(seq)``: a sequence's tokens;
        ``cached``: the plan's per-row shared hit (-1: not an admission; None: rows at 0 are admissions).
        """
        out = StepRows(
            rows=rows,
            start=start.astype(np.int64).copy(),
            ntok=ntok.astype(np.int64).copy(),
            tok_mask=np.ones(tokens.shape[0], bool),
            floor=np.zeros(start.shape[0], np.int64),
            snap=np.zeros(start.shape[0], np.int64),
        )
        off = np.concatenate(([0], np.cumsum(ntok)))
        if not prefill:  # only rows crossing a boundary publish: no per-row Python in most decode steps
            out.decode = True
            for r in rows[(start[rows] + 1) % self.al == 0].tolist():
                out.snap[r] = self.snapshot_pos(int(seq_ids[r]), int(start[r]), int(start[r] + ntok[r]), True)
            return out
        sl = slots(seq_ids[rows])
        enc: list[tuple[int, int, int, int]] = []  # (plan row, start, end, snapshot)
        for j, r in enumerate(rows.tolist()):
            seq, s0, n = int(seq_ids[r]), int(start[r]), int(ntok[r])
            c = (0 if s0 == 0 else -1) if cached is None else int(cached[r])
            if c >= 0:
                self.begin(seq, known(seq), tables[r], int(sl[j]), c)
            x = self.snapshot_pos(seq, s0, s0 + n, False)
            p = self.parts(seq, s0, s0 + n)
            if p is None:
                out.snap[r] = x
                continue
            if p.encoder_end > p.skip_to:
                enc.append((r, p.skip_to, p.encoder_end, x if p.skip_to < x <= p.encoder_end else 0))
            out.tok_mask[off[r] : off[r] + (p.encoder_end - s0)] = False
            out.start[r], out.ntok[r] = p.encoder_end, s0 + n - p.encoder_end
            out.floor[r] = p.floor if out.ntok[r] else 0
            out.snap[r] = x if x > p.encoder_end else 0
        if enc and not self._run_encoder(out, enc, tokens, off, start, tables, seq_ids, slots):
            return out
        out.rows = np.asarray([r for r in rows.tolist() if out.ntok[r] > 0], np.int64)
        return out

    def _run_encoder(
        self,
        out: StepRows,
        enc: list[tuple[int, int, int, int]],
        tokens: np.ndarray,
        off: np.ndarray,
        start: np.ndarray,
        tables: np.ndarray,
        seq_ids: np.ndarray,
        slots: Callable[[np.ndarray], np.ndarray],
    ) -> bool:
        """The step's encoder-only parts ``enc`` ((plan row, start, end, snapshot) each) in one executor
        call, their rings published; False when the executor refused one (failed in ``out``, its row
        dropped)."""
        from deepinfer_core.model.batch import BatchError, ForwardBatch

        er = np.asarray([e[0] for e in enc])
        parts = [tokens[off[r] + a - int(start[r]) : off[r] + b - int(start[r])] for r, a, b, _ in enc]
        b = ForwardBatch(
            token_ids=np.concatenate(parts),
            query_lens=[e[2] - e[1] for e in enc],
            start_pos=[e[1] for e in enc],
            block_tables=tables[er],
            state_slots=slots(seq_ids[er]),
            num_logits=np.zeros(len(enc), np.int64),
            encoder_only=True,
            snapshot_pos=[e[3] for e in enc],
        )
        try:
            res = self.ex.execute(b)
        except BatchError as e:
            if e.request is None:
                raise
            out.failed.append((int(seq_ids[er[e.request]]), f"encoder-only prefill refused: {e}"))
            out.rows = np.setdiff1d(out.rows, er[e.request : e.request + 1])
            return False
        for i, (r, _, e_end, x) in enumerate(enc):
            self.publish(
                int(seq_ids[r]), e_end, x, res.snapshots.get(i), tables[r], lambda: np.zeros(0, np.int64)
            )
        return True

    def after(
        self,
        out: StepRows,
        rows: np.ndarray,
        seq_ids: np.ndarray,
        tables: np.ndarray,
        snapshots: dict[int, torch.Tensor],
        known: Callable[[int], np.ndarray],
        fed: np.ndarray,
    ) -> None:
        """After the main batch ran ``rows`` (its request i = rows[i]): publish completed blocks and rings.
        ``fed``: each plan row's first input token (a decode row's verified token at its start)."""
        which = np.flatnonzero(out.snap[rows] > 0) if out.decode else np.arange(rows.shape[0])
        for i in which.tolist():
            r = int(rows[i])
            x = int(out.snap[r])
            seq, s0 = int(seq_ids[r]), int(out.start[r])
            upto = x if out.decode else s0 + int(out.ntok[r])
            if upto < self.al:
                continue

            def toks(seq: int = seq, s0: int = s0, r: int = r) -> np.ndarray:
                k = np.asarray(known(seq), dtype=np.int64)
                return np.concatenate((k[:s0], fed[r : r + 1])) if k.shape[0] >= s0 else k[:0]

            self.publish(seq, upto, x, snapshots.get(i), tables[r], toks)

    # ------------------------------------------------------------------ lifecycle
    def drop(self, seq: int) -> None:
        """The sequence stopped (preempted or finished): forget its plan (its metrics stay until taken)."""
        self._seq.pop(seq, None)

    def _rebuild_encoder(
        self, plan: ReplayPlan, toks: np.ndarray, digest: bytes, slot: int, table: np.ndarray
    ) -> None:
        """The encoder rings at the hit: restored from the host store, or replayed (the plan's first step)."""
        first = plan.steps[0]
        ctx = toks[max(0, first.start - self._ctx) : first.start]
        if first.kind == ENCODER_RESTORE:
            rings = self.store.get(digest, plan.hit)
            self.ex.restore_encoder(slot, plan.hit, torch.from_numpy(rings), ctx)
            self.stats.host_restores += 1
        else:
            assert first.kind == ENCODER_REPLAY
            self.ex.replay_encoder(slot, toks[first.start : first.end], first.start, table, ctx)
            self.stats.encoder_replays += 1

    def take_metrics(self, seq: int) -> tuple[int, int]:
        """(cached_tokens, replayed_tokens) of a finished sequence, summed over its (re)starts."""
        self._seq.pop(seq, None)
        c, r = self._metrics.pop(seq, (0, 0))
        return int(c), int(r)


def make_prefix_caching(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    pool: PagedKVPool,
    executor: ModelExecutor,
    scheduler: Scheduler,
    *,
    keep_default: int,
    pending_drafts: int,
    guard: StoreGuard | None = None,
) -> PrefixCaching | None:
    """The engine's prefix caching per its config (None: off, or a model without a CED decoder).
    ``keep_default``: the SWA keep when ``cfg.swa_keep_tokens`` is unset (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS);
    ``pending_drafts``: the drafts a step may verify (the tail a hit always leaves to compute grows by them);
    ``guard``: the ``kvstore.StoreGuard`` to keep (None: one built from ``cfg.kv_store_guard``)."""
    if not cfg.prefix_caching or model_cfg.encoder_layers >= model_cfg.num_hidden_layers:
        return None
    keep = cfg.swa_keep_tokens if cfg.swa_keep_tokens is not None else keep_default
    pc = PrefixCaching(
        pool,
        executor,
        model_cfg,
        block_size=cfg.block_size,
        mode=cfg.swa_replay,
        keep=keep,
        host_bytes=cfg.swa_host_bytes,
        pending_drafts=pending_drafts,
    )
    # admissions share cached blocks up to the largest hit the planner keeps (its tail left new)
    scheduler.set_prefix_sharing(pc.al, pc.tail)
    if cfg.kv_store is not None:
        from deepinfer_core.kvstore import BlockCodec, StoreLink, config_key

        # ``guard``: the previous run's (an engine's reset keeps it, and so its breaker's state)
        pc.link = StoreLink(
            cfg.kv_store,
            BlockCodec.from_executor(executor),
            cfg.block_size,
            extra_key=config_key(cfg),
            traffic_class=cfg.kv_store_traffic_class,
            guard=guard if guard is not None else cfg.kv_store_guard,  # type: ignore[arg-type]  # checked by EngineConfig
        )
        pc.stats.kv_store_errors = pc.link.guard.stats.errors
    return pc
