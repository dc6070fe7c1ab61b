"""The prefill's attention maths in bounded pieces (``ModelExecutor`` with ``prefill_path="tiled"``).

The plain per-request path materialises, for a chunk of n tokens, the window logits of every query
against every chunk key ([n, H, n]), the indexer's per-head scores of every query against every
compressed entry ([n, index_heads, E]) and a full sort of [n, E], and gathers the top-k compressed keys of
all n rows at once ([n, top-k, d]). Here:

- the window attention runs in query tiles (:mod:`~deepinfer_core.model.layers.window_attention`);
- rows are processed in pieces whose intermediates fit a memory ``budget`` (bytes): indexer scores,
  masks, the candidate pool and the top-k of one piece of rows at a time, then the attention of one piece
  at a time with only that piece's compressed keys gathered;
- a piece of indexer rows scores only the entries its last row can see ((s + c1) // ratio: the causal
  half of the matrix is never computed), and its selection is padded to the dense width exactly as the
  stable sort over all E entries orders it (masked entries follow in index order), so ids and validity
  equal :func:`~deepinfer_core.model.layers.indexer.pick_entries` on the whole matrix;
- ``keyed`` picks the top-k with ``torch.topk`` over distinct int64 keys
  (:func:`~deepinfer_core.model.layers.indexer.select_topk_keyed`, identical to the stable sort).

Every row's maths is the dense path's; only the summation order of GEMMs differs (float64 tests hold it to
1e-9 of the dense path and of ``DeepSeekV41.forward_full``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import numpy as np
import torch
from torch.profiler import record_function

from deepinfer_core.device_tokens import TokenFeed
from deepinfer_core.model.attend import attend_layer
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX
from deepinfer_core.model.engram_context import engram_rows
from deepinfer_core.model.fusion import fused_glue
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import index_scores, mask_scores, pick_entries
from deepinfer_core.model.model import AttendFn
from deepinfer_core.model.prefill_plan import ATTENTION_RANGE, INDEXER_RANGE, LAYER_RANGE, make_plan
from deepinfer_core.model.prefill_tiled import attend_request, rows_per_piece, select_entries
from deepinfer_core.model.prefill_varlen import varlen_attend, varlen_source
from deepinfer_core.model.state import DEFAULT_BUDGET, DEFAULT_TILE, ExecutorState, last_rows

# attend_request, rows_per_piece and select_entries (the tiled maths) live in prefill_tiled, the profiler
# ranges in prefill_plan; all stay importable from here
__all__ = [
    "ATTENTION_RANGE",
    "DEFAULT_BUDGET",
    "DEFAULT_TILE",
    "INDEXER_RANGE",
    "LAYER_RANGE",
    "attend_prefill",
    "attend_request",
    "execute_requests",
    "rows_per_piece",
    "select_entries",
]


# the prefill paths (ModelExecutor.prefill_path)
PREFILL_PATHS = ("varlen", "tiled", "dense")

# (first row, end row, start position, state slot, block table)
Request = tuple[int, int, int, int, torch.Tensor]


class RequestAttention:
    """One layer's attention for one request of a prefill step (an ``attend.AttendPath``): queries, window
    keys from the ring history + the chunk, ring writes and snapshots, compression, the indexer's selection
    and the attention; ``tiled`` picks this module's tiled maths or the dense path's (``sink_attention``
    over dense masks, ``pick_entries`` on whole matrices). ``rows``: the layer's products for all of the
    step's rows (:func:`layer_rows`)."""

    # the window's keys: ring history then the chunk's (set by write_window, which runs first)
    keys_a: torch.Tensor
    mask_a: torch.Tensor  # the dense path's window mask (idem)

    def __init__(
        self,
        st: ExecutorState,
        lid: int,
        a: Attention,
        i: int,
        req: Request,
        positions: torch.Tensor,
        rows: dict[str, torch.Tensor],
        sel: dict,
        pools: dict,
        tiled: bool,
    ) -> None:
        self.st, self.lid, self.a, self.i, self.rows, self.sel, self.pools, self.tiled = (
            st,
            lid,
            a,
            i,
            rows,
            sel,
            pools,
            tiled,
        )
        self.cfg = st.cfg
        self.r0, self.r1, self.s, self.slot, self.table = req
        self.n = self.r1 - self.r0
        self.qp = positions[self.r0 : self.r1]
        self.q = rows["q"][self.r0 : self.r1]
        self.src = self.cfg.kv_source_of(lid)
        self.floor = int(st.floor[self.slot, int(lid >= self.cfg.encoder_layers)])
        # the first history position the ring can serve
        self.h0 = max(0, self.s - (self.cfg.sliding_window - 1), min(self.floor, self.s))

    def write_window(self) -> None:
        st, cfg, r0, r1, s, slot = self.st, self.cfg, self.r0, self.r1, self.s, self.slot
        w = cfg.sliding_window
        ring = st.swa[self.lid]
        hist = torch.arange(self.h0, s, device=st.device)
        k_hist = st.fmt.swa.dequantize(ring[slot, hist % st.swa_ring]).to(st.dtype)
        self.keys_a = torch.cat((k_hist, self.rows["kswa"][r0:r1]))
        if not self.tiled:
            kp, qp = torch.cat((hist, self.qp)), self.qp
            self.mask_a = (
                (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - w) & (kp[None, :] >= self.floor)
            )
        swa_bytes = self.rows["swa_bytes"][r0:r1]
        if self.i in st.snap_at and self.lid < cfg.encoder_layers:  # the ring as it is at position X
            x_at = st.snap_at[self.i]
            snap = ring[slot].clone()
            sp = torch.arange(max(s, x_at - st.swa_ring), x_at, device=st.device)
            snap[sp % st.swa_ring] = swa_bytes[sp - s]
            st.snaps.setdefault(self.i, []).append(snap)
        keep = slice(max(0, self.n - st.swa_ring), self.n)
        st.ring_store(
            ring,
            self.rows["swa"][r0:r1][keep],
            swa_bytes[keep],
            torch.full_like(self.qp[keep], slot),
            self.qp[keep],
        )

    def attend(
        self,
        compressed: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        n_compressed: int = 0,
    ) -> torch.Tensor:
        a, st = self.a, self.st
        with record_function(ATTENTION_RANGE):
            if self.tiled:
                return attend_request(
                    self.q,
                    self.keys_a,
                    self.h0,
                    self.s,
                    self.cfg.sliding_window,
                    self.floor,
                    a.attn_sink,
                    a.scale,
                    compressed,
                    n_compressed,
                    st.prefill_tile,
                    st.prefill_budget,
                )
            kb, valid = compressed(0, self.n) if compressed is not None else (None, None)
            return sink_attention(self.q, self.keys_a, self.mask_a, kb, valid, a.attn_sink, a.scale)

    def attend_window(self) -> torch.Tensor:
        return self.attend()

    def compress(self) -> None:
        compress(
            self.st,
            self.lid,
            self.a,
            self.rows["cstate"][self.r0 : self.r1],
            self.s,
            self.n,
            self.slot,
            self.table,
        )

    def select(self) -> None:
        st, cfg, a, r0, r1, src = self.st, self.cfg, self.a, self.r0, self.r1, self.src
        assert src is not None
        e_total = (self.s + self.n) // a.ratio
        with record_function(INDEXER_RANGE):
            ent = torch.arange(e_total, device=st.device)
            flat = st.index_keys[src].view(-1, st.fmt.index.bytes_per_token)
            ik = st.fmt.index.dequantize(flat[st.entry_slots(self.table, ent, a.ratio)]).to(st.dtype)
            qi, wi = self.rows["qi"][r0:r1], self.rows["wi"][r0:r1]
            if self.tiled:
                self.sel[(self.lid, self.i)] = select_entries(
                    cfg,
                    self.lid,
                    qi,
                    wi,
                    ik,
                    self.s,
                    a.ratio,
                    self.pools,
                    self.i,
                    st.prefill_budget,
                    score_op=st.index_score_op(),
                )
            else:
                visible = (self.qp + 1) // a.ratio
                sc = mask_scores(index_scores(qi, wi, ik), ent[None, :] < visible[:, None])
                self.sel[(self.lid, self.i)] = pick_entries(cfg, self.lid, sc, visible, self.pools, self.i)

    def attend_compressed(self) -> torch.Tensor:
        st, cfg, a, src = self.st, self.cfg, self.a, self.src
        assert src is not None
        isrc = cfg.index_source_of(self.lid)
        assert isrc is not None
        ids, valid = self.sel[(isrc, self.i)]
        flat = st.kv[src].view(-1, st.fmt.main.bytes_per_token)
        gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
        if self.tiled and cfg.ratio(isrc) == a.ratio:  # ids index this layer's entries
            # dequantise the request's entries once, then gather rows of keys: the same values as
            # dequantising each gathered row (the codec is per entry), ~512x fewer codec passes at top-k 512
            e_total = (self.s + self.n) // a.ratio
            slots = st.entry_slots(self.table, torch.arange(e_total, device=st.device), a.ratio)
            table_keys = st.fmt.main.dequantize(flat[slots]).to(st.dtype)
            gather = functools.partial(_pick_keys, table_keys, ids, valid)
        else:
            gather = functools.partial(_gather_compressed, st, flat, self.table, ids, valid, a.ratio)
        return self.attend(gather, ids.shape[1])


def layer_rows(
    st: ExecutorState, a: Attention, x: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A layer's products for all rows of a prefill step: queries and their latent, the SWA keys (raw, as
    ring bytes, and as the ring will read them back), the compressor state (Full) and the indexer's
    queries and weights (Full / Reindex)."""
    q, lat = a.queries(x, positions)
    raw_swa = a.swa_kv(x, positions)
    swa_bytes = st.fmt.swa.quantize(raw_swa)
    rows = {
        "q": q,
        "swa": raw_swa,
        "swa_bytes": swa_bytes,
        "kswa": st.fmt.swa.dequantize(swa_bytes).to(st.dtype),
    }  # attend to exactly what the ring will hold
    if a.kind == LAYER_FULL:
        rows["cstate"] = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
    if a.kind in (LAYER_FULL, LAYER_REINDEX):
        rows["qi"], rows["wi"] = a.indexer(x, lat, positions, a.inv_freq)
    return rows


def attend_requests(
    st: ExecutorState,
    lid: int,
    a: Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    reqs: list[Request],
    sel: dict,
    pools: dict,
    tiled: bool,
) -> torch.Tensor:
    """Layer ``lid``'s attention for the prefill requests ``reqs`` of a step, request by request."""
    rows = layer_rows(st, a, x, positions)
    return torch.cat(
        [
            attend_layer(a.kind, RequestAttention(st, lid, a, i, req, positions, rows, sel, pools, tiled))
            for i, req in enumerate(reqs)
        ]
    )


def attend_prefill(
    st: ExecutorState,
    lid: int,
    a: Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    reqs: list[Request],
    sel: dict,
    pools: dict,
) -> torch.Tensor:
    """The per-request path's ``attend`` (``prefill_path``: "tiled", or "dense": every query against every
    chunk key through a dense mask, the oracle of the tiled path's tests and the benchmark's baseline)."""
    if st.prefill_path not in ("tiled", "dense"):
        raise ValueError(f"prefill_path={st.prefill_path!r}: the per-request paths are 'tiled' and 'dense'")
    tiled = st.prefill_path == "tiled"
    # the tiled path's small functions run compiled under fuse_glue, as the decode glue does
    with fused_glue(st.fuse_glue and tiled):
        return attend_requests(st, lid, a, x, positions, reqs, sel, pools, tiled)


def compress(
    st: ExecutorState,
    lid: int,
    a: Attention,
    new_state: torch.Tensor,
    s: int,
    n: int,
    slot: int,
    table: torch.Tensor,
) -> None:
    """Pool the groups a chunk completes into the paged caches; keep the newest per-token state."""
    r = a.ratio
    dm = a.compressor.state_dim
    e0, e1 = s // r, (s + n) // r
    if r > 1:
        ring, cring = st.comp_state[lid], st.comp_ring[lid]
        g0 = e0 * r  # first token of the group that is partial at s
        old = ring[slot, torch.arange(g0, s, device=st.device) % cring]
        state = torch.cat((old, new_state))  # per-token state of positions [g0, s + n)
        keep = slice(max(0, n - cring), n)
        pos = torch.arange(s, s + n, device=st.device)
        ring[slot, pos[keep] % cring] = new_state[keep]
    else:
        state = new_state
    if e1 == e0 or st.no_block_writes:  # a replay: these entries are in the (shared) cached blocks already
        return
    whole = state[: (e1 - e0) * r]
    main = a.compressor.pool(whole[:, :dm], e0, a.inv_freq)
    idx = a.index_compressor.pool(whole[:, dm:], e0, a.inv_freq)
    slots = st.entry_slots(table, torch.arange(e0, e1, device=st.device), r)
    st.store(st.kv[lid], main, slots, "main")
    st.store(st.index_keys[lid], idx, slots, "index")


def execute_requests(st: ExecutorState, b: ForwardBatch, feed: TokenFeed | None = None) -> ForwardOutput:
    """A validated step on the prefill paths (prefill chunks, encoder-only steps, the row path off)."""
    dev = st.device
    tokens = torch.as_tensor(b.token_ids, device=dev)
    if feed is not None:
        # a copy: on the CPU as_tensor shares the host array, which must keep its placeholders
        tokens = tokens.clone()
        feed.apply(tokens)
    positions = torch.as_tensor(b.positions, device=dev)
    rows = engram_rows(st, b, tokens, feed)
    attend, source = step_attention(st, b, positions)
    if b.encoder_only:
        return _encoder_only(st, b, tokens, attend, source, rows)
    targets = () if st.spec is None else st.spec.drafter.target_layers
    # run_layers fills a state for every key it is given
    capture = cast(dict[int, torch.Tensor], dict.fromkeys((*b.capture_layers, *targets)))
    hidden, counts = st.model.run_layers(tokens, attend, capture=capture, engram_rows=rows)
    logit_rows = b.logit_rows()
    rows_t = torch.as_tensor(logit_rows, device=dev)
    logits = st.model.logits(hidden[rows_t])
    st.slot_end[b.state_slots] = b.start_pos + b.query_lens
    st.encoder_only[b.state_slots] = False
    spec_out = None
    if st.spec is not None:
        slots_rows = torch.as_tensor(np.repeat(b.state_slots, b.query_lens), device=dev)
        keep = torch.as_tensor(last_rows(b, st.swa_ring), device=dev)
        st.spec.write_context([capture[lid] for lid in targets], positions, slots_rows, keep)
        spec_out = st.spec.step(b, logits)
    return ForwardOutput(
        logits=logits,
        logit_rows=logit_rows,
        request_of_logit=np.repeat(np.arange(b.num_requests), b.num_logits),
        expert_counts=counts,
        captured={lid: capture[lid][rows_t] for lid in b.capture_layers},
        snapshots=st.take_snapshots(b),
        **(spec_out or {}),
    )


def step_attention(st: ExecutorState, b: ForwardBatch, positions: torch.Tensor) -> tuple[AttendFn, AttendFn]:
    """The step's ``attend`` and (an encoder-only step's) ``source_only`` on ``st.prefill_path``: "varlen"
    (every request at once: :mod:`~deepinfer_core.model.prefill_varlen`), or request by request, "tiled"
    or "dense" (:class:`RequestAttention`)."""
    if st.prefill_path == "varlen":
        # the index plan of the whole step, once (one host-to-device copy); the indexer's widths count
        # the score op's key ranges where the backend scores (bf16 / fp16)
        plan = make_plan(st, b, ranged=st.index_score_op() is not None)
        return (
            varlen_attend(st, plan, lambda a, x: layer_rows(st, a, x, positions)),
            varlen_source(st, plan),
        )
    _check_path(st.prefill_path)
    dev = st.device
    off = b.offsets.tolist()
    reqs = [
        (
            off[i],
            off[i + 1],
            int(b.start_pos[i]),
            int(b.state_slots[i]),
            torch.as_tensor(b.block_tables[i], dtype=torch.long, device=dev),
        )
        for i in range(b.num_requests)
    ]
    sel: dict = {}
    pools: dict = {}

    def attend(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        with record_function(LAYER_RANGE):
            return attend_prefill(st, lid, a, x, positions, reqs, sel, pools)

    def source(lid: int, a: Attention, x: torch.Tensor) -> torch.Tensor:
        cstate = torch.cat((a.compressor.project(x), a.index_compressor.project(x)), dim=-1)
        for r0, r1, s, slot, table in reqs:
            compress(st, lid, a, cstate[r0:r1], s, r1 - r0, slot, table)
        return x

    return attend, source


def _check_path(path: str) -> None:
    if path not in PREFILL_PATHS:
        raise ValueError(f"prefill_path={path!r}: must be one of {', '.join(map(repr, PREFILL_PATHS))}")


def _encoder_only(
    st: ExecutorState,
    b: ForwardBatch,
    tokens: torch.Tensor,
    attend: AttendFn,
    source: AttendFn,
    rows: dict[int, torch.Tensor],
) -> ForwardOutput:
    """An encoder-only step (CED prefix prefill): the encoder layers, then the first decoder layer's global
    KV written from its input (``source``); no logits."""
    _, counts = st.model.run_layers(tokens, attend, source_only=source, engram_rows=rows)
    st.slot_end[b.state_slots] = b.start_pos + b.query_lens
    st.encoder_only[b.state_slots] = True
    empty = np.zeros(0, np.int64)
    return ForwardOutput(
        logits=torch.zeros(0, st.cfg.vocab_size, dtype=st.dtype, device=st.device),
        logit_rows=empty,
        request_of_logit=empty,
        expert_counts=counts,
        snapshots=st.take_snapshots(b),
    )


def _gather_compressed(
    st: ExecutorState,
    flat: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    ratio: int,
    g0: int,
    g1: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys [g1 - g0, k, d] of one request's rows g0 .. g1 - 1 (their ``ids`` picked
    from the paged cache ``flat`` through ``table``) and their validity."""
    kb = st.fmt.main.dequantize(flat[st.entry_slots(table, ids[g0:g1].reshape(-1), ratio)]).to(st.dtype)
    return kb.view(g1 - g0, ids.shape[1], kb.shape[-1]), valid[g0:g1]


def _pick_keys(
    keys: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, g0: int, g1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows g0 .. g1 - 1 of a request's top-k compressed keys [g1 - g0, k, d] from its dequantised
    entries ``keys`` [E, d], and their validity."""
    return keys[ids[g0:g1]], valid[g0:g1]
