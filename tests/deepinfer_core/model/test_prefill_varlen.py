"""The varlen prefill path (model.prefill_varlen, model.prefill_plan) against the per-request paths.

Oracles: the ``prefill_path="dense"`` executor (every query against every chunk key through dense masks,
``pick_entries`` on whole matrices) and the ``"tiled"`` one, float64 with raw caches, equal to 1e-9 in
logits, snapshots and every cache byte (main KV, indexer keys, SWA rings, compressor rings) over random
multi-request steps; ``DeepSeekV41.forward_full``; ``pick_entries`` per request for the selection (ids,
validity and candidate pools identical, ties included); and the number of torch ops of a step, which must
not grow with the number of requests.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.model import prefill
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.config import ModelConfig, tiny_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.layers.indexer import index_scores, mask_scores, pick_entries
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.prefill_plan import make_plan
from deepinfer_core.model.prefill_varlen import POOL_KEY, select_tiles

from .session import Session, chunks_of

TOL = 1e-9
PATHS = ("dense", "tiled", "varlen")
# the tiny config (ratios 2 and 1: SWA, Full, Reuse and Reindex layers, candidates), one with ratios 4 and
# 2, and one with a window of 8 and top-k 3 (most requests have more entries than the top-k)
CONFIGS = {
    "r2r1": tiny_config(),
    "r4r2": tiny_config(compress_ratios=[0, 0, 4, 4, 2, 2, 2, 2, 0, 0]),
    "w8k3": tiny_config(sliding_window=8, index_topk=3, candidate_block_size=2, candidate_topk_blocks=3),
}
MODELS: dict[str, DeepSeekV41] = {}


def model_of(name: str) -> DeepSeekV41:
    if name not in MODELS:
        MODELS[name] = DeepSeekV41.from_config(CONFIGS[name], seed=77, dtype=torch.float64)
    return MODELS[name]


def _bytes64(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float64) if t.dtype == torch.uint8 else t


def assert_same_caches(a: ModelExecutor, b: ModelExecutor, tag: str) -> None:
    """Every cache of two float64 raw-cache executors agrees to 1e-9."""
    for name in ("kv", "index_keys", "comp_state"):
        for lid, x in getattr(a, name).items():
            y = getattr(b, name)[lid]
            assert (_bytes64(x) - _bytes64(y)).abs().max().item() < TOL, (tag, name, lid)
    for lid, (x, y) in enumerate(zip(a.swa, b.swa)):
        assert (_bytes64(x) - _bytes64(y)).abs().max().item() < TOL, (tag, "swa", lid)


def draw_step(data: st.DataObject, pos: list[int], enc_only: list[bool], backtrack: int) -> dict[str, Any]:
    """One step's requests: continuing (or rolling back up to ``backtrack``), fresh, or all encoder-only;
    random lengths (1 .. 40: shorter and longer than the window and the ring), floors and snapshots."""
    reqs = data.draw(st.lists(st.integers(0, len(pos) - 1), min_size=1, max_size=len(pos), unique=True))
    encoder_only = data.draw(st.booleans()) and data.draw(st.booleans())
    starts, lens, floors, snaps = [], [], [], []
    for r in reqs:
        back = data.draw(st.integers(0, min(backtrack, pos[r]))) if data.draw(st.booleans()) else 0
        s = pos[r] - back
        n = data.draw(st.integers(1, 40))
        if enc_only[r] and not encoder_only and s > 0:
            f = s  # after an encoder-only step the decoder windows start at s
        else:
            f = data.draw(st.integers(0, s)) if data.draw(st.booleans()) else 0
        starts.append(s)
        lens.append(n)
        floors.append(f)
        snaps.append(data.draw(st.sampled_from([0, s + 1, s + n, s + 1 + (n - 1) // 2])))
    return dict(reqs=reqs, starts=starts, lens=lens, floors=floors, snaps=snaps, encoder_only=encoder_only)


@settings(max_examples=14, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(CONFIGS)))
def test_varlen_executor_equals_tiled_and_dense(name: str, data: st.DataObject) -> None:
    """Random multi-request steps (chunked prefill continuing, rollbacks, fresh requests, encoder-only
    steps, decoder floors, snapshots, tiles of 1-9 and pieces of a few rows) through a dense, a tiled and a
    varlen executor: logits, snapshots and every cache agree to 1e-9 after each step."""
    model = model_of(name)
    tile, budget = data.draw(st.integers(1, 9)), data.draw(st.sampled_from([1, 30_000, 1 << 30]))
    exs = {p: ModelExecutor(model, 64, 16, 4, quantize=False) for p in PATHS}
    for p, ex in exs.items():
        ex.prefill_path, ex.prefill_tile, ex.prefill_budget = p, tile, budget
    toks = np.random.default_rng(data.draw(st.integers(0, 999))).integers(0, 512, (4, 160))
    tables = np.arange(1, 1 + 4 * 12, dtype=np.int64).reshape(4, 12)
    pos, enc_only = [0] * 4, [False] * 4
    backtrack = exs["varlen"].backtrack
    for _ in range(data.draw(st.integers(1, 4))):
        d = draw_step(data, pos, enc_only, backtrack)
        reqs, starts, lens = d["reqs"], d["starts"], d["lens"]
        b = ForwardBatch(
            token_ids=np.concatenate([toks[r, s : s + n] for r, s, n in zip(reqs, starts, lens)]),
            query_lens=lens,
            start_pos=starts,
            block_tables=tables[reqs],
            state_slots=reqs,
            num_logits=[0] * len(reqs) if d["encoder_only"] else lens,
            decoder_floor=d["floors"],
            snapshot_pos=d["snaps"],
            encoder_only=d["encoder_only"],
        )
        outs = {p: ex.execute(b) for p, ex in exs.items()}
        for p in ("dense", "tiled"):
            if not d["encoder_only"]:
                assert (outs[p].logits - outs["varlen"].logits).abs().max().item() < TOL
            assert outs[p].snapshots.keys() == outs["varlen"].snapshots.keys()
            for k, x in outs[p].snapshots.items():
                assert (_bytes64(x) - _bytes64(outs["varlen"].snapshots[k])).abs().max().item() < TOL
            assert_same_caches(exs[p], exs["varlen"], p)
        for r, s, n in zip(reqs, starts, lens):
            pos[r], enc_only[r] = s + n, d["encoder_only"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunk", [9, 23, 70, 130])
def test_varlen_prefill_equals_full_forward(name: str, chunk: int, small_pieces: None) -> None:
    """One request in chunks shorter and longer than the window and the ring (22), history from the rings,
    tiles of 5 and pieces of a few rows: the logits of ``forward_full`` to 1e-9."""
    model = model_of(name)
    seq = torch.randint(0, 512, (130,), generator=torch.Generator().manual_seed(chunk))
    s = Session(model)
    s.ex.prefill_path = "varlen"
    assert s.ex.prefill_tile == 5
    got = s.run(0, seq, chunks_of(130, chunk))
    assert (got - model.forward_full(seq)[0]).abs().max().item() < TOL


def test_varlen_with_quantised_caches_equals_tiled(small_pieces: None) -> None:
    """FP4 / FP8 / MXFP4 caches, float64 model, three requests with history: varlen and tiled read the same
    bytes and dequantise each entry with the same codec, so the logits agree to summation order."""
    model = model_of("r2r1")
    seqs = [torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    got = {}
    for path in ("tiled", "varlen"):
        s = Session(model, quantize=True)
        s.ex.prefill_path = path
        first, _ = s.step([(i, seqs[i][: 20 + 15 * i], 0, 3) for i in range(3)])
        rest, _ = s.step([(i, seqs[i][20 + 15 * i :], 20 + 15 * i, 80 - 15 * i) for i in range(3)])
        got[path] = torch.cat((first.logits, rest.logits))
    assert (got["tiled"] - got["varlen"]).abs().max().item() < TOL


def test_bf16_backend_varlen_scores_over_key_ranges() -> None:
    """A bf16 executor with a backend scores the varlen indexer through its ``indexer_scores`` over one key
    range per piece (the path the cuda backend's TileLang kernel takes): three requests, two chunks, near
    the tiled path (which scores each request's rows through the same op). Measured equal (0.0) on the
    development CPU; bf16 GEMMs of other shapes may round differently, hence a bound."""
    from deepinfer_kernels import get_backend

    m = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.bfloat16)
    seqs = [torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    out = {}
    for path in ("tiled", "varlen"):
        s = Session(m, quantize=True)
        s.ex = ModelExecutor(m, 128, 16, 8, quantize=True, backend=get_backend("reference"))
        s.ex.prefill_path = path
        assert s.ex.state.index_score_op() is not None
        a, _ = s.step([(i, seqs[i][: 30 + 20 * i], 0, 30 + 20 * i) for i in range(3)])
        b, _ = s.step([(i, seqs[i][30 + 20 * i :], 30 + 20 * i, 90 - 20 * i) for i in range(3)])
        out[path] = torch.cat((a.logits, b.logits)).float()
    rel = ((out["varlen"] - out["tiled"]).norm() / out["tiled"].norm()).item()
    assert rel < 0.05, rel
    assert (out["varlen"].argmax(-1) == out["tiled"].argmax(-1)).float().mean().item() > 0.9


def _plan_for(
    lens: list[int], starts: list[int], tile: int, budget: int, ranged: bool
) -> tuple[Any, ModelExecutor]:
    model = DeepSeekV41.from_config(tiny_config(), seed=3)
    ex = ModelExecutor(model, 64, 16, 4, quantize=False)
    ex.prefill_tile, ex.prefill_budget = tile, budget
    ex.state.slot_end[: len(lens)] = starts  # as if those positions had been written
    b = ForwardBatch(
        token_ids=np.zeros(sum(lens), np.int64),
        query_lens=lens,
        start_pos=starts,
        block_tables=np.arange(1, 1 + 4 * 12, dtype=np.int64).reshape(4, 12)[: len(lens)],
        state_slots=list(range(len(lens))),
        num_logits=lens,
    )
    ex.validate(b)
    return make_plan(ex.state, b, ranged=ranged), ex


@pytest.mark.parametrize("lid", [2, 4, 5, 6])  # ratio-2 Full; the candidate source; a candidate user; Reindex
@settings(max_examples=20, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 50)), min_size=1, max_size=4),
    tile=st.integers(1, 9),
    budget=st.sampled_from([1, 4000, 1 << 30]),
    ties=st.booleans(),
    op=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_selection_equals_pick_entries_per_request(
    lid: int, reqs: list[tuple[int, int]], tile: int, budget: int, ties: bool, op: bool, seed: int
) -> None:
    """The varlen selection of several requests at once (tiles, pieces across requests, each row against
    its own request's entries padded to the piece's widest) picks, per request, exactly what
    ``pick_entries`` picks from that request's whole score matrix: ids and validity over its width, its
    candidate pool; columns past it invalid. ``ties``: integer-valued inputs (many equal scores, the
    stable order decides). ``op``: scores through the reference backend's ``indexer_scores`` over key ranges
    (float32; integer inputs keep it exact), the path a backend takes in bf16."""
    from deepinfer_kernels import get_op

    lens, starts = [n for n, _ in reqs], [s for _, s in reqs]
    plan, ex = _plan_for(lens, starts, tile, budget, ranged=op)
    cfg: ModelConfig = ex.cfg
    ratio, g = cfg.ratio(lid), torch.Generator().manual_seed(seed)
    e = [(s + n) // ratio for n, s in reqs]
    heads, dim, n_rows = cfg.index_n_heads, cfg.index_head_dim, sum(lens)
    if ties or op:
        qi = torch.randint(-1, 2, (n_rows, heads, dim), generator=g).float()
        ik = torch.randint(0, 2, (sum(e), dim), generator=g).float()
        wi = torch.randint(0, 3, (n_rows, heads), generator=g).float()
    else:
        qi, ik, wi = (
            torch.randn(n_rows, heads, dim, generator=g),
            torch.randn(sum(e), dim, generator=g),
            torch.rand(n_rows, heads, generator=g),
        )
    width = max(e)
    pool_rows = torch.rand(n_rows, width, generator=g) < 0.5
    if cfg.uses_candidates(lid):  # a pool from the candidate source first, in the tile layout
        plan.pools[POOL_KEY] = pool_rows[torch.cat([tr.reshape(-1) for tr in plan.tile_rows])]
    ent = plan.entries[ratio]
    score_op = get_op("indexer_scores", "reference") if op else None
    ids, valid = select_tiles(cfg, lid, qi, wi, ik, ent, plan, score_op=score_op)
    ids, valid = ids[plan.out_slot], valid[plan.out_slot]
    r0, e0 = 0, 0
    for (n, s), ei in zip(reqs, e):
        vis = (s + 1 + torch.arange(n)) // ratio
        pools: dict = {0: pool_rows[r0 : r0 + n, :ei]} if cfg.uses_candidates(lid) else {}
        if op:
            sc = get_op("indexer_scores", "reference")(
                qi[r0 : r0 + n], wi[r0 : r0 + n], ik[e0 : e0 + ei], torch.zeros_like(vis), vis
            )
        else:
            sc = mask_scores(
                index_scores(qi[r0 : r0 + n], wi[r0 : r0 + n], ik[e0 : e0 + ei]),
                torch.arange(ei)[None, :] < vis[:, None],
            )
        want = pick_entries(cfg, lid, sc, vis, pools, 0)
        k = want[0].shape[1]
        assert torch.equal(ids[r0 : r0 + n, :k], want[0]) and torch.equal(valid[r0 : r0 + n, :k], want[1])
        assert not valid[r0 : r0 + n, k:].any()
        if lid == cfg.candidate_source_layer_id:
            got_pool = plan.pools[POOL_KEY][plan.out_slot][r0 : r0 + n]
            assert torch.equal(got_pool[:, :ei], pools[0]) and not got_pool[:, ei:].any()
        r0, e0 = r0 + n, e0 + ei


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=40), tile=st.integers(1, 64))
def test_tiles_pad_at_most_twice_the_rows(lens: list[int], tile: int) -> None:
    """Each request's tiles have min(tile, n) rows rounded up to a power of two: one-row decode requests
    beside long prompts (a mixed step) are not padded to whole tiles, the tile layout has fewer than twice
    the step's rows, every row has one place in it, and there are at most log2(tile) + 2 buckets."""
    from deepinfer_core.model.prefill_plan import make_buckets

    b = ForwardBatch(
        token_ids=np.zeros(sum(lens), np.int64),
        query_lens=lens,
        start_pos=[0] * len(lens),
        block_tables=np.zeros((len(lens), 1), np.int64),
        state_slots=list(range(len(lens))),
        num_logits=[1] * len(lens),
    )
    buckets, out_slot = make_buckets(b, tile)
    layout = sum(t.count * t.tile for t in buckets)
    assert layout < 2 * sum(lens) + tile
    assert len(buckets) <= int(np.log2(tile)) + 2
    assert sorted(set(out_slot.tolist())) == sorted(out_slot.tolist()) and out_slot.max() < layout
    rows = np.concatenate([t.tile_rows.ravel() for t in buckets])
    assert np.array_equal(rows[out_slot], np.arange(sum(lens)))  # each row's slot holds that row


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched that compute (views, whose outputs alias an input, launch nothing;
    each other op is at least one kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        rets = func._schema.returns
        if not (rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(path: str, n_req: int, n: int, history: int, mixed: bool = False) -> int:
    """Aten ops of the layers' attention in one prefill step of ``n_req`` requests of ``n`` tokens each,
    after ``history`` tokens (``mixed``: the first request feeds 40 tokens, the others one, as decode rows
    beside a prompt). Only the attention: the eager MoE's op count follows which experts got tokens."""
    model = model_of("r2r1")
    ex = ModelExecutor(model, 256, 16, 16, quantize=True)
    ex.prefill_path = path
    tables = np.arange(1, 1 + 16 * 12, dtype=np.int64).reshape(16, 12)[:n_req]
    toks = np.random.default_rng(0).integers(0, 512, (n_req, history + max(n, 40)))

    def step(s: int, k: int) -> ForwardBatch:
        lens = [k] * n_req if not (mixed and s) else [40] + [1] * (n_req - 1)
        return ForwardBatch(
            token_ids=np.concatenate([toks[i, s : s + m] for i, m in enumerate(lens)]),
            query_lens=lens,
            start_pos=[s] * n_req,
            block_tables=tables,
            state_slots=list(range(n_req)),
            num_logits=[1] * n_req,
        )

    if history:
        ex.execute(step(0, history))
    counter = OpCounter()
    real = prefill.step_attention

    def counted(*args: Any) -> Any:
        attend, source = real(*args)

        def attend_counted(lid: int, a: Any, x: torch.Tensor) -> torch.Tensor:
            with counter:
                return attend(lid, a, x)

        return attend_counted, source

    prefill.step_attention = counted  # type: ignore[assignment]
    try:
        ex.execute(step(history, n))
    finally:
        prefill.step_attention = real  # type: ignore[assignment]
    return sum(counter.ops.values())


@pytest.mark.parametrize("history", [0, 30])
def test_varlen_op_count_does_not_grow_with_requests(history: int) -> None:
    """The layers' attention in a varlen prefill step of 16 requests dispatches exactly as many torch ops
    as with 4 requests of the same lengths (fresh, or continuing after 30 tokens: ring history, partial
    compressor groups; or one prompt beside one-row requests), while the tiled path's count grows with
    the requests."""
    varlen = {r: _step_ops("varlen", r, 12, history) for r in (4, 16)}
    tiled = {r: _step_ops("tiled", r, 12, history) for r in (4, 16)}
    assert varlen[16] == varlen[4], varlen
    assert tiled[16] > 3 * tiled[4] and tiled[16] > 8 * varlen[16], (tiled, varlen)
    if history:  # one prompt of 40 beside 3 or 15 one-row (decode) requests: two buckets either way
        mixed = {r: _step_ops("varlen", r, 12, history, mixed=True) for r in (4, 16)}
        assert mixed[16] == mixed[4], mixed


@pytest.mark.gpu
def test_cuda_varlen_prefill_matches_the_cpu_oracle(small_pieces: None) -> None:
    """On the GPU: float64 varlen prefill of three requests (chunked, tiles of 5, small pieces) equal to the
    CPU tiled path to 1e-9; bf16 with the cuda backend (16 index heads: the TileLang indexer kernel over key
    ranges) near the tiled path (loose: fp32 kernel scores vs near-ties, FP4 flips)."""
    from deepinfer_kernels import get_backend

    seqs = [torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run(model: DeepSeekV41, path: str, backend: Any = None, quantize: bool = False) -> torch.Tensor:
        s = Session(model, quantize=quantize)
        s.ex = ModelExecutor(model, 128, 16, 8, quantize=quantize, backend=backend)
        s.ex.prefill_path = path
        a, _ = s.step([(i, seqs[i][: 30 + 20 * i], 0, 30 + 20 * i) for i in range(3)])
        b, _ = s.step([(i, seqs[i][30 + 20 * i :], 30 + 20 * i, 90 - 20 * i) for i in range(3)])
        return torch.cat((a.logits, b.logits)).double().cpu()

    cfg = tiny_config()
    want = run(DeepSeekV41.from_config(cfg, seed=1, dtype=torch.float64), "tiled")
    got = run(DeepSeekV41.from_config(cfg, seed=1, dtype=torch.float64, device="cuda"), "varlen")
    assert (got - want).abs().max().item() < TOL
    cfg16 = tiny_config(index_n_heads=16)
    m = DeepSeekV41.from_config(cfg16, seed=1, dtype=torch.bfloat16, device="cuda")
    out = {p: run(m, p, get_backend("cuda"), quantize=True) for p in ("tiled", "varlen")}
    rel = ((out["varlen"] - out["tiled"]).norm() / out["tiled"].norm()).item()
    assert rel < 0.15
    assert (out["varlen"].argmax(-1) == out["tiled"].argmax(-1)).float().mean().item() > 0.5


@pytest.mark.gpu
def test_cuda_varlen_launches_do_not_grow_with_requests() -> None:
    """On the GPU with the cuda backend (bf16, quantised caches, the default path there): the kernels
    launched inside the layers' attention (``prefill.layer_attention``) of a prefill step of 16 requests
    equal those of 4 requests, continuing after 30 tokens; the tiled path launches more than 3x as many
    at 16 requests."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer_core.model.prefill_plan import LAYER_RANGE
    from deepinfer_kernels import get_backend

    model = DeepSeekV41.from_config(
        tiny_config(index_n_heads=16), seed=2, dtype=torch.bfloat16, device="cuda"
    )

    def launches(path: str, n_req: int) -> int:
        ex = ModelExecutor(
            model, 256, 16, 16, quantize=True, backend=get_backend("cuda"), draft_context=False
        )
        assert path == "tiled" or ex.prefill_path == "varlen"  # the cuda backend's default
        ex.prefill_path = path
        tables = np.arange(1, 1 + 16 * 12, dtype=np.int64).reshape(16, 12)[:n_req]
        toks = np.random.default_rng(0).integers(0, 512, (n_req, 42))

        def step(s: int, k: int) -> ForwardBatch:
            return ForwardBatch(
                token_ids=toks[:, s : s + k].reshape(-1),
                query_lens=[k] * n_req,
                start_pos=[s] * n_req,
                block_tables=tables,
                state_slots=list(range(n_req)),
                num_logits=[1] * n_req,
            )

        ex.execute(step(0, 30))
        ex.execute(step(0, 30))  # warm (kernel compiles)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ex.execute(step(30, 12))
            torch.cuda.synchronize()
        count, stack = 0, [(e, False) for e in prof.events() if e.cpu_parent is None]
        while stack:
            e, inside = stack.pop()
            inside = inside or e.name == LAYER_RANGE
            count += len(e.kernels) if inside else 0  # the device kernels this op launched
            stack.extend((c, inside) for c in e.cpu_children)
        return count

    varlen = {r: launches("varlen", r) for r in (4, 16)}
    assert varlen[16] == varlen[4] > 0, varlen
    assert launches("tiled", 16) > 3 * varlen[16], varlen
