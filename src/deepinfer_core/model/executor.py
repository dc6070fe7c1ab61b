"""ModelExecutor: one step of the model over a flat batch, with KV kept in the executor's caches.

The caller (engine, tests) owns the bookkeeping: block ids from the KV block pool, one state slot per
sequence from the state pool, and each request's start position. The executor owns the device tensors
(see :mod:`deepinfer_core.model.cache`) and writes every new KV through the byte formats before reading
it back, so the attention sees exactly what a later step will see.

Per layer the dense work (projections, MoE) runs on all rows at once; attention loops over requests,
because each has its own window, compressed entries and top-k.

Part 2 state, per slot and indexed by position like the SWA rings: the recent tokens (Engram n-gram
context across steps) and, with a drafter, the drafter's context rings and last drafts
(:mod:`deepinfer_core.model.speculative`). Engram rows are fetched once per step before the layer loop
from the tables of the chosen placement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed, h2d
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.cache import CacheFormats
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA
from deepinfer_core.model.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs, check_buckets
from deepinfer_core.model.decode_step import execute_rows, hash_decode_on_device, hashed_row_tables
from deepinfer_core.model.fused_kernels import kernel_defaults
from deepinfer_core.model.fusion import fused_glue
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import index_scores, mask_scores, pick_entries
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.prefill import DEFAULT_BUDGET, DEFAULT_TILE, attend_requests
from deepinfer_core.model.replay import ReplayMixin
from deepinfer_core.model.speculative import SpecState
from deepinfer_core.model.validation import ValidationMixin
from deepinfer_core.protocols.model import Backend

log = logging.getLogger(__name__)


class ModelExecutor(ValidationMixin, ReplayMixin):
    """Runs :class:`ForwardBatch` steps of ``model`` (satisfies ``protocols.ModelExecutor``).

    ``num_blocks`` / ``block_size`` must match the KV block pool whose tables the batches carry;
    ``num_state_slots`` the state pool. ``backtrack_tokens`` is how far a sequence may be rolled back
    (DEEPINFER_MAX_BACKTRACKING_TOKENS; default drafts + 1 = 6). ``quantize`` stores KV as FP4 (main),
    FP8 (SWA ring) and MXFP4 (indexer keys); off stores exact raw values. ``backend`` (a
    ``deepinfer_kernels`` Backend) routes the cache writes through its ``kv_store`` /
    ``swa_ring_write`` ops; None writes with plain torch indexing (the same bytes as the reference ops).
    ``engram_placement`` chooses where the Engram tables live: ``"local"`` (the model's tables, one
    device), ``"host"`` (host memory, rows copied per step) or ``"sharded"`` (row blocks over
    ``engram_group``, a torch.distributed group whose every rank runs the same steps' fetches). ``seed``
    seeds the sampling of drafts and of verification.

    With a backend on a CUDA device (``sync_free``), decode / verify steps run without host
    synchronisation (:mod:`~deepinfer_core.model.decode_step`), and with ``cuda_graphs`` pure-decode
    batches replay CUDA graphs captured per batch bucket (``cuda_graph_buckets``;
    :mod:`~deepinfer_core.model.cuda_graphs`); ``cuda_graphs=False`` (DEEPINFER_CUDA_GRAPHS=0) runs them
    eagerly. ``fuse_glue`` compiles the step's small per-token functions into fused kernels
    (:mod:`~deepinfer_core.model.fusion`, torch.compile; the first step of each new shape compiles).
    ``draft_context=False`` keeps no drafter context (no drafts or verification from this executor,
    and none of the drafter's per-step work) for a model that has a drafter.
    These attributes may be changed between steps.
    """

    def __init__(self, model: DeepSeekV41, num_blocks: int, block_size: int, num_state_slots: int,
                 backtrack_tokens: int = 6, quantize: bool = True, backend: Backend | None = None,
                 engram_placement: str = "local", engram_group: object | None = None, seed: int = 0,
                 cuda_graphs: bool = True, cuda_graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
                 fuse_glue: bool = False, draft_context: bool = True) -> None:
        for name, v, lo in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1),
                            ("num_state_slots", num_state_slots, 1), ("backtrack_tokens", backtrack_tokens, 0)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
        self.model, self.cfg = model, model.cfg
        cfg = self.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_state_slots
        self.backtrack = backtrack_tokens
        self.fmt = CacheFormats.make(cfg.head_dim, cfg.index_head_dim, quantize, self.dtype)
        # cache writes go through the backend's kv_store / swa_ring_write ops when one is given (the
        # cuda backend's TileLang kernels write the same bytes); by name so kernels recognise them
        self.backend = backend
        self._fmt_arg = ({"main": "fp4", "swa": "fp8", "index": "mxfp4"} if quantize
                         else {"main": self.fmt.main, "swa": self.fmt.swa, "index": self.fmt.index})
        self.swa_ring = cfg.sliding_window + backtrack_tokens
        # with a backend on a CUDA device, row-path steps run sync-free (decode_step) and pure-decode
        # batches replay CUDA graphs bucketed by batch size (cuda_graphs; the switch: DEEPINFER_CUDA_GRAPHS)
        self.sync_free = backend is not None and self.device.type == "cuda"
        self.cuda_graphs = bool(cuda_graphs) and self.sync_free
        self._graph_buckets = check_buckets(cuda_graph_buckets)
        # the sync-free step's small functions compiled into fused kernels (model.fusion; torch.compile)
        self.fuse_glue = bool(fuse_glue) and self.sync_free
        # each decode layer's attention as the backend's one-kernel ``sink_attention_rows`` (TileLang on the
        # cuda backend) instead of two batched GEMMs and the softmax between them; the MoE's expert products
        # as its ``moe_grouped_gemm``; the LM head as that kernel with one group (a [V, D] weight stream).
        # On by default where the model's shapes run the kernels (model.fused_kernels); set between steps,
        # as the other switches
        for name, on in kernel_defaults(model, backend, self.sync_free).items():
            setattr(self, name, on)
        self._graphs: DecodeGraphs | None = None
        dev, u8 = self.device, torch.uint8
        n_layers = cfg.num_hidden_layers
        self.swa = [torch.zeros(num_state_slots, self.swa_ring, self.fmt.swa.bytes_per_token, dtype=u8, device=dev)
                    for _ in range(n_layers)]
        self.kv: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.comp_state: dict[int, torch.Tensor] = {}
        self.comp_ring: dict[int, int] = {}
        for s in cfg.kv_source_layer_ids:
            self.kv[s] = torch.zeros(num_blocks, block_size, self.fmt.main.bytes_per_token, dtype=u8, device=dev)
            self.index_keys[s] = torch.zeros(num_blocks, block_size, self.fmt.index.bytes_per_token, dtype=u8, device=dev)
            if cfg.ratio(s) > 1:  # ratio 1 completes an entry every token: no partial group to keep
                a = model.layers[s].attn
                ring = cfg.ratio(s) + backtrack_tokens
                self.comp_ring[s] = ring
                width = a.compressor.state_dim + a.index_compressor.state_dim
                self.comp_state[s] = torch.zeros(num_state_slots, ring, width, dtype=self.dtype, device=dev)
        # end position written per slot, to refuse steps the rings cannot serve (a gap, or a rollback
        # deeper than backtrack_tokens); a step at position 0 always (re)starts a sequence
        self._slot_end = np.zeros(num_state_slots, np.int64)
        # slots filled by encoder-only steps: their decoder SWA rings hold nothing yet
        self._encoder_only = np.zeros(num_state_slots, bool)
        # run decode / verify batches (every query_len <= backtrack + 1) through the row-wise path
        self.row_path = True
        self.min_ratio = min((r for r in cfg.compress_ratios[: n_layers] if r > 0), default=0)
        self._src_ratios = sorted({cfg.ratio(s) for s in cfg.kv_source_layer_ids if cfg.ratio(s) > 0})
        # SWA bounded replay (deepinfer_core.swa): per slot, the first position whose SWA keys exist in
        # the encoder / decoder rings (keys below are never attended: the truncated window), and the
        # lowest position a step may start at after a restore or a replay (no rollback below it)
        self._floor = np.zeros((num_state_slots, 2), np.int64)
        self._min_start = np.zeros(num_state_slots, np.int64)
        self._no_block_writes = False  # set during replay_encoder: shared blocks are only read
        self._snap_at: dict[int, int] = {}  # request index -> snapshot position, during one step
        self._snaps: dict[int, list[torch.Tensor]] = {}
        # Engram: the tables of the chosen placement, and each slot's recent tokens (n-gram context
        # across steps), a ring indexed by position like the SWA rings
        self.engram_tables = make_engram_tables(model, engram_placement, engram_group)
        self.engram_placement = engram_placement
        self.tok_ring = max(self.swa_ring, cfg.engram_max_ngram - 1 + backtrack_tokens)
        self._tokens = np.full((num_state_slots, self.tok_ring), -1, np.int64)
        self._fed: list[tuple[np.ndarray, np.ndarray, TokenFeed]] = []  # ring entries whose token is on the device
        # the drafter's context rings are written every step (eager work after a replayed graph): only
        # when drafts will be asked for (draft_context; the engine passes whether it speculates)
        self.spec = SpecState(self, seed) if model.drafter is not None and draft_context else None

    def graphs(self) -> DecodeGraphs:
        """This executor's captured decode graphs (made on first use; ``cuda_graphs`` must be on)."""
        if self._graphs is None:
            self._graphs = DecodeGraphs(self, self._graph_buckets)
        return self._graphs

    # ------------------------------------------------------------------ memory accounting
    def cache_bytes(self) -> dict[str, int]:
        """Bytes held by each cache kind."""
        return {
            "main_kv": sum(t.numel() for t in self.kv.values()),
            "index_keys": sum(t.numel() for t in self.index_keys.values()),
            "swa_ring": sum(t.numel() for t in self.swa),
            "compressor_state": sum(t.numel() * t.element_size() for t in self.comp_state.values()),
            "drafter_rings": 0 if self.spec is None else self.spec.cache_bytes(),
            "token_ring": self._tokens.nbytes,
        }

    # ------------------------------------------------------------------ the step
    @property
    def token_feed_ok(self) -> bool:
        """Whether ``execute`` can take input tokens from the device (a :class:`TokenFeed`) without
        waiting for them: Engram n-grams are then hashed on the device, so the tables must be the
        model's own (``"local"``); host or sharded tables fetch by host row ids. No drafter context
        either (the drafter reads its step's tokens on the host)."""
        return self.spec is None and (not self.cfg.engram_layer_ids or self.engram_placement == "local")

    @torch.no_grad()
    def execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> ForwardOutput:
        """Run one step; returns logits for the requested rows and per-layer expert counts. ``feed``:
        tokens of the batch that are still on the device (``batch.token_ids`` holds valid placeholders
        there), the engine's asynchronous overlap; needs :attr:`token_feed_ok`."""
        if feed is not None and not self.token_feed_ok:
            raise ValueError("feed: this executor cannot take device tokens (host / sharded Engram tables or a "
                             "drafter context); read them back first")
        self.validate(batch)
        dev = self.device
        # per-slot resets as indexed writes (no per-request loop): validation refused repeated slots,
        # so the writes of different requests never touch the same slot and their order is immaterial
        restart = batch.state_slots[batch.start_pos == 0]
        if restart.size:
            self._floor[restart] = 0
            self._min_start[restart] = 0
        if batch.decoder_floor is not None:
            up = batch.decoder_floor > 0
            if up.any():
                fs = batch.state_slots[up]
                self._floor[fs, 1] = np.maximum(self._floor[fs, 1], batch.decoder_floor[up])
        sp = batch.snapshot_pos
        self._snap_at = {} if sp is None or not sp.any() else {
            i: int(x) for i, x in enumerate(sp.tolist()) if x > 0}
        self._snaps = {}
        if self.sync_free and self.row_path and not batch.encoder_only and int(batch.query_lens.max()) <= self.backtrack + 1:
            return execute_rows(self, batch, feed)
        tokens = torch.as_tensor(batch.token_ids, device=dev)
        if feed is not None:  # a copy: on the CPU as_tensor shares the host array, which must keep its placeholders
            tokens = tokens.clone()
            feed.apply(tokens)
        positions = torch.as_tensor(batch.positions, device=dev)
        off = batch.offsets.tolist()
        reqs = [(off[i], off[i + 1], int(batch.start_pos[i]), int(batch.state_slots[i]),
                 torch.as_tensor(batch.block_tables[i], dtype=torch.long, device=dev)) for i in range(batch.num_requests)]
        sel: dict = {}
        pools: dict = {}
        engram_rows = self._engram_rows(batch, tokens, feed)
        if self.row_path and not batch.encoder_only and int(batch.query_lens.max()) <= self.backtrack + 1:
            # decode / verify steps: every row's window and group are in the rings after this step's
            # writes, so attention runs on all rows at once (no per-request loop)
            req_of_row = torch.as_tensor(np.repeat(np.arange(batch.num_requests), batch.query_lens), device=dev)
            tables = torch.as_tensor(batch.block_tables, dtype=torch.long, device=dev)[req_of_row]
            slots = torch.as_tensor(batch.state_slots, device=dev)[req_of_row]
            floors = torch.as_tensor(self._floor[np.repeat(batch.state_slots, batch.query_lens)], device=dev)

            def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
                return self._attend_rows(lid, a, x, positions, slots, tables, sel, pools, floors)
        else:

            def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
                return self._attend(lid, a, x, positions, reqs, sel, pools)

        if batch.encoder_only:
            def source(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
                cstate = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
                for r0, r1, s, slot, table in reqs:
                    self._compress(lid, a, cstate[r0:r1], s, r1 - r0, slot, table)
                return x

            _, counts = self.model.run_layers(tokens, attend, source_only=source, engram_rows=engram_rows)
            for (_, _, s, slot, _), n in zip(reqs, batch.query_lens):
                self._slot_end[slot] = s + int(n)
                self._encoder_only[slot] = True
            empty = np.zeros(0, np.int64)
            return ForwardOutput(logits=torch.zeros(0, self.cfg.vocab_size, dtype=self.dtype, device=dev),
                                 logit_rows=empty, request_of_logit=empty, expert_counts=counts,
                                 snapshots=self._take_snapshots(batch))
        targets = () if self.spec is None else self.spec.drafter.target_layers
        capture: dict[int, torch.Tensor] = dict.fromkeys((*batch.capture_layers, *targets))  # type: ignore[arg-type]
        hidden, counts = self.model.run_layers(tokens, attend, capture=capture, engram_rows=engram_rows)
        rows = batch.logit_rows()
        rows_t = torch.as_tensor(rows, device=dev)
        logits = self.model.logits(hidden[rows_t])
        captured = {lid: capture[lid][rows_t] for lid in batch.capture_layers}
        for (_, _, s, slot, _), n in zip(reqs, batch.query_lens):
            self._slot_end[slot] = s + int(n)
            self._encoder_only[slot] = False
        spec_out = None
        if self.spec is not None:
            slots_rows = torch.as_tensor(np.repeat(batch.state_slots, batch.query_lens), device=dev)
            self.spec.write_context([capture[lid] for lid in targets], positions, slots_rows,
                                    self._last_rows(batch, self.swa_ring))
            spec_out = self.spec.step(batch, logits)
        req_of = np.repeat(np.arange(batch.num_requests), batch.num_logits)
        return ForwardOutput(logits=logits, logit_rows=rows, request_of_logit=req_of, expert_counts=counts,
                             captured=captured, snapshots=self._take_snapshots(batch), **(spec_out or {}))

    # ------------------------------------------------------------------ Engram rows and token context
    def _last_rows(self, b: ForwardBatch, ring: int) -> torch.Tensor:
        """Mask [N] of each request's last ``ring`` rows (the only ones a ring of that size keeps)."""
        return torch.as_tensor(self._last_rows_np(b, ring), device=self.device)

    @staticmethod
    def _last_rows_np(b: ForwardBatch, ring: int) -> np.ndarray:
        return np.arange(b.num_tokens) >= np.repeat(b.offsets[1:], b.query_lens) - ring

    def _engram_rows(self, b: ForwardBatch, tokens: torch.Tensor | None, feed: TokenFeed | None = None,
                     pos: np.ndarray | None = None, row_slots: np.ndarray | None = None) -> dict[int, torch.Tensor]:
        """Fetch this step's Engram rows (n-grams continue each sequence from the slot's token ring),
        then record the step's tokens in the ring: :meth:`_engram_ids`, then the tables' fetch."""
        ids = self._engram_ids(b, tokens, feed, pos, row_slots)
        return {} if ids is None else self.engram_fetch(ids)

    def engram_fetch(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """{layer: rows [T, row_dim]} for hashed row ids [L, T, columns] from this executor's tables (ids
        from the hasher are in range: one-device tables fetch them without the checks that synchronise)."""
        return self.model.engram_fetch(ids, hashed_row_tables(self.engram_tables))

    def _engram_ids(self, b: ForwardBatch, tokens: torch.Tensor | None, feed: TokenFeed | None = None,
                    pos: np.ndarray | None = None, row_slots: np.ndarray | None = None) -> torch.Tensor | None:
        """Hash this step's Engram n-grams (continuing each sequence from the slot's token ring) into row
        ids [L, T, columns] (None without Engram layers), then record the step's tokens in the ring. Runs
        after validation, before any layer. The n-grams are hashed from the host's token ids (``tokens``
        is not read back: no device synchronisation); with a ``feed`` some ids exist only on the device,
        so the step hashes ``tokens`` (the device ids, feed applied) there, and the ring gets those
        entries once the engine has them (:meth:`resolve_fed`)."""
        self.resolve_fed()  # no-op when the engine resolved them (it does before each next step)
        n_ctx = self.cfg.engram_max_ngram - 1
        # each request's n_ctx tokens before its first row (-1 before the sequence start), from its ring
        back = b.start_pos.astype(np.int64)[:, None] - 1 - np.arange(n_ctx)[None, :]
        ctx = np.where(back >= 0, self._tokens[b.state_slots.astype(np.int64)[:, None], back % self.tok_ring], -1)
        ids = None
        if self.cfg.engram_layer_ids:  # hashed in numpy (the batch is validated: ids are in range)
            if feed is None:
                ids = torch.from_numpy(self.model.engram_hasher.hash_host(b.token_ids, b.offsets, ctx))
            else:
                assert tokens is not None
                dev = tokens.device

                if bool((b.query_lens == 1).all()):  # a decode step: the context's part reduced on the host
                    ids = hash_decode_on_device(self.model.engram_hasher, tokens, ctx)
                else:
                    # the batch was validated on the host: the hash's checks would read device tensors back
                    ids = self.model.engram_hasher.hash(tokens, h2d(b.offsets, dev, np.int64), h2d(ctx, dev, np.int64),
                                                        validate=False)
        keep = self._last_rows_np(b, self.tok_ring)
        # ``pos`` / ``row_slots``: b.positions and each row's slot when the caller has them already
        pos = b.positions if pos is None else pos
        row_slots = np.repeat(b.state_slots, b.query_lens).astype(np.int64) if row_slots is None else row_slots
        self._tokens[row_slots[keep], pos[keep] % self.tok_ring] = b.token_ids[keep]
        if feed is not None and feed.index.size:  # placeholders written above: the real ids when known
            k = keep[feed.index]
            fi = feed.index[k]
            self._fed.append((row_slots[fi], pos[fi] % self.tok_ring, TokenFeed(fi, feed.rows[k], feed.src)))
        if self.spec is not None:
            for i in np.flatnonzero(b.start_pos == 0):
                self.spec.restart(int(b.state_slots[i]))
        return ids

    def resolve_fed(self, drop: bool = False) -> None:
        """Write device-fed tokens into the host token ring (waits for their step if the host copy is not
        done). The engine calls it as soon as the previous step's tokens are on the host, before its next
        step can restart a slot (so an entry never lands in a slot handed to another sequence).
        ``drop``: forget them instead (the engine reset: every slot restarts)."""
        for slots, cols, f in [] if drop else self._fed:
            self._tokens[slots, cols] = f.src.host()[f.rows]
        self._fed.clear()

    # ------------------------------------------------------------------ cache writes
    def _store(self, pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, kind: str) -> None:
        """Quantise rows ``x`` and write them to flat ``slots`` of a paged cache."""
        if self.backend is not None:  # check=False: slots come from validated tables (no device sync)
            self.backend.op("kv_store")(pool, x, slots, self._fmt_arg[kind], check=False)
            return
        fmt = getattr(self.fmt, kind)
        pool.view(-1, fmt.bytes_per_token)[slots] = fmt.quantize(x)

    def _ring_store(self, ring: torch.Tensor, x: torch.Tensor, x_bytes: torch.Tensor | None,
                    states: torch.Tensor, positions: torch.Tensor) -> None:
        """Write rows ``x`` (or their already quantised ``x_bytes``) at ``positions % ring`` of ``states``.

        Callers pass at most one row per ring entry (no duplicates in one call).
        """
        if self.backend is not None:
            # the ring slots straight into kv_store (swa_ring_write's range checks and last-writer pass
            # synchronise with the device; callers pass no duplicates and in-range states)
            flat = states.to(torch.int64) * ring.shape[1] + positions.to(torch.int64) % ring.shape[1]
            self.backend.op("kv_store")(ring, x, flat, self._fmt_arg["swa"], check=False)
            return
        ring[states, positions % self.swa_ring] = self.fmt.swa.quantize(x) if x_bytes is None else x_bytes

    # ------------------------------------------------------------------ attention over the caches
    def _slots(self, table: torch.Tensor, idx: torch.Tensor, ratio: int) -> torch.Tensor:
        """Flat cache slots of compressed entries ``idx`` (of a layer of compress ``ratio``) through a block
        table. Entry j sits at logical slot j * ratio / min_ratio, so block b holds only entries of the
        tokens of block b (at every ratio): a prefix hit can share whole blocks (docs/model.md)."""
        lg = idx * ratio // self.min_ratio
        return table[lg // self.block_size] * self.block_size + lg % self.block_size

    # the prefill path (requests with more rows than the row path takes): "tiled" cuts the window attention
    # into query tiles and the indexer / attention rows into pieces of at most prefill_budget bytes of
    # intermediates (model.prefill); "dense" is the plain path, every query against every chunk key
    # through a dense mask (the oracle of the tiled path's tests and the benchmark's baseline)
    prefill_path = "tiled"
    prefill_tile = DEFAULT_TILE
    prefill_budget = DEFAULT_BUDGET
    # the tiled path scores the indexer through the backend's indexer_scores op (the cuda backend's
    # TileLang kernel: fp32 accumulation, no [rows, heads, E] intermediate) for bf16 / fp16 models
    prefill_index_op = True

    def _index_score_op(self) -> Callable[..., torch.Tensor] | None:
        """The backend's ``indexer_scores`` for the tiled prefill, or None (``index_scores`` in torch)."""
        if self.prefill_index_op and self.backend is not None and self.dtype in (torch.bfloat16, torch.float16):
            return self.backend.op("indexer_scores")
        return None

    def _attend(self, lid: int, a: Attention, x: torch.Tensor, positions: torch.Tensor, reqs: list,
                sel: dict, pools: dict) -> torch.Tensor:
        if self.prefill_path not in ("tiled", "dense"):
            raise ValueError(f"prefill_path={self.prefill_path!r}: must be 'tiled' or 'dense'")
        tiled = self.prefill_path == "tiled"
        # the tiled path's small functions run compiled under fuse_glue, as the decode glue does
        with fused_glue(self.fuse_glue and tiled):
            return attend_requests(self, lid, a, x, positions, reqs, sel, pools, tiled)

    def _compress(self, lid: int, a: Attention, new_state: torch.Tensor, s: int, n: int, slot: int,
                  table: torch.Tensor) -> None:
        """Pool the groups this chunk completes into the paged caches; keep the newest per-token state."""
        r = a.ratio
        dm = a.compressor.state_dim
        e0, e1 = s // r, (s + n) // r
        if r > 1:
            ring, cring = self.comp_state[lid], self.comp_ring[lid]
            g0 = e0 * r  # first token of the group that is partial at s
            old = ring[slot, torch.arange(g0, s, device=self.device) % cring]
            st = torch.cat((old, new_state))  # per-token state of positions [g0, s + n)
            keep = slice(max(0, n - cring), n)
            pos = torch.arange(s, s + n, device=self.device)
            ring[slot, pos[keep] % cring] = new_state[keep]
        else:
            st = new_state
        if e1 == e0:
            return
        if self._no_block_writes:  # a replay: these entries are in the (shared) cached blocks already
            return
        whole = st[: (e1 - e0) * r]
        main = a.compressor.pool(whole[:, :dm], e0, a.inv_freq)
        idx = a.index_compressor.pool(whole[:, dm:], e0, a.inv_freq)
        slots = self._slots(table, torch.arange(e0, e1, device=self.device), r)
        self._store(self.kv[lid], main, slots, "main")
        self._store(self.index_keys[lid], idx, slots, "index")

    def _attend_rows(self, lid: int, a: Attention, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     tables: torch.Tensor, sel: dict, pools: dict, floors: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for all rows at once; valid when every request feeds <= backtrack + 1 tokens.

        New SWA keys and compressor states are written to the rings first: a ring of window + backtrack
        (ratio + backtrack) slots then still holds every row's whole window (group), so each row
        gathers its keys from the ring alone.
        """
        cfg, fmt, bs = self.cfg, self.fmt, self.block_size
        w, dev = cfg.sliding_window, self.device
        q, lat = a.queries(x, positions)
        ring = self.swa[lid]
        self._ring_store(ring, a.swa_kv(x, positions), None, slots, positions)
        kp = positions[:, None] - (w - 1) + torch.arange(w, device=dev)[None, :]  # [N, W]
        mask_a = kp >= 0
        if floors is not None:  # truncated windows (bounded replay): keys below the floor do not exist
            mask_a &= kp >= floors[:, int(lid >= cfg.encoder_layers), None]
        k_a = fmt.swa.dequantize(ring[slots[:, None], kp.clamp(min=0) % self.swa_ring]).to(self.dtype)
        if a.kind == LAYER_SWA:
            return sink_attention(q, k_a, mask_a, None, None, a.attn_sink, a.scale)
        r, src = a.ratio, cfg.kv_source_of(lid)
        m = self.min_ratio

        def slot_of(ent: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
            t = tables if rows is None else tables[rows]
            lg = ent * r // m  # the layout of _slots
            return t.gather(1, lg // bs) * bs + lg % bs

        if a.kind == LAYER_FULL:
            st = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
            if r > 1:
                cs, cring = self.comp_state[lid], self.comp_ring[lid]
                cs[slots, positions % cring] = st
            rows = torch.nonzero((positions + 1) % r == 0).flatten()
            if rows.numel():
                pc = positions[rows]
                if r > 1:
                    grp = pc[:, None] - (r - 1) + torch.arange(r, device=dev)[None, :]
                    gs = cs[slots[rows][:, None], grp % cring]
                else:
                    gs = st[rows][:, None]
                ent = (pc + 1) // r - 1
                dm = a.compressor.state_dim
                sl = slot_of(ent[:, None], rows).flatten()
                self._store(self.kv[lid], a.compressor.pool_groups(gs[..., :dm], ent, a.inv_freq), sl, "main")
                self._store(self.index_keys[lid], a.index_compressor.pool_groups(gs[..., dm:], ent, a.inv_freq),
                            sl, "index")
        if a.kind in (LAYER_FULL, LAYER_REINDEX):
            qi, wi = a.indexer(x, lat, positions, a.inv_freq)
            visible = (positions + 1) // r
            ent = torch.arange(int(visible.max()), device=dev)[None, :].expand(x.shape[0], -1)
            flat = self.index_keys[src].view(-1, fmt.index.bytes_per_token)
            ik = fmt.index.dequantize(flat[slot_of(ent)]).to(self.dtype)
            sc = mask_scores(index_scores(qi, wi, ik), ent < visible[:, None])
            sel[lid] = pick_entries(cfg, lid, sc, visible, pools, "rows")
        ids, valid = sel[cfg.index_source_of(lid)]
        flat = self.kv[src].view(-1, fmt.main.bytes_per_token)
        kb = fmt.main.dequantize(flat[slot_of(ids)]).to(self.dtype)
        return sink_attention(q, k_a, mask_a, kb, valid, a.attn_sink, a.scale)


def make_engram_tables(model: DeepSeekV41, placement: str, group: object | None) -> dict[int, object]:
    """The model's Engram tables in the chosen placement (same rows, same values)."""
    if placement not in ("local", "host", "sharded"):
        raise ValueError(f"engram_placement={placement!r}: must be 'local', 'host' or 'sharded'")
    if not model.cfg.engram_layer_ids:
        return {}
    if placement == "local":
        from deepinfer_core.engram import LocalEngramTable

        # "local" = one device, the model's: the default tables are built on the host (seeded CPU draws),
        # so a one-device table elsewhere is copied to the model's device once. Then every step's fetch is
        # a device gather (no host round trip of the rows), and the asynchronous overlap can fetch rows for
        # ids hashed on the device from the previous step's tokens without reading them back
        dev = model.embed.device
        return {lid: t.to(dev) if type(t) is LocalEngramTable and t.device != dev else t
                for lid, t in model.engram_tables.items()}
    from deepinfer_core.engram import HostEngramTable, ShardedEngramTable, shard_range

    out: dict[int, object] = {}
    for lid, t in model.engram_tables.items():
        data, scales = t.data, getattr(t, "scales", None)
        if placement == "host":
            out[lid] = HostEngramTable(data, scales, device=model.embed.device, out_dtype=torch.float32)
        else:
            import torch.distributed as dist

            world, rank = dist.get_world_size(group), dist.get_rank(group)  # type: ignore[arg-type]
            a, z = shard_range(data.shape[0], world, rank)
            out[lid] = ShardedEngramTable(data[a:z], None if scales is None else scales[a:z], data.shape[0],
                                          group, out_dtype=torch.float32)  # type: ignore[arg-type]
    return out
