"""The executor's sync-free row path: decode / verify steps with no host synchronisation (cuda backend).

The row path (every request feeds <= backtrack + 1 tokens) of :class:`~deepinfer_core.model.executor.
ModelExecutor` written so that the device never waits for the host and the host never waits for the
device inside a step, which is also what makes a step capturable in a CUDA graph
(:mod:`deepinfer_core.model.cuda_graphs`):

- everything data-dependent is decided on the host from the batch (numpy) before the step: the number
  of compressed entries the indexer scores per ratio (:func:`entries_needed`), the rows' slots, tables
  and floors; inputs go to the device with non-blocking copies;
- no ``nonzero`` / ``.item()`` / ``.tolist()`` / ``bincount``: the compressor pools every row and writes
  only the rows that complete a group (slot -1 = skipped, the KV kernels' padding contract), the
  candidate pool forces partial blocks with a scatter, the MoE runs in static mode
  (:func:`~deepinfer_core.model.layers.moe.static_shapes`);
- cache reads and writes go through the backend's ``kv_gather`` / ``kv_store`` ops with the checks off
  (they would synchronise; the executor validated the batch on the host).

Same results as the plain row path up to summation order (the MoE's grouped products; tested), with the
same cache bytes. Used when the executor has a backend and a CUDA device (``ModelExecutor.sync_free``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed, h2d
from deepinfer_core.model.batch import ForwardBatch, ForwardOutput
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, LAYER_SWA
from deepinfer_core.model.fusion import fusable, fused_glue
from deepinfer_core.model.layers.attention import Attention, sink_attention
from deepinfer_core.model.layers.indexer import index_scores, mask_scores, pick_entries
from deepinfer_core.model.layers.moe import grouped_gemm_impl, static_shapes
from deepinfer_core.model.layers.rope import cached_angles
from deepinfer_core.model.mhc import sinkhorn_impl


class ExecutorView(Protocol):
    """The ``ModelExecutor`` this module runs for, typed without importing it: executor.py imports this
    module, so importing it back would be an import cycle (tests/test_imports.py). Attributes are untyped."""

    def __getattr__(self, name: str) -> Any: ...


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


class _UncheckedRows:
    """A one-device table whose ``fetch`` skips the id range check (``LocalEngramTable.fetch(check=False)``):
    the check reads the ids' min / max back, a device synchronisation every decode step (with the overlap,
    a wait for the whole step in flight), and ids from the hasher are in range by construction (each
    column's modulus and offset)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        return self.table.fetch(row_ids, check=False)


def hashed_row_tables(tables: dict[int, Any]) -> dict[int, Any]:
    """``tables`` for row ids from the hasher: one-device tables skip the id checks (:class:`_UncheckedRows`);
    any other kind (host, sharded, a user's) keeps its own ``fetch``."""
    from deepinfer_core.engram.tables import LocalEngramTable

    return {lid: _UncheckedRows(t) if type(t) is LocalEngramTable else t for lid, t in tables.items()}


def hash_decode_on_device(hasher: Any, tokens: torch.Tensor, context: np.ndarray) -> torch.Tensor:
    """``EngramHasher.hash`` of a batch of one-token rows (a decode step) whose tokens are on the device,
    without a host synchronisation: row i's n-gram of order k + 1 is (token i, context[i, :k]), the context
    known on the host. Its part of each order's XOR (the wrapping products of the context's canonical ids
    and their multipliers) is reduced in numpy, so the device runs ~8 small kernels (token map, product,
    XOR, modulus, offset) instead of ~40 for the general n-gram build (``hash(..., validate=False)``): the
    fewer launches, the less host time a step costs next to the step in flight. Int32 [L, T, orders * heads],
    the same row ids as ``hash_host`` (tested)."""
    lut, mult = hasher.token_map.lookup, hasher.multipliers  # [V], [L, N] int64
    ctx = np.asarray(context, np.int64)
    c = np.where(ctx < 0, hasher.pad_canonical, lut[np.maximum(ctx, 0)])  # [T, N-1] canonical
    known = np.bitwise_xor.accumulate(c[None, :, :] * mult[:, None, 1:], axis=2)  # [L, T, N-1], wraps like the op
    dev = tokens.device
    m0, primes, offsets = hasher.decode_params(dev)  # cached: [L, 1], [L, 1, N-1, H], [L, 1, (N-1)*H] int64
    canon = hasher.token_map(tokens, validate=False)  # [T]
    h = torch.bitwise_xor((canon[None, :] * m0).unsqueeze(-1), h2d(known, dev, np.int64))  # [L, T, N-1]
    cols = torch.remainder(h.unsqueeze(-1), primes)  # [L, T, N-1, H]
    return (cols.flatten(2) + offsets).to(torch.int32)


def is_pure_decode(b: ForwardBatch) -> bool:
    """One new token and one logits row per request, nothing else asked of the step (drafting after it
    is allowed: the drafter runs eagerly on the replay's outputs)."""
    return (not b.encoder_only and not b.capture_layers and bool((b.query_lens == 1).all())
            and bool((b.num_logits == 1).all())
            and (b.verify_lens is None or not b.verify_lens.any())
            and (b.snapshot_pos is None or not b.snapshot_pos.any()))


def entries_needed(ex: ExecutorView, positions: np.ndarray) -> dict[int, int]:
    """Compressed entries the indexer scores, per compress ratio of an indexing layer: the most any row
    sees, max((position + 1) // ratio) (computed on the host: no device readback)."""
    cfg = ex.cfg
    memo = getattr(ex, "_entry_ratios", None)  # the layer walk once per config, not every step
    if memo is None or memo[0] is not cfg:
        memo = (cfg, tuple(dict.fromkeys(cfg.ratio(lid) for lid in range(cfg.num_hidden_layers)
                                          if cfg.layer_kind(lid) in (LAYER_FULL, LAYER_REINDEX))))
        ex._entry_ratios = memo
    if not positions.size:
        return dict.fromkeys(memo[1], 0)
    top = int(positions.max()) + 1  # max((p + 1) // r) == (max(p) + 1) // r: floor division is monotone
    return {r: top // r for r in memo[1]}


# The step's index arithmetic, built once a step (attend_rows' ``once``) as fused functions: under the
# glue each is one or two kernels instead of ~10 small int64 ones. Integer maths: the same values
# compiled or not.


def slot_of(tables: torch.Tensor, ent: torch.Tensor, r: int, m: int, bs: int) -> torch.Tensor:
    """Flat cache slots of compressed entries ``ent`` [N, K] (>= 0) of ratio ``r`` (the layout of
    ``ModelExecutor._slots``: entry j at logical slot j * r / m of the row's block table)."""
    lg = ent if r == m else ent * r // m
    # columns past a row's table only serve masked entries (padded counts): clamp, do not index out
    return tables.gather(1, (lg // bs).clamp(max=tables.shape[1] - 1)) * bs + lg % bs


@fusable
def window_index(positions: torch.Tensor, slots: torch.Tensor, floors: torch.Tensor, valid: torch.Tensor | None,
                 w: int, rl: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
def ring_index(positions: torch.Tensor, slots: torch.Tensor, src_row: torch.Tensor | None, cring: int,
               r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(compressor-state ring slot each row writes [N] (a padded row: row 0's, see :func:`window_index`),
    ring slots of each row's group of ``r`` tokens [N, r]), for a ring of ``cring`` per slot."""
    tgt = slots * cring + positions % cring
    grp = positions[:, None] - (r - 1) + torch.arange(r, device=positions.device)[None, :]
    return tgt if src_row is None else tgt[src_row], slots[:, None] * cring + grp % cring


@fusable
def entry_index(positions: torch.Tensor, tables: torch.Tensor, valid: torch.Tensor | None, e: int, r: int, m: int,
                bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def attend_rows(ex: ExecutorView, lid: int, a: Attention, x: torch.Tensor, inp: DecodeInputs, sel: dict,
                pools: dict, valid: torch.Tensor | None) -> torch.Tensor:
    """``ModelExecutor._attend_rows`` without host synchronisation (see the module docstring)."""
    cfg, fmt_arg, bs = ex.cfg, ex._fmt_arg, ex.block_size
    w, dev = cfg.sliding_window, ex.device
    be = ex.backend
    assert be is not None
    gather, store = be.op("kv_gather"), be.op("kv_store")
    positions, slots, tables = inp.positions, inp.slots, inp.tables
    n = x.shape[0]
    # the projections of x (query latent, SWA key, compressor state, indexer weights) as one packed GEMM
    xp = a.input_products(x)
    q, lat = a.queries_from(xp["q"], positions)
    ring, rl = ex.swa[lid], ex.swa_ring
    memo = pools.setdefault("index", {})  # index tensors shared by every layer of the step (same rows)

    def once(key: tuple, make: Callable[[], Any]) -> Any:
        if key not in memo:
            memo[key] = make()
        return memo[key]

    swa_put, ring_slots, mask_enc, mask_dec, src_row = once(
        ("swa",), lambda: window_index(positions, slots, inp.floors, valid, w, rl))
    # new SWA keys first: the ring (window + backtrack) then holds every row's whole window
    store(ring, a.swa_kv_from(xp["kv"], positions), swa_put, fmt_arg["swa"], check=False)
    enc = int(lid >= cfg.encoder_layers)
    mask_a = mask_dec if enc else mask_enc
    # the fused attention reads one key buffer: window and top-k keys gathered into it (no concatenation)
    one_buffer = getattr(ex, "fused_attention", False) and a.kind != LAYER_SWA
    k_a = None if one_buffer else gather(ring, ring_slots, fmt_arg["swa"], cfg.head_dim, ex.dtype)
    if a.kind == LAYER_SWA:
        assert k_a is not None
        return _attention(ex, a, q, k_a, mask_a, None, None)
    r, src, m = a.ratio, cfg.kv_source_of(lid), ex.min_ratio

    def ratio_index() -> tuple[torch.Tensor, ...] | None:
        """:func:`entry_index` of this ratio, once a step (None when the step scores none of its entries)."""
        if r not in inp.entries:
            return None
        return once(("entries", r), lambda: entry_index(positions, tables, valid, inp.entries[r], r, m, bs))

    if a.kind == LAYER_FULL:
        st = xp["comp"]  # = cat(compressor.project(x), index_compressor.project(x))
        if r > 1:
            cs, cring = ex.comp_state[lid], ex.comp_ring[lid]
            flat_cs = cs.view(-1, cs.shape[-1])
            tgt, grp = once(("ring", cring, r), lambda: ring_index(positions, slots, src_row, cring, r))
            # padded rows repeat row 0's write (same index, same values: no race)
            flat_cs[tgt] = st if src_row is None else st[src_row]
            gs = flat_cs[grp]  # [N, r, width]
        else:
            gs = st[:, None]
        idx = ratio_index()
        assert idx is not None  # a Full layer indexes: entries_needed counts its ratio
        _, _, _, ent, sl = idx
        dm = a.compressor.state_dim
        store(ex.kv[lid], a.compressor.pool_groups(gs[..., :dm], ent, a.inv_freq), sl, fmt_arg["main"], check=False)
        store(ex.index_keys[lid], a.index_compressor.pool_groups(gs[..., dm:], ent, a.inv_freq), sl,
              fmt_arg["index"], check=False)
    if a.kind in (LAYER_FULL, LAYER_REINDEX):
        qi, wi = a.indexer.from_products(xp["iw"], lat, positions, a.inv_freq)
        idx = ratio_index()
        assert idx is not None
        visible, ent_slots, seen = idx[:3]
        ik = gather(ex.index_keys[src], ent_slots, fmt_arg["index"], cfg.index_head_dim, ex.dtype)
        sel[lid] = pick_entries(cfg, lid, mask_scores(index_scores(qi, wi, ik), seen), visible, pools, "rows")
    isrc = cfg.index_source_of(lid)
    ids, ok = sel[isrc]

    def topk_slots() -> torch.Tensor:
        # the index source scored this ratio's E entries (ids in [0, E)): a gather from the entry table
        idx = ratio_index() if cfg.ratio(isrc) == r else None
        if idx is None or idx[1].shape[1] == 0:
            return slot_of(tables, ids, r, m, bs)
        return idx[1].gather(1, ids)

    # layers sharing an index source (and so a ratio) pick the same entries: their slots once a step
    kslots = once(("topk_slots", isrc, r), topk_slots)
    if one_buffer:
        keys = torch.empty(n, w + ids.shape[1], cfg.head_dim, dtype=ex.dtype, device=dev)
        gather(ring, ring_slots, fmt_arg["swa"], cfg.head_dim, ex.dtype, out=keys, col=0)
        gather(ex.kv[src], kslots, fmt_arg["main"], cfg.head_dim, ex.dtype, out=keys, col=w)
        return _attention(ex, a, q, keys, once(("mask_ab", enc, isrc), lambda: torch.cat([mask_a, ok], 1)), None, None)
    kb = gather(ex.kv[src], kslots, fmt_arg["main"], cfg.head_dim, ex.dtype)
    return _attention(ex, a, q, k_a, mask_a, kb, ok)


def _attention(ex: ExecutorView, a: Attention, q: torch.Tensor, k_a: torch.Tensor, mask_a: torch.Tensor,
               kb: torch.Tensor | None, ok: torch.Tensor | None) -> torch.Tensor:
    """The layer's attention over the gathered window (and top-k) keys: :func:`sink_attention`, or with
    ``executor.fused_attention`` the backend's ``sink_attention_rows`` (one kernel; same contract)."""
    if getattr(ex, "fused_attention", False) and ex.backend is not None:
        return ex.backend.op("sink_attention_rows")(q, k_a, mask_a, kb, ok, a.attn_sink, a.scale)
    return sink_attention(q, k_a, mask_a, kb, ok, a.attn_sink, a.scale)


def decode_body(ex: ExecutorView, inp: DecodeInputs, capture_ids: tuple[int, ...] = (),
                logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The device part of a row-path step: (logits of ``logit_rows`` (all rows when None), expert counts,
    {layer: output state [N, D]} for ``capture_ids``). Reads only ``inp``; no host synchronisation."""
    valid = None if inp.valid is None else inp.valid > 0
    sel: dict = {}
    pools: dict = {}
    capture: dict[int, torch.Tensor] = dict.fromkeys(capture_ids)  # type: ignore[arg-type]
    # opt-in (``executor.fused_sinkhorn = True``): the mHC Sinkhorn as one TileLang kernel per layer
    # instead of 80 torch launches; off by default until an H200 run has checked it
    # (the fused glue uses it too: compiled, the 20 iterations would still be 40 kernels)
    want = getattr(ex, "fused_sinkhorn", False) or getattr(ex, "fuse_glue", False)
    fused = ex.backend.op("mhc_sinkhorn") if want and ex.backend else None
    # ``executor.fuse_glue``: the model's small functions compiled into fused kernels (model.fusion)
    # opt-in (``executor.fused_moe``): the MoE's expert products as the backend's grouped GEMM kernel
    grouped = ex.backend.op("moe_grouped_gemm") if getattr(ex, "fused_moe", False) and ex.backend else None
    with static_shapes(row_mask=valid), sinkhorn_impl(fused), grouped_gemm_impl(grouped), cached_angles(), \
            fused_glue(getattr(ex, "fuse_glue", False)):
        hidden, counts = ex.model.run_layers(
            inp.tokens, lambda lid, a, x: attend_rows(ex, lid, a, x, inp, sel, pools, valid),
            capture=capture, engram_rows=inp.engram if inp.engram_ids is None else ex.engram_fetch(inp.engram_ids))
    h = hidden if logit_rows is None else hidden[logit_rows]
    if getattr(ex, "fused_head", False) and ex.backend is not None:
        # opt-in: the LM head as the grouped GEMM kernel with one group (the offsets on the device: a fill,
        # no host copy); the same product as ``model.logits``
        end = torch.full((1,), h.shape[0], dtype=torch.int32, device=h.device)
        return ex.backend.op("moe_grouped_gemm")(h, ex.model.head_weight[None], end), counts, capture
    return ex.model.logits(h), counts, capture


def execute_rows(ex: ExecutorView, b: ForwardBatch, feed: TokenFeed | None = None) -> ForwardOutput:
    """A validated row-path step, sync-free; pure-decode batches replay a CUDA graph when the executor's
    ``cuda_graphs`` is on and a bucket holds the batch. ``feed``: input tokens still on the device
    (the previous step's samples), written into the token input after its host copy."""
    dev = ex.device

    def put(arr: np.ndarray) -> torch.Tensor:  # no stream synchronisation (torch syncs blocking copies)
        return h2d(arr, dev, np.int64)

    pos = b.positions
    slots_np = np.repeat(b.state_slots, b.query_lens)
    floors_np = ex._floor[slots_np]
    entries = entries_needed(ex, pos)
    tok_t = None
    if feed is not None:  # the host ids hold placeholders there: the real ones come from the device
        tok_t = put(b.token_ids)
        feed.apply(tok_t)
    engram_ids = ex._engram_ids(b, tok_t, feed, pos=pos, row_slots=slots_np)  # records the token ring (fed entries once known)
    targets = () if ex.spec is None else tuple(ex.spec.drafter.target_layers)
    got = None
    if ex.cuda_graphs and is_pure_decode(b):
        got = ex.graphs().run(b, floors_np, entries, engram_ids, tok_t)
    rows = b.logit_rows()
    if got is not None:
        logits, counts, tstates = got
        caps = dict(zip(targets, tstates))
        captured: dict[int, torch.Tensor] = {}
    else:
        req_of_row = np.repeat(np.arange(b.num_requests), b.query_lens)
        inp = DecodeInputs(tokens=put(b.token_ids) if tok_t is None else tok_t, positions=put(pos), slots=put(slots_np), floors=put(floors_np),
                           valid=None, tables=put(b.block_tables[req_of_row]), engram={} if engram_ids is None else ex.engram_fetch(engram_ids),
                           entries=entries)  # type: ignore[arg-type]
        want = (*b.capture_layers, *targets)
        rows_t = None if rows.shape[0] == b.num_tokens else put(rows)
        logits, counts, caps = decode_body(ex, inp, want, rows_t)
        captured = {lid: caps[lid] if rows_t is None else caps[lid][rows_t] for lid in b.capture_layers}
    ex._slot_end[b.state_slots] = b.start_pos + b.query_lens
    ex._encoder_only[b.state_slots] = False
    spec_out = None
    if ex.spec is not None:
        keep = put(np.flatnonzero(ex._last_rows_np(b, ex.swa_ring)))  # an index, not a mask (no nonzero())
        ex.spec.write_context([caps[lid] for lid in targets], put(pos), put(slots_np), keep)
        spec_out = ex.spec.step(b, logits)
    req_of = np.repeat(np.arange(b.num_requests), b.num_logits)
    return ForwardOutput(logits=logits, logit_rows=rows, request_of_logit=req_of, expert_counts=counts,
                         captured=captured, snapshots=ex._take_snapshots(b), **(spec_out or {}))
