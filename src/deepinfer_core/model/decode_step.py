"""The executor's row path: decode / verify steps, every request feeding <= backtrack + 1 tokens.

New SWA keys and compressor states are written to the rings first: a ring of window + backtrack (ratio +
backtrack) slots then still holds every row's whole window (group), so each row gathers its keys from the
ring alone and attention runs on all rows at once (no per-request loop). One path for every device,
written so that the device never waits for the host and the host never waits for the device inside a
step, which is also what makes a step capturable in a CUDA graph (:mod:`deepinfer_core.model.cuda_graphs`):

- everything data-dependent is decided on the host from the batch (numpy) before the step: the number
  of compressed entries the indexer scores per ratio (:func:`entries_needed`), the rows' slots, tables
  and floors; inputs go to the device with non-blocking copies;
- no ``nonzero`` / ``.item()`` / ``.tolist()`` / ``bincount`` in the layers: the compressor pools every
  row and writes only the rows that complete a group (slot -1 = skipped, the KV kernels' padding
  contract), the candidate pool forces partial blocks with a scatter;
- cache reads and writes go through :class:`~deepinfer_core.model.state.ExecutorState`'s ``gather`` /
  ``store`` (the backend's ``kv_gather`` / ``kv_store`` ops with the checks off, which would synchronise:
  the executor validated the batch on the host; plain torch without a backend).

With ``ExecutorState.sync_free`` (a backend on a CUDA device) the MoE also runs in static mode
(:func:`~deepinfer_core.model.layers.moe.static_shapes`) and the opt-in kernels apply; the results equal
the plain mode's up to summation order (the MoE's grouped products; tested), with the same cache bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, cast

import attrs
import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed, h2d
from deepinfer_core.model.attend import attend_layer
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.config import LAYER_SWA
from deepinfer_core.model.engram_context import engram_fetch, engram_ids
from deepinfer_core.model.fusion import fusable, fused_glue
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import index_scores, mask_scores, pick_entries
from deepinfer_core.model.layers.moe import grouped_gemm_impl, static_shapes
from deepinfer_core.model.layers.rope import cached_angles
from deepinfer_core.model.mhc import sinkhorn_impl
from deepinfer_core.model.state import ExecutorState, last_rows

StepOutputs = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]  # logits, expert counts, target states


class GraphRunner(Protocol):
    """Replays pure-decode and verify steps (:func:`is_graph_step`) from captured graphs
    (``cuda_graphs.DecodeGraphs``; a protocol: that module imports this one)."""

    def run(
        self,
        b: ForwardBatch,
        floors: np.ndarray,
        entries: dict[int, int],
        engram_ids: torch.Tensor | None,
        tokens: torch.Tensor | None = None,
    ) -> StepOutputs | None: ...


@attrs.define
class DecodeInputs:
    """The static device inputs of one graph (views into one int64 buffer) plus the Engram rows."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    floors: torch.Tensor
    valid: torch.Tensor | None  # int64, 1 for a real request, 0 for a padded row (None: all real)
    tables: torch.Tensor
    engram: dict[int, torch.Tensor]
    entries: dict[int, int]
    # hashed Engram row ids [L, N, C], fetched inside the step (a graph's static input; then ``engram``
    # is empty), or None: the rows are in ``engram``
    engram_ids: torch.Tensor | None = None


def is_pure_decode(b: ForwardBatch) -> bool:
    """One new token and one logits row per request, nothing else asked of the step (drafting after it
    is allowed: the drafter runs eagerly on the replay's outputs).

    Snapshots are allowed too: a one-token row's snapshot position can only be ``start + 1`` (the batch
    validates ``snapshot_pos`` in ``(start, start + query_len]``), the ring state right after the step, which
    ``take_snapshots`` copies after the replay as it does after an eager row step. With prefix caching a
    decode row asks for one at every block boundary; in a batch of requests that started together that is
    every ``block_size``-th step, which used to run eagerly (at B = 64 on the tiny model ~9 ms a step on
    average, more than the graph's own time)."""
    return (
        not b.encoder_only
        and not b.capture_layers
        and bool((b.query_lens == 1).all())
        and bool((b.num_logits == 1).all())
        and (b.verify_lens is None or not b.verify_lens.any())
    )


def is_graph_step(b: ForwardBatch) -> bool:
    """A row-path step a captured graph can run (:mod:`~deepinfer_core.model.cuda_graphs`, keyed by its
    row count): every row is a logits row (``num_logits == query_lens``), nothing else asked of it. That is
    a pure-decode step, and also a speculative verify step (each request feeds its last token and its
    drafts, all scored); the verification and the next drafts run eagerly on the replay's logits and
    target states, as the drafter does after a pure-decode replay. Snapshots are the rings after the step
    for any row-path step (``ExecutorState.take_snapshots``), so they are allowed as for pure decode."""
    return (
        not b.encoder_only
        and not b.capture_layers
        and b.num_logits.shape == b.query_lens.shape
        and bool((b.num_logits == b.query_lens).all())
    )


def entries_needed(st: ExecutorState, positions: np.ndarray) -> dict[int, int]:
    """Compressed entries the indexer scores, per compress ratio of an indexing layer: the most any row
    sees, max((position + 1) // ratio) (computed on the host: no device readback)."""
    if not positions.size:
        return dict.fromkeys(st.entry_ratios, 0)
    top = int(positions.max()) + 1  # max((p + 1) // r) == (max(p) + 1) // r: floor division is monotone
    return {r: top // r for r in st.entry_ratios}


# The step's index arithmetic, built once a step (attend_rows' ``once``) as fused functions: under the
# glue each is one or two kernels instead of ~10 small int64 ones. Integer maths: the same values
# compiled or not.


def slot_of(tables: torch.Tensor, ent: torch.Tensor, r: int, m: int, bs: int) -> torch.Tensor:
    """Flat cache slots of compressed entries ``ent`` [N, K] (>= 0) of ratio ``r`` (the layout of
    ``ExecutorState.entry_slots``: entry j at logical slot j * r / m of the row's block table)."""
    lg = ent if r == m else ent * r // m
    # columns past a row's table only serve masked entries (padded counts): clamp, do not index out
    return tables.gather(1, (lg // bs).clamp(max=tables.shape[1] - 1)) * bs + lg % bs


@fusable
def window_index(
    positions: torch.Tensor,
    slots: torch.Tensor,
    floors: torch.Tensor,
    valid: torch.Tensor | None,
    w: int,
    rl: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(SWA ring slot of each row's new key [N] (-1 on padded rows), ring slots of its window [N, W],
    the window's masks [N, W] against the encoder / decoder floors, the row each row's compressor-state
    write takes its values from [N] (padded rows: row 0; None without padding))."""
    put = slots * rl + positions % rl
    kp = positions[:, None] - (w - 1) + torch.arange(w, device=positions.device)[None, :]  # [N, W]
    ring = slots[:, None] * rl + kp.clamp(min=0) % rl
    seen = kp >= 0
    masks = (seen & (kp >= floors[:, 0, None]), seen & (kp >= floors[:, 1, None]))
    if valid is None:
        return put, ring, *masks, None
    rows = torch.where(valid, torch.arange(positions.shape[0], device=positions.device), 0)
    return torch.where(valid, put, -1), ring, *masks, rows


@fusable
def ring_index(
    positions: torch.Tensor, slots: torch.Tensor, src_row: torch.Tensor | None, cring: int, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(compressor-state ring slot each row writes [N] (a padded row: row 0's, see :func:`window_index`),
    ring slots of each row's group of ``r`` tokens [N, r]), for a ring of ``cring`` per slot."""
    tgt = slots * cring + positions % cring
    grp = positions[:, None] - (r - 1) + torch.arange(r, device=positions.device)[None, :]
    return tgt if src_row is None else tgt[src_row], slots[:, None] * cring + grp % cring


@fusable
def entry_index(
    positions: torch.Tensor, tables: torch.Tensor, valid: torch.Tensor | None, e: int, r: int, m: int, bs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ratio's entries for a step that scores ``e`` of them: (visible count [N], slots of entries
    0..e-1 [N, e], which of them each row sees [N, e], the entry a row's group completes [N] (clamped to
    >= 0), its slot [N] (-1 when the row completes no group or is padded))."""
    p1 = positions + 1
    visible = p1 // r
    ent = torch.arange(e, device=positions.device)[None, :].expand(positions.shape[0], -1)
    table = slot_of(tables, ent, r, m, bs)
    done = p1 % r == 0  # rows that complete a group
    if valid is not None:
        done = done & valid
    last = (visible - 1).clamp(min=0)
    # last <= max((p + 1) // r) - 1 < e: inside the table whenever it has a column (one gather, no slot_of)
    put = table.gather(1, last[:, None]) if e > 0 else slot_of(tables, last[:, None], r, m, bs)
    return visible, table, ent < visible[:, None], last, torch.where(done, put[:, 0], -1)


class RowAttention:
    """One layer's attention for every row of a row-path step (an ``attend.AttendPath``). Index tensors
    that every layer of the step shares (same rows) are built once a step, in ``pools["index"]``."""

    def __init__(
        self,
        st: ExecutorState,
        lid: int,
        a: Attention,
        x: torch.Tensor,
        inp: DecodeInputs,
        sel: dict,
        pools: dict,
        valid: torch.Tensor | None,
    ) -> None:
        self.st, self.lid, self.a, self.inp, self.sel, self.pools, self.valid = (
            st,
            lid,
            a,
            inp,
            sel,
            pools,
            valid,
        )
        self.cfg = st.cfg
        self.n = x.shape[0]
        # the projections of x (query latent, SWA key, compressor state, indexer weights) as one packed GEMM
        self.xp = a.input_products(x)
        self.q, self.lat = a.queries_from(self.xp["q"], inp.positions)
        self.memo: dict[tuple, Any] = pools.setdefault("index", {})
        self.ring = st.swa[lid]
        self.swa_put, self.ring_slots, mask_enc, mask_dec, self.src_row = self.once(
            ("swa",),
            lambda: window_index(
                inp.positions, inp.slots, inp.floors, valid, self.cfg.sliding_window, st.swa_ring
            ),
        )
        self.enc = int(lid >= self.cfg.encoder_layers)
        self.mask_a = mask_dec if self.enc else mask_enc
        # the fused attention reads one key buffer: window and top-k keys gathered into it (no concatenation)
        self.one_buffer = st.fused_attention and a.kind != LAYER_SWA
        self.r, self.src, self.m = a.ratio, self.cfg.kv_source_of(lid), st.min_ratio

    def once(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def ratio_index(self) -> tuple[torch.Tensor, ...] | None:
        """:func:`entry_index` of this ratio, once a step (None when the step scores none of its entries)."""
        inp, r = self.inp, self.r
        if r not in inp.entries:
            return None
        return self.once(
            ("entries", r),
            lambda: entry_index(
                inp.positions, inp.tables, self.valid, inp.entries[r], r, self.m, self.st.block_size
            ),
        )

    def window_keys(self) -> torch.Tensor:
        return self.st.gather(self.ring, self.ring_slots, "swa", self.cfg.head_dim)

    def write_window(self) -> None:
        # new SWA keys first: the ring (window + backtrack) then holds every row's whole window
        self.st.store(self.ring, self.a.swa_kv_from(self.xp["kv"], self.inp.positions), self.swa_put, "swa")

    def attend_window(self) -> torch.Tensor:
        return attention(self.st, self.a, self.q, self.window_keys(), self.mask_a, None, None)

    def compress(self) -> None:
        st, a, inp, r = self.st, self.a, self.inp, self.r
        state = self.xp["comp"]  # = cat(compressor.project(x), index_compressor.project(x))
        if r > 1:
            cs, cring = st.comp_state[self.lid], st.comp_ring[self.lid]
            flat_cs = cs.view(-1, cs.shape[-1])
            tgt, grp = self.once(
                ("ring", cring, r), lambda: ring_index(inp.positions, inp.slots, self.src_row, cring, r)
            )
            # padded rows repeat row 0's write (same index, same values: no race)
            flat_cs[tgt] = state if self.src_row is None else state[self.src_row]
            gs = flat_cs[grp]  # [N, r, width]
        else:
            gs = state[:, None]
        idx = self.ratio_index()
        assert idx is not None  # a Full layer indexes: entries_needed counts its ratio
        _, _, _, ent, slots = idx
        dm = a.compressor.state_dim
        st.store(st.kv[self.lid], a.compressor.pool_groups(gs[..., :dm], ent, a.inv_freq), slots, "main")
        st.store(
            st.index_keys[self.lid],
            a.index_compressor.pool_groups(gs[..., dm:], ent, a.inv_freq),
            slots,
            "index",
        )

    def select(self) -> None:
        cfg, a, src = self.cfg, self.a, self.src
        assert src is not None
        qi, wi = a.indexer.from_products(self.xp["iw"], self.lat, self.inp.positions, a.inv_freq)
        idx = self.ratio_index()
        assert idx is not None
        visible, ent_slots, seen = idx[:3]
        ik = self.st.gather(self.st.index_keys[src], ent_slots, "index", cfg.index_head_dim)
        self.sel[self.lid] = pick_entries(
            cfg, self.lid, mask_scores(index_scores(qi, wi, ik), seen), visible, self.pools, "rows"
        )

    def topk_slots(self, isrc: int, ids: torch.Tensor) -> torch.Tensor:
        # the index source scored this ratio's E entries (ids in [0, E)): a gather from the entry table
        idx = self.ratio_index() if self.cfg.ratio(isrc) == self.r else None
        if idx is None or idx[1].shape[1] == 0:
            return slot_of(self.inp.tables, ids, self.r, self.m, self.st.block_size)
        return idx[1].gather(1, ids)

    def attend_compressed(self) -> torch.Tensor:
        st, cfg, src = self.st, self.cfg, self.src
        assert src is not None
        isrc = cfg.index_source_of(self.lid)
        assert isrc is not None
        ids, ok = self.sel[isrc]
        # layers sharing an index source (and so a ratio) pick the same entries: their slots once a step
        kslots = self.once(("topk_slots", isrc, self.r), lambda: self.topk_slots(isrc, ids))
        if self.one_buffer:
            w = cfg.sliding_window
            keys = torch.empty(self.n, w + ids.shape[1], cfg.head_dim, dtype=st.dtype, device=st.device)
            st.gather(self.ring, self.ring_slots, "swa", cfg.head_dim, out=keys, col=0)
            st.gather(st.kv[src], kslots, "main", cfg.head_dim, out=keys, col=w)
            mask = self.once(("mask_ab", self.enc, isrc), lambda: torch.cat([self.mask_a, ok], 1))
            return attention(st, self.a, self.q, keys, mask, None, None)
        kb = st.gather(st.kv[src], kslots, "main", cfg.head_dim)
        return attention(st, self.a, self.q, self.window_keys(), self.mask_a, kb, ok)


def attend_rows(
    st: ExecutorState,
    lid: int,
    a: Attention,
    x: torch.Tensor,
    inp: DecodeInputs,
    sel: dict,
    pools: dict,
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """Layer ``lid``'s attention for every row of the step (the row path's ``attend``)."""
    return attend_layer(a.kind, RowAttention(st, lid, a, x, inp, sel, pools, valid))


def attention(
    st: ExecutorState,
    a: Attention,
    q: torch.Tensor,
    k_a: torch.Tensor,
    mask_a: torch.Tensor,
    kb: torch.Tensor | None,
    ok: torch.Tensor | None,
) -> torch.Tensor:
    """The layer's attention over the gathered window (and top-k) keys: :func:`sink_attention`, or with
    ``fused_attention`` the backend's ``sink_attention_rows`` (one kernel; same contract)."""
    if st.fused_attention and st.backend is not None:
        return st.backend.op("sink_attention_rows")(q, k_a, mask_a, kb, ok, a.attn_sink, a.scale)
    return sink_attention(q, k_a, mask_a, kb, ok, a.attn_sink, a.scale)


def step_contexts(st: ExecutorState, valid: torch.Tensor | None) -> contextlib.ExitStack:
    """The contexts a row step's layers run in: the MoE's static mode when sync-free (``valid`` marks the
    rows its expert counts include), the opt-in kernels (``fused_sinkhorn``: the mHC Sinkhorn as one
    kernel per layer, which the fused glue uses too; ``fused_moe``: the expert products as the backend's
    grouped GEMM), RoPE angles once per step, and the compiled glue (``fuse_glue``, model.fusion)."""
    be = st.backend
    fused = be.op("mhc_sinkhorn") if (st.fused_sinkhorn or st.fuse_glue) and be is not None else None
    grouped = be.op("moe_grouped_gemm") if st.fused_moe and be is not None else None
    stack = contextlib.ExitStack()
    for ctx in (
        static_shapes(on=st.sync_free, row_mask=valid),
        sinkhorn_impl(fused),
        grouped_gemm_impl(grouped),
        cached_angles(),
        fused_glue(st.fuse_glue),
    ):
        stack.enter_context(ctx)
    return stack


def decode_body(
    st: ExecutorState,
    inp: DecodeInputs,
    capture_ids: tuple[int, ...] = (),
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The device part of a row-path step: (logits of ``logit_rows`` (all rows when None), expert counts,
    {layer: output state [N, D]} for ``capture_ids``). Reads only ``inp``; no host synchronisation."""
    valid = None if inp.valid is None else inp.valid > 0
    sel: dict = {}
    pools: dict = {}
    # run_layers fills a state for every key it is given
    capture = cast(dict[int, torch.Tensor], dict.fromkeys(capture_ids))
    rows = inp.engram if inp.engram_ids is None else engram_fetch(st, inp.engram_ids)
    with step_contexts(st, valid):
        hidden, counts = st.model.run_layers(
            inp.tokens,
            lambda lid, a, x: attend_rows(st, lid, a, x, inp, sel, pools, valid),
            capture=capture,
            engram_rows=rows,
        )
    h = hidden if logit_rows is None else hidden[logit_rows]
    if st.fused_head and st.backend is not None:
        # the LM head as the grouped GEMM kernel with one group (the offsets on the device: a fill, no host
        # copy); the same product as ``model.logits``
        end = torch.full((1,), h.shape[0], dtype=torch.int32, device=h.device)
        return st.backend.op("moe_grouped_gemm")(h, st.model.head_weight[None], end), counts, capture
    return st.model.logits(h), counts, capture


def execute_rows(
    st: ExecutorState, b: ForwardBatch, feed: TokenFeed | None = None, graphs: GraphRunner | None = None
) -> ForwardOutput:
    """A validated row-path step; a pure-decode batch replays a captured graph when ``graphs`` is given
    and a bucket holds it. ``feed``: input tokens still on the device (the previous step's samples),
    written into the token input after its host copy."""

    def put(arr: np.ndarray) -> torch.Tensor:  # no stream synchronisation (torch syncs blocking copies)
        return h2d(arr, st.device, np.int64)

    pos = b.positions
    slots_np = np.repeat(b.state_slots, b.query_lens)
    floors_np = st.floor[slots_np]
    entries = entries_needed(st, pos)
    tok_t = None
    if feed is not None:  # the host ids hold placeholders there: the real ones come from the device
        tok_t = put(b.token_ids)
        feed.apply(tok_t)
    ids = engram_ids(st, b, tok_t, feed, pos=pos, row_slots=slots_np)  # records the token ring
    targets = () if st.spec is None else tuple(st.spec.drafter.target_layers)
    got = graphs.run(b, floors_np, entries, ids, tok_t) if graphs is not None and is_graph_step(b) else None
    rows = b.logit_rows()
    if got is not None:
        logits, counts, tstates = got
        caps = dict(zip(targets, tstates))
        captured: dict[int, torch.Tensor] = {}
    else:
        req_of_row = np.repeat(np.arange(b.num_requests), b.query_lens)
        inp = DecodeInputs(
            tokens=put(b.token_ids) if tok_t is None else tok_t,
            positions=put(pos),
            slots=put(slots_np),
            floors=put(floors_np),
            valid=None,
            tables=put(b.block_tables[req_of_row]),
            engram={} if ids is None else engram_fetch(st, ids),
            entries=entries,
        )
        rows_t = None if rows.shape[0] == b.num_tokens else put(rows)
        logits, counts, caps = decode_body(st, inp, (*b.capture_layers, *targets), rows_t)
        captured = {lid: caps[lid] if rows_t is None else caps[lid][rows_t] for lid in b.capture_layers}
    st.slot_end[b.state_slots] = b.start_pos + b.query_lens
    st.encoder_only[b.state_slots] = False
    spec_out = None
    if st.spec is not None:
        keep = put(np.flatnonzero(last_rows(b, st.swa_ring)))  # an index, not a mask (no nonzero())
        st.spec.write_context([caps[lid] for lid in targets], put(pos), put(slots_np), keep)
        spec_out = st.spec.step(b, logits)
    req_of = np.repeat(np.arange(b.num_requests), b.num_logits)
    return ForwardOutput(
        logits=logits,
        logit_rows=rows,
        request_of_logit=req_of,
        expert_counts=counts,
        captured=captured,
        snapshots=st.take_snapshots(b),
        **(spec_out or {}),
    )
