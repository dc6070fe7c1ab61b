"""CUDA graphs for row-path steps, bucketed by row count (the executor's ``cuda_graphs`` switch).

A graph runs a step whose every row is a logits row (``decode_step.is_graph_step``): a pure-decode step
(one row per request) or a speculative verify step (a request's last token and its drafts, one row each;
the verification and the next drafts run eagerly on the replay's outputs).

A decode step of the wide config launches thousands of small kernels; replaying a captured graph
replaces them with one launch. As in vLLM and SGLang the batch is padded up to a bucket size
(:data:`DEFAULT_BUCKETS`), the step reads its inputs from static device buffers that are refilled before
each replay, and one graph is captured per bucket on its first use (after one eager warm-up run on a side
stream, which also compiles the TileLang kernels outside the capture).

What a graph fixes besides the batch bucket, all part of its key: the number of compressed entries the
indexer scores per compress ratio (rounded up to :data:`ENTRY_QUANTUM`; entries past a row's visible
count are masked, so padding changes no result) and the block-table width (rounded up to a power of two).

Padded rows repeat request 0's token, position, state slot and block table (so every read stays in
range) and are marked invalid: their cache writes are skipped (slot -1 in the KV kernels) or redirected
to request 0's own write with request 0's values (the compressor-state ring), and the MoE leaves them out
of the expert counts. Their logits are dropped.

The step body is the executor's sync-free row path (:func:`~deepinfer_core.model.decode_step.decode_body`): no host
synchronisation, fixed shapes; the host side of the step (validation, Engram hashing and row fetch, the
position bookkeeping, the drafter) stays eager around the replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from deepinfer_core.engram import device_local
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.decode_step import DecodeInputs, StepOutputs, decode_body
from deepinfer_core.model.engram_context import engram_fetch
from deepinfer_core.model.state import ExecutorState

log = logging.getLogger(__name__)

# capture failures (distinct keys) after which no more captures are tried
MAX_FAILED_KEYS = 4
# batch sizes a graph is captured for (a batch runs in the smallest bucket that holds it)
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# indexer entries per ratio are padded to a multiple of this (a new graph every ENTRY_QUANTUM * ratio tokens)
ENTRY_QUANTUM = 256
# graphs kept per executor; past it the least recently replayed one is dropped (contexts grow: each entry
# bucket is a new key, and every graph holds its static inputs and outputs)
MAX_GRAPHS = 64


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Sorted, distinct positive bucket sizes; ValueError naming the field otherwise."""
    b = tuple(buckets)
    if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
        raise ValueError(f"cuda_graph_buckets={b!r}: must be a non-empty sequence of integers >= 1")
    if list(b) != sorted(set(b)):
        raise ValueError(f"cuda_graph_buckets={b!r}: must be strictly increasing")
    return b


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``n`` (None when ``n`` exceeds the largest: the step runs eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def round_up(n: int, quantum: int) -> int:
    """``n`` rounded up to a multiple of ``quantum`` (0 stays 0)."""
    return -(-n // quantum) * quantum


def width_bucket(w: int) -> int:
    """Block-table width of a graph: the next power of two >= ``w`` (at least 1)."""
    return 1 << max(0, int(w) - 1).bit_length()


def pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` [R, ...] padded to ``n`` rows by repeating row 0 (padded rows read valid memory)."""
    r = a.shape[0]
    if r > n:
        raise ValueError(f"pad_rows: {r} rows do not fit in {n}")
    if r == n:
        return a
    return np.concatenate((a, np.repeat(a[:1], n - r, axis=0)))


# executor switches that change what a decode step launches (the fused Sinkhorn, the fused glue, the fused
# attention, the grouped MoE GEMM, the LM head through it): part of every graph's key
BODY_FLAGS = ("fused_sinkhorn", "fuse_glue", "fused_attention", "fused_moe", "fused_head")


def body_flags(st: ExecutorState) -> tuple[bool, ...]:
    """The state's :data:`BODY_FLAGS`, in that order."""
    return (st.fused_sinkhorn, st.fuse_glue, st.fused_attention, st.fused_moe, st.fused_head)


@attrs.frozen
class GraphKey:
    batch: int
    width: int
    entries: tuple[tuple[int, int], ...]  # (ratio, padded entry count), by ratio
    body: tuple[
        bool, ...
    ] = ()  # the executor's BODY_FLAGS: each opt-in kernel is another body, its own graph


def host_inputs(
    b: ForwardBatch, floors: np.ndarray, bucket: int, width: int, engram_ids: np.ndarray | None = None
) -> np.ndarray:
    """The int64 host image of a padded step's inputs, one entry per row (token) of the step: tokens,
    positions, slots, floors (2 per row), valid, then the rows' block tables [bucket, width] (zero-padded
    columns), flat; with ``engram_ids`` ([L, R, C] hashed Engram row ids) those last, padded to
    [L, bucket, C]. Padded rows repeat row 0 (its slot, position and token: the same bytes written twice).
    A pure-decode step has one row per request; a verify step a request's last token and its drafts."""
    r = b.num_tokens
    req_of_row = np.repeat(np.arange(b.num_requests), b.query_lens)
    tab = np.zeros((r, width), np.int64)
    tab[:, : b.block_tables.shape[1]] = b.block_tables[req_of_row]
    slots = np.asarray(b.state_slots, np.int64)[req_of_row]
    cols = [pad_rows(a, bucket) for a in (b.token_ids, b.positions, slots)]
    fl = pad_rows(np.asarray(floors, np.int64).reshape(r, 2), bucket)
    v = np.zeros(bucket, np.int64)
    v[:r] = 1
    parts = [*cols, fl.reshape(-1), v, pad_rows(tab, bucket).reshape(-1)]
    if engram_ids is not None:
        parts.append(np.stack([pad_rows(x, bucket) for x in engram_ids]).reshape(-1))
    return np.concatenate(parts)


def fetch_in_graph(st: ExecutorState) -> bool:
    """Whether the step's Engram rows are fetched inside the graph from row ids in its input image: every
    table is the model's own on the executor's device (a gather kernel; host or sharded tables fetch
    outside, and the rows are copied in). Saves a pinned copy, the gather and a copy outside the graph,
    and their launches on the host, every step."""
    return bool(st.cfg.engram_layer_ids) and all(
        device_local(t, st.device) for t in st.engram_tables.values()
    )


def static_inputs(
    d: torch.Tensor,
    n: int,
    w: int,
    entries: dict[int, int],
    engram: dict[int, torch.Tensor],
    id_shape: tuple[int, int, int] | None = None,
) -> DecodeInputs:
    """A step's inputs as views into the flat int64 buffer ``d`` laid out by :func:`host_inputs` (``n``
    rows, tables ``w`` wide); ``id_shape`` [L, n, C]: the image ends with Engram row ids (``engram``
    then stays empty), else ``engram`` holds the rows."""
    t_end = 6 * n + n * w
    return DecodeInputs(
        tokens=d[:n],
        positions=d[n : 2 * n],
        slots=d[2 * n : 3 * n],
        floors=d[3 * n : 5 * n].view(n, 2),
        valid=d[5 * n : 6 * n],
        tables=d[6 * n : t_end].view(n, w),
        engram=engram,
        entries=entries,
        engram_ids=None if id_shape is None else d[t_end:].view(id_shape),
    )


def _engram_width(st: ExecutorState, lid: int) -> int:
    """Values per token of layer ``lid``'s fetched Engram rows (``EngramLayer.row_dim``: every order's heads)."""
    cfg = st.cfg
    return (cfg.engram_max_ngram - 1) * cfg.engram_n_heads * cfg.engram_head_dim


class _Graph:
    def __init__(
        self, key: GraphKey, st: ExecutorState, pool: Any, fetch_ids: bool = False, capture: bool = True
    ) -> None:
        self.key = key
        self.capture = capture
        n, w = key.batch, key.width
        dev = st.device
        cfg = st.cfg
        # with fetch_ids, the Engram row ids [L, n, C] close the image and the body fetches the rows
        self.fetch_ids = fetch_ids
        self.id_shape = (len(cfg.engram_layer_ids), n, (cfg.engram_max_ngram - 1) * cfg.engram_n_heads)
        self.size = n * 6 + n * w + (int(np.prod(self.id_shape)) if fetch_ids else 0)
        self.dev_buf = torch.zeros(self.size, dtype=torch.int64, device=dev)
        # two pinned staging buffers, alternated; each is rewritten only after its last copy finished
        # (none without capture: the image is copied straight in)
        self.host = [
            torch.zeros(self.size, dtype=torch.int64).pin_memory() for _ in range(2 if capture else 0)
        ]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        d = self.dev_buf
        # padded rows keep whatever Engram rows the buffer last held (finite; their outputs are dropped)
        engram = (
            {}
            if fetch_ids
            else {
                lid: torch.zeros(n, _engram_width(st, lid), dtype=st.dtype, device=dev)
                for lid in cfg.engram_layer_ids
            }
        )
        self.inp = static_inputs(d, n, w, dict(key.entries), engram, self.id_shape if fetch_ids else None)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: StepOutputs | None = None
        self.pool = pool

    def image(self, b: ForwardBatch, floors: np.ndarray, ids: torch.Tensor | None) -> np.ndarray:
        """The host image of ``b``: with :attr:`fetch_ids`, host ids go into it; device ids (hashed on the
        device, the asynchronous overlap) are copied in by :meth:`load`, the image holding zeros there
        (row 0 of each table: in range)."""
        if not self.fetch_ids:
            return host_inputs(b, floors, self.key.batch, self.key.width)
        shape = (self.id_shape[0], b.num_tokens, self.id_shape[2])
        host = ids.numpy() if ids is not None and ids.device.type == "cpu" else np.zeros(shape, np.int64)
        return host_inputs(b, floors, self.key.batch, self.key.width, host)

    def load(self, image: np.ndarray, engram: dict[int, torch.Tensor] | torch.Tensor | None, r: int) -> None:
        """Stage ``image`` (:meth:`image`) into the static inputs, then the Engram part: device row ids
        (``fetch_ids``) or fetched rows {layer: [r, row_dim]} (otherwise)."""
        i = self.turn
        self.turn ^= 1
        ev = self.copied[i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this staging buffer is done (not the whole step)
        if not self.capture:  # the padded step run eagerly (a check of the padding, on any device)
            self.dev_buf.copy_(torch.from_numpy(image))
        else:
            self.host[i].numpy()[:] = image
            self.dev_buf.copy_(self.host[i], non_blocking=True)
            e = torch.cuda.Event()
            e.record()
            self.copied[i] = e
        if self.fetch_ids:  # ``engram``: the ids; host ids are in the image already
            if isinstance(engram, torch.Tensor) and engram.device.type != "cpu":
                assert self.inp.engram_ids is not None
                self.inp.engram_ids[:, :r].copy_(engram)
            return
        assert isinstance(engram, dict)  # the fetched rows (empty without Engram layers)
        for lid, t in self.inp.engram.items():
            t[:r].copy_(engram[lid])


class DecodeGraphs:
    """Captured row-path steps of one executor, one per :class:`GraphKey`; :meth:`run` replays.

    ``capture=False`` runs each step eagerly on the same padded static inputs a graph would read (no
    capture, no pinned memory, any device): the padding's contract checked where no CUDA device is."""

    def __init__(
        self,
        st: ExecutorState,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        entry_quantum: int = ENTRY_QUANTUM,
        max_graphs: int = MAX_GRAPHS,
        capture: bool = True,
    ) -> None:
        if entry_quantum < 1:
            raise ValueError(f"entry_quantum={entry_quantum}: must be >= 1")
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs}: must be >= 1")
        self.st, self.buckets, self.quantum = st, check_buckets(buckets), entry_quantum
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()  # least recently used first
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.replays = 0
        # keys whose capture failed run eagerly (one bad shape costs only its own steps); past
        # MAX_FAILED_KEYS failures the cause is systemic and every step runs eagerly
        self.failed: set[GraphKey] = set()
        self.targets = () if st.spec is None else tuple(st.spec.drafter.target_layers)
        self.fetch_ids = fetch_in_graph(st)  # the tables are fixed for the executor's life

    @property
    def disabled(self) -> bool:
        """Whether captures failed for so many keys that every step runs eagerly."""
        return len(self.failed) >= MAX_FAILED_KEYS

    def key(self, b: ForwardBatch, entries: dict[int, int]) -> GraphKey | None:
        n = bucket_for(b.num_tokens, self.buckets)  # rows: one per request in pure decode, more to verify
        if n is None:
            return None
        return GraphKey(
            n,
            width_bucket(b.block_tables.shape[1]),
            tuple(sorted((r, round_up(e, self.quantum)) for r, e in entries.items())),
            body_flags(self.st),
        )

    def run(
        self,
        b: ForwardBatch,
        floors: np.ndarray,
        entries: dict[int, int],
        engram_ids: torch.Tensor | None,
        tokens: torch.Tensor | None = None,
    ) -> StepOutputs | None:
        """(logits [R, V], expert counts, target-layer states [R, D] each) of a graph step (R rows:
        ``decode_step.is_graph_step``), or None when no bucket holds its rows (the caller runs it eagerly). ``engram_ids``: the step's hashed
        Engram row ids [L, R, C] (host or device; None without Engram layers), fetched inside the graph
        where the tables allow (:func:`fetch_in_graph`), else here. ``tokens``: the step's input tokens
        as a device tensor [R] (some of them sampled by the previous step and never read back), copied
        into the graph's static token buffer after the host image (same stream: in order)."""
        key = None if self.disabled else self.key(b, entries)
        if key is None or key in self.failed:
            return None
        g = self.graphs.get(key)
        if g is None:
            while len(self.graphs) >= self.max_graphs:
                old, dropped = self.graphs.popitem(last=False)
                dropped.graph = dropped.out = None  # its memory returns to the shared pool
                log.info("cuda graph dropped (least recently used): %s", old)
            g = self.graphs[key] = _Graph(key, self.st, self.pool, self.fetch_ids, self.capture)
        self.graphs.move_to_end(key)
        r = b.num_tokens
        if g.fetch_ids:
            engram: dict[int, torch.Tensor] | torch.Tensor | None = engram_ids
        else:
            engram = {} if engram_ids is None else engram_fetch(self.st, engram_ids)
        g.load(g.image(b, floors, engram_ids), engram, r)
        if tokens is not None:  # padded rows keep request 0's host token (a valid id; outputs dropped)
            g.inp.tokens[:r].copy_(tokens)
        if not self.capture:
            g.out = self._outputs(decode_body(self.st, g.inp, self.targets))
        elif g.graph is None:
            try:
                self._capture(g)
            except Exception as e:  # an op that synchronises or cannot be captured: this key stays eager
                self.failed.add(key)
                log.warning(
                    "cuda graph capture of %s failed (%s: %s); its steps run eagerly (%d keys failed)",
                    key,
                    type(e).__name__,
                    e,
                    len(self.failed),
                    exc_info=len(self.failed) == 1,
                )
                self.graphs.pop(key, None)
                return None  # the warm-up ran the step: its writes are idempotent, the caller reruns it
        else:
            g.graph.replay()
        self.replays += 1
        assert g.out is not None
        logits, counts, targets = g.out
        # copies: the static outputs are overwritten by the next replay
        return logits[:r].clone(), counts.clone(), [t[:r].clone() for t in targets]

    def _outputs(self, out: tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]) -> StepOutputs:
        logits, counts, caps = out
        return logits, counts, [caps[lid] for lid in self.targets]

    def _capture(self, g: _Graph) -> None:
        st = self.st
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the step once eagerly (idempotent writes, JIT compiles)
            decode_body(st, g.inp, self.targets)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            g.out = self._outputs(decode_body(st, g.inp, self.targets))
        g.graph = graph
        graph.replay()  # the capture ran nothing: this replay is the step
        self.captures += 1
        log.info("cuda graph captured: %s (%d graphs)", g.key, len(self.graphs))
