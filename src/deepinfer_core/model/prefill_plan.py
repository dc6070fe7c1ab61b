"""The host half of the varlen prefill (``prefill_path="varlen"``, :mod:`~deepinfer_core.model.prefill_varlen`).

A prefill step's index arithmetic depends only on the batch (start positions, chunk lengths, slots, block
tables, floors), never on the activations, so it is done once a step on the host, in numpy, for every
request at once, and sent to the device as ONE int64 buffer (:class:`Pack`: one copy, views by name).
Every layer then reads it with a constant number of gathers, whatever the number of requests:

- **tiles**: each request's rows cut into query tiles that never cross a request (its last tile padded
  by repeating its last row), of ``min(tile, n)`` rows rounded up to a power of two (so a one-row decode
  request beside a long prompt is not padded to 64 rows); requests of one tile size form a bucket
  (at most log2(tile) + 1 buckets, whatever the number of requests); every per-row tensor of the
  attention and the indexer is laid out by tile, bucket after bucket, and the real rows are picked
  back with ``out_slot`` at the end of a layer;
- **windows** (one per floor kind, encoder / decoder): the ring slots of every request's history keys
  (positions [h0, s), h0 as the per-request path computes it) and, per tile, the index of each of its
  ``window_width(tile, w)`` window keys in ``cat(history keys, chunk keys)`` with the tile's mask
  (causal band, the key exists, it is at or past the floor);
- **entries** (one per compress ratio): the cache slots of every request's compressed entries (their
  concatenation, request i's at ``first``), each tile row's visible count, the indexer's row pieces
  (whole tiles whose scores fit the memory budget, :func:`index_pieces`) and the compression's gathers:
  which per-token states (the compressor ring's partial group, then the chunk's rows) form each new
  entry's group, the slots the new entries go to and the ring writes;
- the SWA ring writes (each request's last ``ring`` rows) and the snapshot scatters.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from deepinfer_core.device_tokens import h2d
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.layers.window_attention import window_width
from deepinfer_core.model.state import ExecutorState, last_rows

# profiler ranges around the prefill's attention and indexer work (benchmarks/model_cuda.py splits the GPU
# time by them; re-exported by model.prefill); a record_function outside a profiler costs about a microsecond
ATTENTION_RANGE = "prefill.attention"
INDEXER_RANGE = "prefill.indexer"
# around a whole layer's attention of a prefill step (projections, ring writes, compression included): the
# ops a prefill path owns (benchmarks/prefill_batching.py counts them)
LAYER_RANGE = "prefill.layer_attention"

# an indexer piece: (bucket, first tile, end tile (in the bucket), entries its rows score, first and end entry
# of the concatenation it reads, whether its tiles are all of one request)
Piece = tuple[int, int, int, int, int, int, bool]


def starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum: where each group of a flat concatenation starts."""
    out = np.zeros(len(counts), np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=out[1:])
    return out


def ranges(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each element, its value) of ``concat(arange(first[g], first[g] + counts[g]))``."""
    counts = np.asarray(counts, np.int64)
    grp = np.repeat(np.arange(len(counts)), counts)
    off = np.arange(grp.size, dtype=np.int64) - np.repeat(starts(counts), counts)
    return grp, np.repeat(np.asarray(first, np.int64), counts) + off


class Pack:
    """Host int64 arrays sent to the device as one buffer (one copy); :meth:`send` returns views by name."""

    def __init__(self) -> None:
        self.host: dict[str, np.ndarray] = {}

    def add(self, name: str, arr: Any) -> None:
        self.host[name] = np.asarray(arr, np.int64)

    def send(self, dev: torch.device) -> dict[str, torch.Tensor]:
        arrs = list(self.host.values())
        flat = np.concatenate([a.ravel() for a in arrs]) if arrs else np.zeros(0, np.int64)
        buf = h2d(flat, dev, np.int64)
        out, o = {}, 0
        for name, a in self.host.items():
            out[name] = buf[o : o + a.size].view(a.shape)
            o += a.size
        return out


@attrs.define(eq=False)
class Tiles:
    """One bucket's query tiles (host arrays, one entry per tile): all of ``tile`` rows."""

    tile: int
    req: np.ndarray  # request of each tile
    row0: np.ndarray  # its first batch row
    rows: np.ndarray  # its real rows (<= tile)
    pos0: np.ndarray  # position of its first row
    count: int  # tiles
    base: int  # the bucket's first tile row in the step's tile layout
    n_rows: int  # batch rows of the step
    tile_rows: np.ndarray  # [count, tile] batch row of each tile row


@attrs.define(eq=False)
class Window:
    """One floor kind's window: history ring slots [H] and, per bucket, the tiles' key index [T, W] into
    ``cat(history keys, chunk keys)`` and their mask [T, tile, W]."""

    hist: torch.Tensor
    n_hist: int
    idx: list[torch.Tensor]
    mask: list[torch.Tensor]


@attrs.define(eq=False)
class Compression:
    """One ratio's compression gathers: per-token states of the compressor ring's partial groups [O] (flat
    ring rows), each new entry's group [C, r] in ``cat(ring states, chunk states)``, its entry id [C] and
    cache slot [C]; the ring writes (flat ring rows [K] of chunk rows [K]); None arrays: ratio 1."""

    old: torch.Tensor | None
    group: torch.Tensor
    entry: torch.Tensor
    put: torch.Tensor
    ring_put: torch.Tensor | None
    ring_rows: torch.Tensor | None
    n_new: int


@attrs.define(eq=False)
class Entries:
    """One compress ratio's entries for the step: all requests' entries concatenated (request i's from
    ``first`` of its rows), their cache slots [E], each tile row's first entry and visible count
    [tile rows], per bucket and tile the first and last entry index [T], the widest request's count (``width``) and
    the selection width ``k`` = min(index_topk, width); the indexer pieces and the compression."""

    ratio: int
    total: int
    width: int
    k: int
    slots: torch.Tensor
    first_row: torch.Tensor
    vis: torch.Tensor
    first: list[torch.Tensor]
    last: list[torch.Tensor]
    arange: torch.Tensor
    pieces: list[Piece]
    comp: Compression


@attrs.define(eq=False, kw_only=True)
class VarlenPlan:
    """One varlen prefill step's index plan (:func:`make_plan`), plus the step's per-layer results that
    later layers read: ``sel`` (top-k per index source), ``pools`` (candidate pools) and ``memo``
    (dequantised entries per source layer, their global ids)."""

    buckets: list[Tiles]
    identity: bool  # one bucket, no tile padded: the tile layout is the row layout
    tile_rows: list[torch.Tensor]  # per bucket [T, tile]: batch row of each tile row
    out_slot: torch.Tensor  # [N] each batch row's place in the tile layout
    windows: list[Window]  # by floor kind: encoder, decoder
    entries: dict[int, Entries]
    ring_keep: torch.Tensor | None  # rows written to the SWA rings (None: all)
    ring_slot: torch.Tensor
    ring_pos: torch.Tensor
    snap_reqs: list[int]  # requests asking for a snapshot this step
    snap_slots: torch.Tensor | None
    snap_dst: torch.Tensor | None
    snap_src: torch.Tensor | None
    sel: dict = attrs.field(factory=dict)
    pools: dict = attrs.field(factory=dict)
    memo: dict = attrs.field(factory=dict)

    def tile_rows_of(self, x: torch.Tensor, bucket: int, ta: int, tb: int) -> torch.Tensor:
        """Rows of tiles ta .. tb - 1 of a bucket of a per-row tensor ``x`` [N, ...] as [tb - ta, tile, ...]
        (a view when the tile layout is the row layout)."""
        t = self.buckets[bucket].tile
        if self.identity:
            return x[ta * t : tb * t].view(tb - ta, t, *x.shape[1:])
        return x[self.tile_rows[bucket][ta:tb]]

    def once(self, key: Any, make: Any) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def make_buckets(b: ForwardBatch, tile: int) -> tuple[list[Tiles], np.ndarray]:
    """(the buckets of tiles, each batch row's place in the step's tile layout [N]): request i's tiles have
    ``min(tile, next power of two >= n_i)`` rows."""
    n = b.query_lens.astype(np.int64)
    size = np.minimum(tile, 1 << np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
    r0, s = b.offsets[:-1], b.start_pos.astype(np.int64)
    out_slot = np.zeros(int(n.sum()), np.int64)
    buckets, base = [], 0
    for sz in sorted({int(x) for x in size}, reverse=True):  # at most log2(tile) + 1 of them
        reqs = np.flatnonzero(size == sz)
        nt = -(-n[reqs] // sz)
        k, j = ranges(np.zeros_like(nt), nt)
        req = reqs[k]
        row0 = r0[req] + j * sz
        rows = np.minimum(sz, n[req] - j * sz)
        tile_rows = row0[:, None] + np.minimum(np.arange(sz)[None, :], rows[:, None] - 1)
        rk, off = ranges(np.zeros_like(reqs), n[reqs])
        out_slot[r0[reqs][rk] + off] = base + (starts(nt)[rk] + off // sz) * sz + off % sz
        count = int(nt.sum())
        buckets.append(Tiles(sz, req, row0, rows, s[req] + j * sz, count, base, len(out_slot), tile_rows))
        base += count * sz
    return buckets, out_slot


def window_host(st: ExecutorState, b: ForwardBatch, buckets: list[Tiles], kind: int, pk: Pack) -> int:
    """Floor kind ``kind``'s window arrays into ``pk`` (``w<kind>.*``); returns the history key count."""
    w, ring = st.cfg.sliding_window, st.swa_ring
    s, n = b.start_pos.astype(np.int64), b.query_lens.astype(np.int64)
    floor = st.floor[b.state_slots, kind]
    h0 = np.maximum(np.maximum(0, s - (w - 1)), np.minimum(floor, s))  # the per-request path's h0
    hn = s - h0
    hreq, hpos = ranges(h0, hn)
    n_hist = int(hn.sum())
    pk.add(f"w{kind}.hist", b.state_slots[hreq].astype(np.int64) * ring + hpos % ring)
    for i, t in enumerate(buckets):
        width = window_width(t.tile, w)
        rq = t.req
        kpos = t.pos0[:, None] - (w - 1) + np.arange(width)[None, :]
        s_t = s[rq][:, None]
        idx = np.where(
            kpos >= s_t,
            n_hist + b.offsets[:-1][rq][:, None] + kpos - s_t,
            starts(hn)[rq][:, None] + kpos - h0[rq][:, None],
        )
        exists = (kpos >= h0[rq][:, None]) & (kpos < (s + n)[rq][:, None]) & (kpos >= floor[rq][:, None])
        pk.add(f"w{kind}.{i}.idx", np.clip(idx, 0, max(n_hist + t.n_rows - 1, 0)))
        pk.add(f"w{kind}.{i}.exists", exists)
        if f"{i}.band" not in pk.host:
            q, jj = np.arange(t.tile)[:, None], np.arange(width)[None, :]
            pk.add(
                f"{i}.band", (jj >= q) & (jj <= q + (w - 1))
            )  # query q of a tile sees columns q .. q + w - 1
    return n_hist


def index_pieces(
    bucket: int,
    t: Tiles,
    first: np.ndarray,
    widest: int,
    ratio: int,
    per_elem: int,
    budget: int,
    ranged: bool,
) -> list[Piece]:
    """Runs of whole tiles whose indexer scores fit ``budget``, each row counted at the ``widest``
    request's entry count (as the tiled path counts a request's rows: no larger pieces than its, so the
    causal half of a long request is skipped as finely); ``ranged``: the score op reads one key range of
    the concatenation for the whole piece, counted instead where it is wider. Each tile row then scores
    the entries the piece's last rows see, not ``widest``."""
    vis = (t.pos0 + t.rows) // ratio
    lo_t = first[t.req]
    hi_t = lo_t + vis
    out: list[Piece] = []
    ta = 0
    while ta < t.count:
        e, lo, hi = int(vis[ta]), int(lo_t[ta]), int(hi_t[ta])
        tb = ta + 1
        while tb < t.count:
            e2, lo2, hi2 = max(e, int(vis[tb])), min(lo, int(lo_t[tb])), max(hi, int(hi_t[tb]))
            width = max(widest, hi2 - lo2) if ranged else widest
            if (tb + 1 - ta) * t.tile * width * per_elem > budget:
                break
            e, lo, hi, tb = e2, lo2, hi2, tb + 1
        out.append((bucket, ta, tb, e, lo, hi, bool(t.req[ta] == t.req[tb - 1])))
        ta = tb
    return out


def entry_slots(st: ExecutorState, tables: np.ndarray, ent: np.ndarray, ratio: int) -> np.ndarray:
    """``ExecutorState.entry_slots`` on the host, one block table row per entry."""
    lg = ent * ratio // st.min_ratio
    bs = st.block_size
    return tables[np.arange(len(ent)), lg // bs].astype(np.int64) * bs + lg % bs


def compression_host(st: ExecutorState, b: ForwardBatch, ratio: int, ent_slots: np.ndarray, pk: Pack) -> int:
    """Ratio ``ratio``'s compression gathers into ``pk`` (``c<ratio>.*``); returns the new entry count."""
    s, n = b.start_pos.astype(np.int64), b.query_lens.astype(np.int64)
    r0, slots = b.offsets[:-1], b.state_slots.astype(np.int64)
    e0, e1 = s // ratio, (s + n) // ratio
    creq, ent = ranges(e0, e1 - e0)
    pk.add(f"c{ratio}.entry", ent)
    pk.add(f"c{ratio}.put", ent_slots[starts((s + n) // ratio)[creq] + ent])
    g0 = e0 * ratio
    n_old = s - g0  # tokens of the group that is partial at s (in the compressor ring)
    if ratio > 1:
        cring = ratio + st.backtrack
        oreq, opos = ranges(g0, n_old)
        pk.add(f"c{ratio}.old", slots[oreq] * cring + opos % cring)
        keep = np.flatnonzero(np.arange(b.num_tokens) >= np.repeat(b.offsets[1:], n) - cring)
        pk.add(f"c{ratio}.ring_put", np.repeat(slots, n)[keep] * cring + b.positions[keep] % cring)
        pk.add(f"c{ratio}.ring_rows", keep)
    tok = ent[:, None] * ratio + np.arange(ratio)[None, :]  # [C, r] positions of each group's tokens
    sc = s[creq][:, None]
    pk.add(
        f"c{ratio}.group",
        np.where(
            tok < sc,
            starts(n_old)[creq][:, None] + tok - g0[creq][:, None],
            int(n_old.sum()) + r0[creq][:, None] + tok - sc,
        ),
    )
    return len(ent)


def entries_host(
    st: ExecutorState, b: ForwardBatch, buckets: list[Tiles], ratio: int, ranged: bool, pk: Pack
) -> tuple[int, int, list[Piece], int]:
    """Ratio ``ratio``'s entry arrays into ``pk`` (``e<ratio>.*``, ``c<ratio>.*``): returns (entries of
    all requests, the widest request's, the indexer pieces, new entries)."""
    s, n = b.start_pos.astype(np.int64), b.query_lens.astype(np.int64)
    e = (s + n) // ratio
    first = starts(e)
    ereq, ent = ranges(np.zeros_like(e), e)
    slots = entry_slots(st, b.block_tables[ereq], ent, ratio)
    width = int(e.max()) if e.size else 0
    pk.add(f"e{ratio}.slots", slots)
    pos = b.positions
    pk.add(f"e{ratio}.first_row", np.concatenate([np.repeat(first[t.req], t.tile) for t in buckets]))
    pk.add(f"e{ratio}.vis", np.concatenate([((pos[t.tile_rows] + 1) // ratio).ravel() for t in buckets]))
    es = 4 if ranged else st.dtype.itemsize  # the score op's scores are float32
    per_elem = 2 * st.cfg.index_n_heads * es + 4 * es + 3 * 8  # as the tiled path's select_entries
    pieces: list[Piece] = []
    for i, t in enumerate(buckets):
        # a tile's keys start at its request's first entry; a request with none yet reads (masked) the
        # last entry of the concatenation rather than one past it
        pk.add(f"e{ratio}.{i}.first", np.minimum(first[t.req], max(int(e.sum()) - 1, 0)))
        pk.add(f"e{ratio}.{i}.last", np.maximum(e - 1, 0)[t.req])
        pieces += index_pieces(i, t, first, width, ratio, per_elem, st.prefill_budget, ranged)
    pk.add(f"e{ratio}.arange", np.arange(width))
    n_new = compression_host(st, b, ratio, slots, pk)
    return int(e.sum()), width, pieces, n_new


def ring_host(st: ExecutorState, b: ForwardBatch, pos: np.ndarray, pk: Pack) -> bool:
    """The SWA ring writes (each request's last ``ring`` rows) into ``pk``; returns whether all rows."""
    keep = last_rows(b, st.swa_ring)
    slots = np.repeat(b.state_slots.astype(np.int64), b.query_lens)
    every = bool(keep.all())
    if not every:
        pk.add("ring_keep", np.flatnonzero(keep))
    pk.add("ring_slot", slots[keep])
    pk.add("ring_pos", pos[keep])
    return every


def snapshot_host(st: ExecutorState, b: ForwardBatch, pk: Pack) -> list[int]:
    """The snapshot scatters of this step's snapshot requests into ``pk``: each ring copy at position X
    gets the chunk's bytes of positions [max(s, X - ring), X); returns the requests."""
    reqs = sorted(st.snap_at)
    if not reqs:
        return reqs
    ring, r0, s = st.swa_ring, b.offsets[:-1], b.start_pos.astype(np.int64)
    dst, src = [], []
    for j, i in enumerate(reqs):  # host arithmetic only: the device work is one gather and one scatter
        sp = np.arange(max(int(s[i]), st.snap_at[i] - ring), st.snap_at[i])
        dst.append(j * ring + sp % ring)
        src.append(r0[i] + sp - s[i])
    pk.add("snap_slots", b.state_slots[reqs])
    pk.add("snap_dst", np.concatenate(dst))
    pk.add("snap_src", np.concatenate(src))
    return reqs


def make_plan(st: ExecutorState, b: ForwardBatch, ranged: bool = False) -> VarlenPlan:
    """The index plan of prefill step ``b`` (validated), sent to the device in one copy; ``ranged``: the
    indexer scores through a score op over key ranges (the pieces' widths count the range)."""
    buckets, out_slot = make_buckets(b, st.prefill_tile)
    pk = Pack()
    for i, t in enumerate(buckets):
        pk.add(f"{i}.tile_rows", t.tile_rows)
    pk.add("out_slot", out_slot)
    kinds = 2 if st.cfg.encoder_layers < st.cfg.num_hidden_layers else 1
    n_hist = [window_host(st, b, buckets, k, pk) for k in range(kinds)]
    ents = {r: entries_host(st, b, buckets, r, ranged, pk) for r in st.entry_ratios}
    every = ring_host(st, b, b.positions, pk)
    snap_reqs = snapshot_host(st, b, pk)
    d = pk.send(st.device)
    nb = range(len(buckets))
    bands = [d[f"{i}.band"] != 0 for i in nb]
    windows = [
        Window(
            d[f"w{k}.hist"],
            n_hist[k],
            [d[f"w{k}.{i}.idx"] for i in nb],
            [bands[i][None] & (d[f"w{k}.{i}.exists"] != 0)[:, None, :] for i in nb],
        )
        for k in range(kinds)
    ]
    return VarlenPlan(
        buckets=buckets,
        identity=len(buckets) == 1 and bool((buckets[0].rows == buckets[0].tile).all()),
        tile_rows=[d[f"{i}.tile_rows"] for i in nb],
        out_slot=d["out_slot"],
        windows=windows,
        entries={r: _entries(d, r, len(buckets), *ents[r], st.cfg.index_topk) for r in ents},
        ring_keep=None if every else d["ring_keep"],
        ring_slot=d["ring_slot"],
        ring_pos=d["ring_pos"],
        snap_reqs=snap_reqs,
        snap_slots=d.get("snap_slots"),
        snap_dst=d.get("snap_dst"),
        snap_src=d.get("snap_src"),
    )


def _entries(
    d: dict[str, torch.Tensor],
    r: int,
    n_buckets: int,
    total: int,
    width: int,
    pieces: list[Piece],
    n_new: int,
    topk: int,
) -> Entries:
    comp = Compression(
        old=d.get(f"c{r}.old"),
        group=d[f"c{r}.group"],
        entry=d[f"c{r}.entry"],
        put=d[f"c{r}.put"],
        ring_put=d.get(f"c{r}.ring_put"),
        ring_rows=d.get(f"c{r}.ring_rows"),
        n_new=n_new,
    )
    return Entries(
        ratio=r,
        total=total,
        width=width,
        k=min(topk, width),
        slots=d[f"e{r}.slots"],
        first_row=d[f"e{r}.first_row"],
        vis=d[f"e{r}.vis"],
        first=[d[f"e{r}.{i}.first"] for i in range(n_buckets)],
        last=[d[f"e{r}.{i}.last"] for i in range(n_buckets)],
        arange=d[f"e{r}.arange"],
        pieces=pieces,
        comp=comp,
    )
