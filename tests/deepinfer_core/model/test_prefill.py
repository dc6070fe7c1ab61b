"""The tiled prefill path (model.prefill, layers.window_attention) against the dense path it replaces.

Oracles: ``sink_attention`` over the dense window masks (float64, equal to 1e-9), the stable sort of
``select_topk`` (ids and validity identical, ties included), ``pick_entries`` over the whole score matrix
(identical), and for the executor the ``prefill_path="dense"`` executor and ``DeepSeekV41.forward_full``
(float64, 1e-9) with tiles and row pieces small enough that every request spans several of each.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model import fusion
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.layers.indexer import (
    index_scores,
    mask_scores,
    pick_entries,
    select_topk,
    select_topk_keyed,
)
from deepinfer_core.model.layers.window_attention import window_attention, window_attention_reference
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.prefill import select_entries

from .session import Session, chunks_of

TOL = 1e-9
T = 120


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(1, 70),
    hist=st.integers(0, 40),
    window=st.integers(1, 40),
    tile=st.integers(1, 24),
    floor_off=st.integers(-5, 80),
    n_b=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_tiled_window_attention_equals_dense_masks(
    m: int, hist: int, window: int, tile: int, floor_off: int, n_b: int, seed: int
) -> None:
    """Any chunk length (not a multiple of the tile), history shorter / longer than the window, windows
    wider than the chunk, floors inside the history or the chunk, with and without compressed keys."""
    g = torch.Generator().manual_seed(seed)
    h, d, s = 3, 8, 50
    key_pos0 = s - hist
    floor = max(0, key_pos0 + floor_off)
    q = torch.randn(m, h, d, generator=g, dtype=torch.float64)
    keys = torch.randn(hist + m, d, generator=g, dtype=torch.float64)
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    kb = torch.randn(m, n_b, d, generator=g, dtype=torch.float64) if n_b else None
    vb = torch.rand(m, n_b, generator=g) < 0.6 if n_b else None
    got = window_attention(q, keys, key_pos0, s, window, floor, sink, 0.35, kb, vb, tile=tile)
    want = window_attention_reference(q, keys, key_pos0, s, window, floor, sink, 0.35, kb, vb)
    assert (got - want).abs().max().item() < TOL


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 5),
    e=st.integers(1, 60),
    k=st.integers(1, 70),
    levels=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_keyed_topk_is_the_stable_sort(
    n: int, e: int, k: int, levels: int, dtype: torch.dtype, seed: int
) -> None:
    """Few distinct values (many ties), -0.0 beside +0.0, masked (-inf) entries, fully masked rows."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-levels, levels + 1, (n, e), generator=g).to(torch.float64) * 0.75).to(dtype)
    x[torch.rand(n, e, generator=g) < 0.25] = float("-inf")
    x[torch.rand(n, e, generator=g) < 0.15] = -0.0
    x[0, : e // 2] = float("-inf")
    if n > 1:
        x[1] = float("-inf")
    want_ids, want_valid = select_topk(x, k)
    got_ids, got_valid = select_topk_keyed(x, k)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_valid, want_valid)


@pytest.mark.parametrize("lid", [2, 4, 5, 6])  # ratio-2 Full; the candidate source; a candidate user; Reindex
@pytest.mark.parametrize("keyed", [False, True])
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 50),
    s=st.integers(0, 40),
    budget=st.sampled_from([1, 3000, 20000, 1 << 30]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_selection_equals_pick_entries(
    lid: int, keyed: bool, n: int, s: int, budget: int, ties: bool, seed: int
) -> None:
    """Rows scored a piece at a time (budget 1: one row per piece) pick the same ids, validity and
    candidate pool as pick_entries over the whole [n, E] matrix; ``ties`` draws integer-valued keys so
    many scores tie (the stable order decides)."""
    cfg = tiny_config()
    ratio = cfg.ratio(lid)
    e = (s + n) // ratio
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if keyed else torch.float64
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    qi = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
    ik = torch.randn(e, dim, generator=g, dtype=torch.float64)
    if ties:
        qi, ik = qi.sign(), (ik > 1).to(torch.float64)
    qi, ik = qi.to(dtype), ik.to(dtype)
    wi = torch.rand(n, heads, generator=g, dtype=torch.float64).to(dtype)
    pool_key = 0
    pools_a: dict = {}
    pools_b: dict = {}
    if cfg.uses_candidates(lid):  # a pool from the candidate source first (some entries allowed)
        pools_a[pool_key] = pools_b[pool_key] = torch.rand(n, e, generator=g) < 0.5
    visible = (s + 1 + torch.arange(n)) // ratio
    ent = torch.arange(e)
    sc = mask_scores(index_scores(qi, wi, ik), ent[None, :] < visible[:, None])
    want = pick_entries(cfg, lid, sc, visible, pools_a, pool_key)
    got = select_entries(cfg, lid, qi, wi, ik, s, ratio, pools_b, pool_key, budget=budget, keyed=keyed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert pools_a.keys() == pools_b.keys()
    for key in pools_a:
        assert torch.equal(pools_a[key], pools_b[key])


def _op_scores(
    op: Any, qi: torch.Tensor, wi: torch.Tensor, ik: torch.Tensor, s: int, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole [n, E] matrix through a backend's indexer_scores (the oracle side of the op tests)."""
    vis = (s + 1 + torch.arange(qi.shape[0], device=qi.device)) // ratio
    return op(qi, wi, ik, torch.zeros_like(vis), vis), vis


@pytest.mark.parametrize("lid", [2, 4, 5])
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 40),
    s=st.integers(0, 30),
    budget=st.sampled_from([1, 5000, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_chunked_selection_through_a_score_op(lid: int, n: int, s: int, budget: int, seed: int) -> None:
    """With a backend's ``indexer_scores`` (the reference op here: float32 scores) the pieces pick what
    pick_entries picks from the op's whole matrix; integer-valued inputs keep every score exact, so the
    comparison is exact whatever the summation order, and ties abound."""
    from deepinfer_kernels import get_op

    cfg = tiny_config()
    ratio, op = cfg.ratio(lid), get_op("indexer_scores", "reference")
    g = torch.Generator().manual_seed(seed)
    qi = torch.randint(-1, 2, (n, cfg.index_n_heads, cfg.index_head_dim), generator=g).float()
    ik = torch.randint(0, 2, ((s + n) // ratio, cfg.index_head_dim), generator=g).float()
    wi = torch.randint(0, 3, (n, cfg.index_n_heads), generator=g).float()
    pools_a: dict = {}
    pools_b: dict = {}
    if cfg.uses_candidates(lid):
        pools_a[0] = pools_b[0] = torch.rand(n, ik.shape[0], generator=g) < 0.5
    sc, vis = _op_scores(op, qi, wi, ik, s, ratio)
    want = pick_entries(cfg, lid, sc, vis, pools_a, 0)
    got = select_entries(cfg, lid, qi, wi, ik, s, ratio, pools_b, 0, budget=budget, score_op=op)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(pools_a[k], pools_b[k]) for k in pools_a)


@pytest.mark.parametrize("chunk", [7, 45, T])
def test_tiled_prefill_equals_full_forward(model64: DeepSeekV41, small_pieces: None, chunk: int) -> None:
    """Chunks shorter than the window (16), longer, one chunk; history (s > 0) from the rings."""
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(7))
    ref = model64.forward_full(seq)[0]
    s = Session(model64)
    assert s.ex.prefill_path == "tiled"
    got = s.run(0, seq, chunks_of(T, chunk))
    assert (got - ref).abs().max().item() < TOL


def test_tiled_prefill_with_quantised_caches_equals_dense(model64: DeepSeekV41, small_pieces: None) -> None:
    """FP4 / FP8 / MXFP4 caches (float64 model): the tiled path gathers its top-k keys from the request's
    entries dequantised once, the dense path dequantises each gathered row; same codec per entry, so the
    logits agree to summation order."""
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(11))
    got = {}
    for path in ("dense", "tiled"):
        s = Session(model64, quantize=True)
        s.ex.prefill_path = path
        got[path] = s.run(0, seq, [50, 70])
    assert (got["tiled"] - got["dense"]).abs().max().item() < TOL


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_tiled_executor_equals_dense_executor(model64: DeepSeekV41, data: st.DataObject) -> None:
    """The same steps (several requests per batch, random chunk lengths, decoder floors, snapshot
    positions) through a dense-path and a tiled-path executor: logits, snapshots and caches agree."""
    tile, budget = data.draw(st.integers(1, 9)), data.draw(st.sampled_from([1, 30_000, 1 << 30]))
    exs = [ModelExecutor(model64, 64, 16, 4, quantize=False) for _ in range(2)]
    for ex in exs:
        ex.prefill_tile, ex.prefill_budget = tile, budget
    exs[0].prefill_path = "dense"
    # up to 4 steps of <= 40 tokens per request: 160 tokens, 10 blocks of 16 each
    toks = np.random.default_rng(data.draw(st.integers(0, 999))).integers(0, 512, (3, 160))
    pos = [0, 0, 0]
    tables = np.arange(1, 1 + 3 * 10, dtype=np.int64).reshape(3, 10)
    for _ in range(data.draw(st.integers(1, 4))):
        reqs = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
        lens = [data.draw(st.integers(8, 40)) for _ in reqs]
        floors = [data.draw(st.integers(0, pos[r])) if data.draw(st.booleans()) else 0 for r in reqs]
        snaps = [data.draw(st.sampled_from([0, pos[r] + 1, pos[r] + n])) for r, n in zip(reqs, lens)]
        b = ForwardBatch(
            token_ids=np.concatenate([toks[r, pos[r] : pos[r] + n] for r, n in zip(reqs, lens)]),
            query_lens=lens,
            start_pos=[pos[r] for r in reqs],
            block_tables=tables[reqs],
            state_slots=reqs,
            num_logits=lens,
            decoder_floor=floors,
            snapshot_pos=snaps,
        )
        outs = [ex.execute(b) for ex in exs]
        assert (outs[0].logits - outs[1].logits).abs().max().item() < TOL
        for k in outs[0].snapshots:
            for x, y in zip(outs[0].snapshots[k], outs[1].snapshots[k]):
                # raw (unquantised) ring bytes: float64 keys
                assert (x.view(torch.float64) - y.view(torch.float64)).abs().max().item() < TOL
        for r, n in zip(reqs, lens):
            pos[r] += n
    for lid in model64.cfg.kv_source_layer_ids:
        assert (exs[0].kv[lid].view(torch.float64) - exs[1].kv[lid].view(torch.float64)).abs().max() < TOL


def test_tiled_prefill_glue_compiles_and_agrees(model64: DeepSeekV41) -> None:
    """Under ``fuse_glue`` the tiled path's marked functions compile whole (aot_eager on the CPU) and
    give the plain path's logits. Default tiles and budget: the glue compiles static shapes (one variant
    per shape, model.fusion), and tiles of 5 with small pieces give so many piece shapes that dynamo's
    recompile limit (64) is hit; the varlen path runs eagerly, launch-light, for that reason."""
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(9))
    want = Session(model64).run(0, seq, [40, 33, 47])
    fusion.set_backend("aot_eager")
    try:
        s = Session(model64)
        s.ex.fuse_glue = True
        got = s.run(0, seq, [40, 33, 47])
        assert fusion.compiled_count() > 0
    finally:
        fusion.set_backend(None)
    assert (got - want).abs().max().item() < TOL


@pytest.mark.gpu
def test_cuda_tiled_prefill_matches_dense_path(small_pieces: None) -> None:
    """On the GPU: float64 tiled prefill (tiles of 5, small pieces) equal to the CPU oracle to 1e-9; bf16
    with quantised caches near the dense path (a loose bound: rounding can flip an FP4 boundary and then a
    top-k choice); the keyed top-k equal to the stable sort on CUDA tensors."""
    cfg = tiny_config()
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(3))
    ref = DeepSeekV41.from_config(cfg, seed=1, dtype=torch.float64).forward_full(seq)[0]
    m64 = DeepSeekV41.from_config(cfg, seed=1, dtype=torch.float64, device="cuda")
    assert (Session(m64).run(0, seq, [7] * 17 + [1]).cpu() - ref).abs().max().item() < TOL
    m = DeepSeekV41.from_config(cfg, seed=1, dtype=torch.bfloat16, device="cuda")
    got = {}
    for path in ("dense", "tiled"):
        s = Session(m, quantize=True)
        s.ex.prefill_path = path
        got[path] = s.run(0, seq, [70, 50]).float()
    rel = ((got["tiled"] - got["dense"]).norm() / got["dense"].norm()).item()
    assert rel < 0.1
    x = torch.randint(-3, 4, (64, 3000), device="cuda").to(torch.bfloat16)
    x[:, ::7] = float("-inf")
    a, b = select_topk(x, 512), select_topk_keyed(x, 512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_cuda_chunked_selection_through_the_indexer_kernel() -> None:
    """The cuda backend's TileLang indexer_scores (16 heads: the kernel path) in row pieces picks exactly
    what pick_entries picks from the kernel's whole matrix (each query row is computed on its own, so
    pieces change nothing), with the keyed top-k."""
    from deepinfer_kernels import get_op

    cfg = tiny_config(index_n_heads=16, index_head_dim=64, index_topk=32)
    op = get_op("indexer_scores", "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    for lid, s, n in ((2, 0, 300), (4, 100, 257), (5, 37, 190)):
        ratio = cfg.ratio(lid)
        qi = torch.randn(n, 16, 64, device="cuda", generator=g).to(torch.bfloat16)
        ik = torch.randn((s + n) // ratio, 64, device="cuda", generator=g).to(torch.bfloat16)
        wi = torch.rand(n, 16, device="cuda", generator=g)
        pools_a: dict = {}
        pools_b: dict = {}
        if cfg.uses_candidates(lid):
            pools_a[0] = pools_b[0] = torch.rand(n, ik.shape[0], device="cuda", generator=g) < 0.5
        sc, vis = _op_scores(op, qi, wi, ik, s, ratio)
        want = pick_entries(cfg, lid, sc, vis, pools_a, 0)
        got = select_entries(cfg, lid, qi, wi, ik, s, ratio, pools_b, 0, budget=200_000, score_op=op)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lid
        assert all(torch.equal(pools_a[k], pools_b[k]) for k in pools_a)


def test_bf16_executor_scores_through_the_backend_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 executor with a backend scores the tiled prefill's indexer through the backend's
    ``indexer_scores`` (counted), and its logits are no further from a float64 oracle (the same weights,
    dense path) than the bf16 dense path's are. bf16 picks other entries at near-ties, so the two bf16
    paths differ by 2-15 % between themselves on this random model (a bound on that difference failed on
    one CPU and not another), while each is 20-35 % from float64 and within 2 % of the other's error;
    the exact checks are the selection tests."""
    from deepinfer_kernels import get_backend

    m = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.bfloat16)
    backend = get_backend("reference")
    calls: list[int] = []
    real = backend.op

    def op(name: str) -> Any:
        f = real(name)
        if name != "indexer_scores":
            return f
        return lambda *a: calls.append(1) or f(*a)

    monkeypatch.setattr(backend, "op", op)
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(3))
    got = {}
    for path in ("dense", "tiled"):
        s = Session(m)
        s.ex = ModelExecutor(m, 128, 16, 8, quantize=False, backend=backend)
        s.ex.prefill_path = path
        got[path] = s.run(0, seq, [70, 50]).float()
    assert calls  # only the tiled path asks for the op
    m64 = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float64)
    s = Session(m64)
    s.ex = ModelExecutor(m64, 128, 16, 8, quantize=False, backend=get_backend("reference"))
    s.ex.prefill_path = "dense"
    ref = s.run(0, seq, [70, 50]).double()
    err = {p: ((g.double() - ref).norm() / ref.norm()).item() for p, g in got.items()}
    assert err["tiled"] <= 1.15 * err["dense"], err


@pytest.mark.gpu
def test_cuda_backend_prefill_through_the_indexer_kernel() -> None:
    """The executor with the cuda backend (16 index heads: the TileLang indexer_scores path), bf16,
    quantised caches, prompts in two chunks: tiled logits near the dense path's (loose: fp32 kernel
    scores vs bf16 torch scores may pick other entries at near-ties, FP4 flips) and the same greedy
    token on most rows."""
    from deepinfer_kernels import get_backend

    cfg = tiny_config(index_n_heads=16)
    m = DeepSeekV41.from_config(cfg, seed=1, dtype=torch.bfloat16, device="cuda")
    seq = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(5))
    got = {}
    for path in ("dense", "tiled"):
        s = Session(m, quantize=True)
        s.ex = ModelExecutor(m, 128, 16, 8, quantize=True, backend=get_backend("cuda"))
        s.ex.prefill_path = path
        got[path] = s.run(0, seq, [64, 56]).float()
    rel = ((got["tiled"] - got["dense"]).norm() / got["dense"].norm()).item()
    assert rel < 0.15
    assert (got["tiled"].argmax(-1) == got["dense"].argmax(-1)).float().mean().item() > 0.5
