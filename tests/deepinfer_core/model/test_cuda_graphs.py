"""The sync-free decode path and CUDA-graph decode steps (issue #24).

CPU: the bucketing / padding logic against brute force; the sync-free row path (forced on with the
reference backend) against the plain row path; no op that synchronises on CUDA in its step body (a
dispatch mode counts them; the plain row path is shown to have some, so the counter can fail); the MoE's
static mode against its grouped loop. GPU (marked ``gpu``): graph replay against eager steps on the cuda
backend (tiny model with exact caches; a narrow model of V4.1 head widths with FP4 / FP8 / MXFP4 caches),
padded rows writing nothing, no synchronisation inside a step body (torch's sync debug mode).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.model import cuda_graphs as cg
from deepinfer_core.model import decode_step
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.config import LAYER_FULL, LAYER_REINDEX, flash_config, tiny_config
from deepinfer_core.model.layers import moe as moe_mod
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_kernels import get_backend

from .session import Session

# ---------------------------------------------------------------- bucketing and padding (CPU)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=12, unique=True), st.integers(1, 320))
def test_bucket_for_is_the_smallest_bucket_that_holds(buckets: list[int], n: int) -> None:
    b = tuple(sorted(buckets))
    fits = [x for x in b if x >= n]
    assert cg.bucket_for(n, b) == (min(fits) if fits else None)


def test_check_buckets_names_the_field() -> None:
    assert cg.check_buckets([1, 2, 8]) == (1, 2, 8)
    for bad in ([], [2, 1], [1, 1], [0, 4], [1.5], [True]):
        with pytest.raises(ValueError, match="cuda_graph_buckets"):
            cg.check_buckets(bad)  # type: ignore[arg-type]


@given(st.integers(0, 10_000), st.integers(1, 700))
def test_round_up_and_width_bucket(n: int, q: int) -> None:
    r = cg.round_up(n, q)
    assert r % q == 0 and n <= r < n + q
    w = cg.width_bucket(n)
    assert w >= max(n, 1) and (w & (w - 1)) == 0 and (w == 1 or w // 2 < n)


def _decode_batch(rng: np.random.Generator, r: int, width: int) -> ForwardBatch:
    return ForwardBatch(
        token_ids=rng.integers(0, 500, r),
        query_lens=[1] * r,
        start_pos=rng.integers(1, 900, r),
        block_tables=rng.integers(1, 60, (r, width)),
        state_slots=rng.permutation(40)[:r],
        num_logits=[1] * r,
    )


@given(st.integers(1, 9), st.integers(0, 7), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_host_inputs_layout_and_padding(r: int, extra: int, width: int, seed: int) -> None:
    """The flat image decodes, through the same offsets the graph's views use, to the batch's rows
    followed by copies of row 0 (valid 0), tables zero-padded to the graph width."""
    rng = np.random.default_rng(seed)
    b = _decode_batch(rng, r, width)
    floors = rng.integers(0, 5, (r, 2))
    n, w = r + extra, cg.width_bucket(width + extra % 3)
    img = cg.host_inputs(b, floors, n, w)
    assert img.shape == (6 * n + n * w,)
    tok, pos, slot = img[:n], img[n : 2 * n], img[2 * n : 3 * n]
    fl, valid, tab = img[3 * n : 5 * n].reshape(n, 2), img[5 * n : 6 * n], img[6 * n :].reshape(n, w)
    for got, want in ((tok, b.token_ids), (pos, b.start_pos), (slot, b.state_slots), (fl, floors)):
        assert (got[:r] == want).all() and (got[r:] == want[0]).all()
    assert (valid[:r] == 1).all() and (valid[r:] == 0).all()
    assert (tab[:r, :width] == b.block_tables).all() and (tab[:r, width:] == 0).all()
    assert (tab[r:] == tab[0]).all()
    # with Engram row ids [L, r, C]: the same image, then the ids padded to [L, n, C] with row 0's
    ids = rng.integers(0, 2**31 - 1, (1 + extra % 2, r, 1 + width), dtype=np.int64).astype(np.int32)
    img2 = cg.host_inputs(b, floors, n, w, ids)
    assert img2.dtype == np.int64 and (img2[: img.shape[0]] == img).all()
    got = img2[img.shape[0] :].reshape(ids.shape[0], n, ids.shape[2])
    assert (got[:, :r] == ids).all() and (got[:, r:] == ids[:, :1]).all()


@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.integers(0, 5), st.integers(0, 2**31 - 1))
def test_host_inputs_of_multi_row_requests(qlens: list[int], extra: int, seed: int) -> None:
    """A verify step's image: one entry per row (token), each with its own position and its request's slot
    and block table (brute force from the batch), then copies of row 0."""
    rng = np.random.default_rng(seed)
    r, width = len(qlens), 3
    q = np.asarray(qlens)
    b = ForwardBatch(
        token_ids=rng.integers(0, 500, int(q.sum())),
        query_lens=q,
        start_pos=rng.integers(1, 900, r),
        block_tables=rng.integers(1, 60, (r, width)),
        state_slots=rng.permutation(40)[:r],
        num_logits=q,
    )
    n_rows = int(q.sum())
    floors = rng.integers(0, 5, (n_rows, 2))
    n, w = n_rows + extra, 4
    img = cg.host_inputs(b, floors, n, w)
    tok, pos, slot = img[:n], img[n : 2 * n], img[2 * n : 3 * n]
    tab = img[6 * n :].reshape(n, w)
    k = 0
    for i in range(r):
        for j in range(qlens[i]):
            assert (tok[k], pos[k], slot[k]) == (b.token_ids[k], b.start_pos[i] + j, b.state_slots[i])
            assert (tab[k, :width] == b.block_tables[i]).all() and (tab[k, width:] == 0).all()
            k += 1
    assert (pos[n_rows:] == pos[0]).all() and (slot[n_rows:] == slot[0]).all()
    assert (img[5 * n : 6 * n] == (np.arange(n) < n_rows)).all()
    assert decode_step.is_graph_step(b) and decode_step.is_pure_decode(b) == bool((q == 1).all())


def test_pure_decode_batches_only() -> None:
    rng = np.random.default_rng(0)
    b = _decode_batch(rng, 3, 2)
    assert decode_step.is_pure_decode(b)
    kw = dict(
        token_ids=b.token_ids, start_pos=b.start_pos, block_tables=b.block_tables, state_slots=b.state_slots
    )
    assert not decode_step.is_pure_decode(ForwardBatch(query_lens=[1, 1, 1], num_logits=[1, 0, 1], **kw))
    assert not decode_step.is_pure_decode(
        ForwardBatch(query_lens=[1, 1, 1], num_logits=[1] * 3, capture_layers=[2], **kw)
    )
    # a one-token row's snapshot is the ring after the step: taken after a replay as after an eager step
    assert decode_step.is_pure_decode(
        ForwardBatch(query_lens=[1, 1, 1], num_logits=[1] * 3, snapshot_pos=[0, 2, 0], **kw)
    )
    two = dict(kw, token_ids=np.r_[b.token_ids, 7])
    assert not decode_step.is_pure_decode(ForwardBatch(query_lens=[1, 2, 1], num_logits=[1] * 3, **two))
    assert decode_step.is_pure_decode(
        ForwardBatch(query_lens=[1, 1, 1], num_logits=[1] * 3, draft=[1, 0, 1], **kw)
    )
    # graph steps: every row a logits row (pure decode, or a verify step scoring each draft)
    verify = ForwardBatch(query_lens=[1, 2, 1], num_logits=[1, 2, 1], verify_lens=[0, 1, 0], **two)
    assert decode_step.is_graph_step(verify) and not decode_step.is_pure_decode(verify)
    assert not decode_step.is_graph_step(ForwardBatch(query_lens=[1, 2, 1], num_logits=[1] * 3, **two))
    assert not decode_step.is_graph_step(
        ForwardBatch(query_lens=[1, 1, 1], num_logits=[1] * 3, capture_layers=[2], **kw)
    )


def test_entries_needed_is_the_largest_visible_count(model64: DeepSeekV41) -> None:
    ex = Session(model64).ex
    pos = np.random.default_rng(1).integers(0, 500, 17)
    got = decode_step.entries_needed(ex.state, pos)
    cfg = model64.cfg
    ratios = {
        cfg.ratio(lid)
        for lid in range(cfg.num_hidden_layers)
        if cfg.layer_kind(lid) in (LAYER_FULL, LAYER_REINDEX)
    }
    assert set(got) == ratios
    for r, e in got.items():
        assert e == max((p + 1) // r for p in pos.tolist())


# ---------------------------------------------------------------- the sync-free path on the CPU

# aten ops that read a tensor back to the host (or size their output by its values) on a CUDA device
_SYNCING = {
    "_local_scalar_dense",
    "nonzero",
    "bincount",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "item",
}


class SyncOps(TorchDispatchMode):
    """Counts dispatched ops that would synchronise on CUDA (incl. boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: collections.Counter[str] = collections.Counter()
        self.on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.on:
            if name in _SYNCING or str(func) == "aten.repeat_interleave.Tensor":
                self.hits[name] += 1
            elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
            ):
                self.hits[name + "[bool]"] += 1
        return func(*args, **(kwargs or {}))


class _QuietBackend:
    """The reference backend with the counter off inside its ops (the cuda kernels do not synchronise;
    only the model's own ops are under test)."""

    def __init__(self, counter: SyncOps) -> None:
        self.ref, self.counter = get_backend("reference"), counter
        self.name = "reference"

    def op(self, name: str) -> Callable[..., Any]:
        f = self.ref.op(name)

        def quiet(*a: Any, **k: Any) -> Any:
            was, self.counter.on = self.counter.on, False
            try:
                return f(*a, **k)
            finally:
                self.counter.on = was

        return quiet

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ref, name)


def _run_steps(s: Session, seqs: dict[int, torch.Tensor]) -> torch.Tensor:
    """Prefill chunks, decode steps with a request joining late, a 4-token (verify-sized) step."""
    out = []
    _, per = s.step([(0, seqs[0][:30], 0, 1), (1, seqs[1][:23], 0, 1)])
    out += per
    for p in range(30, 41):
        items = [(0, seqs[0][p : p + 1], p, 1), (1, seqs[1][p - 7 : p - 6], p - 7, 1)]
        if p >= 36:
            items.append((2, seqs[2][p - 36 : p - 35], p - 36, 1))
        _, per = s.step(items)
        out += per
    _, per = s.step([(0, seqs[0][41:45], 41, 4), (1, seqs[1][34:37], 34, 2)])
    return torch.cat(out + per)


def _sync_free(s: Session, backend: Any) -> Session:
    ex = s.ex
    s.ex = type(ex)(
        ex.model, ex.num_blocks, ex.block_size, ex.num_slots, quantize=ex.fmt.quantized, backend=backend
    )
    s.ex.sync_free = True  # the cuda backend's path, forced on the CPU
    return s


def test_sync_free_row_path_equals_plain_row_path(
    model64: DeepSeekV41, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(11)
    seqs = {i: torch.randint(0, 512, (60,), generator=g) for i in range(3)}
    counter = SyncOps()
    counter.on = False
    body = decode_step.decode_body

    def counted(*a: Any, **k: Any) -> Any:
        counter.on = True
        try:
            return body(*a, **k)
        finally:
            counter.on = False

    monkeypatch.setattr(decode_step, "decode_body", counted)
    plain = _run_steps(Session(model64), seqs)
    with counter:
        fast = _run_steps(_sync_free(Session(model64), _QuietBackend(counter)), seqs)
    assert (fast - plain).abs().max().item() < 1e-10
    assert not counter.hits, counter.hits
    # the counter does see the plain path's synchronising ops
    plain_counter = SyncOps()
    s = Session(model64)
    s.step([(0, seqs[0][:30], 0, 1)])
    with plain_counter:
        s.step([(0, seqs[0][30:31], 30, 1)])
    assert plain_counter.hits


def test_sync_free_quantized_caches_match(model64: DeepSeekV41) -> None:
    g = torch.Generator().manual_seed(12)
    seqs = {i: torch.randint(0, 512, (60,), generator=g) for i in range(3)}
    a, b = (
        Session(model64, quantize=True),
        _sync_free(Session(model64, quantize=True), get_backend("reference")),
    )
    la, lb = _run_steps(a, seqs), _run_steps(b, seqs)
    assert (la - lb).abs().max().item() < 1e-10
    for lid in model64.cfg.kv_source_layer_ids:
        assert torch.equal(a.ex.kv[lid], b.ex.kv[lid]) and torch.equal(
            a.ex.index_keys[lid], b.ex.index_keys[lid]
        )
    assert all(torch.equal(x, y) for x, y in zip(a.ex.swa, b.ex.swa))


def test_moe_static_mode_matches_grouped_loop(model64: DeepSeekV41) -> None:
    from deepinfer_core.eplb import rebalance_experts

    x = torch.randn(
        37, model64.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    m = model64.layers[3].ffn
    want, wc = m(x)
    with moe_mod.static_shapes():
        got, gc = m(x)
    assert torch.equal(wc, gc) and (got - want).abs().max().item() < 1e-12
    mask = torch.arange(37) % 3 != 0
    with moe_mod.static_shapes(row_mask=mask):
        _, mc = m(x)
    assert torch.equal(mc, m(x[mask])[1])
    load = np.random.default_rng(0).random((model64.cfg.num_hidden_layers, 8)) + 0.1
    model64.set_expert_placement(*rebalance_experts(load, 12, 1, 1, 4))
    try:
        placed, pc = m(x)
        with moe_mod.static_shapes():
            got, gc = m(x)
    finally:
        model64.set_expert_placement(None)
    assert torch.equal(pc, gc) and (got - placed).abs().max().item() < 1e-12


# ---------------------------------------------------------------- on the GPU


def v41_heads_config(hc_mult: int) -> Any:
    """A narrow model of V4.1 head widths (4 layers: SWA, ratio 2, ratio 1 x 2; Engram, MoE, candidates)."""
    return flash_config(
        vocab_size=2048,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=256,
        o_lora_rank=256,
        o_groups=2,
        compress_ratios=[0, 2, 1, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2, 3],
        num_encoder_layers=2,
        index_n_heads=4,
        candidate_source_layer_id=2,
        candidate_topk_blocks=8,
        index_topk=32,
        n_routed_experts=8,
        moe_intermediate_size=256,
        engram_layer_ids=[1],
        engram_table_sizes=[1009],
        hc_mult=hc_mult,
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
        dspark_noise_token_id=2047,
    )


def _cuda_session(
    model: DeepSeekV41, quantize: bool, graphs: bool, slots: int = 8, blocks: int = 256, block_size: int = 16
) -> Session:
    s = Session(model, quantize=quantize, num_blocks=blocks, block_size=block_size, slots=slots)
    s.ex = type(s.ex)(
        model, blocks, block_size, slots, quantize=quantize, backend=get_backend("cuda"), cuda_graphs=graphs
    )
    return s


def greedy_plain_and_flagged(
    model: DeepSeekV41,
    quantize: bool,
    prompts: dict[int, torch.Tensor],
    steps: int,
    drop_at: int,
    **flags: bool,
) -> tuple[tuple[list, list], tuple[list, list], Session]:
    """:func:`_greedy` on two cuda sessions with graphs, the second with executor ``flags`` set (an opt-in
    kernel; the plain session has those switches off, whatever the executor's default):
    ((tokens, logits) plain, (tokens, logits) flagged, the flagged session)."""
    plain, flagged = _cuda_session(model, quantize, graphs=True), _cuda_session(model, quantize, graphs=True)
    for name, v in flags.items():
        setattr(plain.ex, name, False)
        setattr(flagged.ex, name, v)
    return _greedy(plain, prompts, steps, drop_at), _greedy(flagged, prompts, steps, drop_at), flagged


def _greedy(s: Session, prompts: dict[int, torch.Tensor], steps: int, drop_at: int) -> tuple[list, list]:
    """Prefill each prompt alone, then batched greedy decode; request 0 leaves after ``drop_at`` steps."""
    last, pos, toks, logits = {}, {}, {i: [] for i in prompts}, []
    for i, p in prompts.items():
        _, per = s.step([(i, p, 0, 1)])
        last[i], pos[i] = int(per[0][-1].argmax()), len(p)
    for k in range(steps):
        ids = [i for i in prompts if not (i == 0 and k >= drop_at)]
        _, per = s.step([(i, torch.tensor([last[i]]), pos[i], 1) for i in ids])
        for i, lg in zip(ids, per):
            logits.append(lg[-1].double().cpu())
            last[i] = int(lg[-1].argmax())
            toks[i].append(last[i])
            pos[i] += 1
    return [toks[i] for i in prompts], logits


@pytest.mark.gpu
def test_graph_replay_equals_eager_tiny_exact_caches() -> None:
    model = DeepSeekV41.from_config(tiny_config(), seed=3, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(21)
    prompts = {i: torch.randint(0, 512, (int(n),), generator=g) for i, n in enumerate((40, 27, 33))}
    eager = _cuda_session(model, False, graphs=False)
    graph = _cuda_session(model, False, graphs=True)
    te, le = _greedy(eager, prompts, 24, drop_at=10)
    tg, lg = _greedy(graph, prompts, 24, drop_at=10)
    gr = graph.ex.graphs()
    assert gr.captures >= 2 and gr.replays == 24 and not gr.failed  # buckets 4 (3 padded to 4) and 2
    assert te == tg
    for a, b in zip(le, lg):
        assert ((a - b).norm() / a.norm()).item() < 1e-4
    # padded rows wrote nothing: unused slots' rings and compressor states, and the null block, are zero
    used = set(graph.slot.values())
    free = [k for k in range(graph.ex.num_slots) if k not in used]
    assert all(not r[free].any() for r in graph.ex.swa)
    assert all(not c[free].any() for c in graph.ex.comp_state.values())
    assert all(not t[0].any() for t in (*graph.ex.kv.values(), *graph.ex.index_keys.values()))


@pytest.mark.gpu
def test_one_failed_capture_costs_only_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails for one batch bucket leaves that bucket eager and every other bucket captured
    (2026-12-04: one failure turned graphs off for the whole process); tokens still equal the eager run."""
    from deepinfer_core.model import cuda_graphs

    model = DeepSeekV41.from_config(tiny_config(), seed=3, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(23)
    prompts = {i: torch.randint(0, 512, (int(n),), generator=g) for i, n in enumerate((40, 27, 33))}
    real = cuda_graphs.DecodeGraphs._capture

    def capture(self: cuda_graphs.DecodeGraphs, gr: object) -> None:
        if gr.key.batch == 4:  # type: ignore[attr-defined]  # the 3-request bucket: its capture breaks
            raise RuntimeError("planted capture failure")
        real(self, gr)  # type: ignore[arg-type]

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture)
    te, _ = _greedy(_cuda_session(model, False, graphs=False), prompts, 16, drop_at=6)
    graph = _cuda_session(model, False, graphs=True)
    tg, _ = _greedy(graph, prompts, 16, drop_at=6)
    gr = graph.ex.graphs()
    assert {k.batch for k in gr.failed} == {4} and not gr.disabled
    assert gr.captures >= 1 and all(k.batch == 2 for k in gr.graphs)  # after the drop: 2 requests, bucket 2
    assert te == tg


@pytest.mark.gpu
def test_graph_replay_quantized_v41_head_widths() -> None:
    """FP4 / FP8 / MXFP4 caches through the TileLang kernels, bf16: greedy tokens equal, logits close."""
    cfg = v41_heads_config(hc_mult=2)
    model = DeepSeekV41.from_config(cfg, seed=4, dtype=torch.bfloat16, device="cuda", init_on_device=True)
    g = torch.Generator().manual_seed(22)
    prompts = {
        i: torch.randint(0, 2048, (int(n),), generator=g) for i, n in enumerate((300, 180, 257, 90, 140))
    }
    kw = dict(slots=8, blocks=128, block_size=64)
    te, le = _greedy(_cuda_session(model, True, graphs=False, **kw), prompts, 16, drop_at=6)
    graph = _cuda_session(model, True, graphs=True, **kw)
    tg, lg = _greedy(graph, prompts, 16, drop_at=6)
    assert not graph.ex.graphs().failed and graph.ex.graphs().captures >= 2
    same = sum(a == b for x, y in zip(te, tg) for a, b in zip(x, y))
    assert same >= 0.95 * sum(map(len, te)), (te, tg)  # bf16 + quantised caches: rare near-ties may flip
    errs = [((a - b).norm() / a.norm()).item() for a, b in zip(le, lg)]
    assert float(np.median(errs)) < 2e-2, errs


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
def test_sync_free_step_body_has_no_host_sync(monkeypatch: pytest.MonkeyPatch, quantize: bool) -> None:
    """torch's sync debug mode set to error inside the step body (eager, graphs off): any
    synchronising call there raises (exact caches, and the tiny model's quantised caches, whose 66-byte
    fp8 rows take the static torch store instead of the TileLang kernel)."""
    model = DeepSeekV41.from_config(tiny_config(), seed=5, dtype=torch.float32, device="cuda")
    body = decode_step.decode_body
    calls = []

    def strict(*a: Any, **k: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return body(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls.append(1)

    monkeypatch.setattr(decode_step, "decode_body", strict)
    s = _cuda_session(model, quantize, graphs=False)
    g = torch.Generator().manual_seed(23)
    prompts = {i: torch.randint(0, 512, (30 + 7 * i,), generator=g) for i in range(3)}
    _greedy(s, prompts, 6, drop_at=3)
    assert len(calls) == 6


@pytest.mark.gpu
def test_sync_free_gpu_matches_plain_float64() -> None:
    model = DeepSeekV41.from_config(tiny_config(), seed=6, dtype=torch.float64, device="cuda")
    g = torch.Generator().manual_seed(24)
    seqs = {i: torch.randint(0, 512, (60,), generator=g) for i in range(3)}
    plain = _run_steps(Session(model), seqs)
    s = _cuda_session(model, False, graphs=False)
    assert s.ex.sync_free
    fast = _run_steps(s, seqs)
    assert (fast - plain).abs().max().item() < 1e-9


def test_moe_static_grouped_padded_rows_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped-GEMM static path (torch._grouped_mm, bf16; forced on the CPU): appending masked copies
    of row 0 (a graph's padding) leaves the real rows' outputs and the counts as without them."""
    model = DeepSeekV41.from_config(tiny_config(), seed=7, dtype=torch.bfloat16)
    m = model.layers[2].ffn
    monkeypatch.setattr(moe_mod, "_grouped_ok", lambda x: x.dtype == torch.bfloat16)
    x = torch.randn(13, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ref, rc = m._forward_loop(x)  # the grouped loop
    with moe_mod.static_shapes():
        got, gc = m(x)
    padded = torch.cat((x, x[:1].expand(5, -1)))
    with moe_mod.static_shapes(row_mask=torch.arange(18) < 13):
        pad, pc = m(padded)
    assert torch.equal(rc, gc) and torch.equal(rc, pc)
    for y in (got, pad[:13]):
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
def test_graphs_on_and_off_equal_the_cpu_reference_float64() -> None:
    """The issue's check: greedy outputs of the cuda backend equal the reference's, graphs on and off
    (float64, exact caches: to 1e-9)."""
    cpu = DeepSeekV41.from_config(tiny_config(), seed=9, dtype=torch.float64)
    gpu = DeepSeekV41.from_config(tiny_config(), seed=9, dtype=torch.float64, device="cuda")
    g = torch.Generator().manual_seed(41)
    prompts = {i: torch.randint(0, 512, (int(n),), generator=g) for i, n in enumerate((35, 22, 41))}
    tr, lr = _greedy(Session(cpu), prompts, 14, drop_at=6)
    for graphs in (False, True):
        s = _cuda_session(gpu, False, graphs=graphs)
        tg, lg = _greedy(s, prompts, 14, drop_at=6)
        assert tg == tr, graphs
        assert max((a - b).abs().max().item() for a, b in zip(lr, lg)) < 1e-9, graphs
        if graphs:
            assert s.ex.graphs().captures >= 2 and not s.ex.graphs().failed


@pytest.mark.gpu
@pytest.mark.parametrize("glue", [False, True], ids=["eager-glue", "fused-glue"])
def test_big_then_small_batch_both_captured_in_one_process(glue: bool) -> None:
    """Issue #32: decode at B = 64, then at B = 1, on one executor: both buckets are captured and replayed
    (2026-12-04: after the B = 64 capture the B = 1 step ran eagerly at 79 ms, a Dynamo guard failing
    inside the fused glue's capture), no key failed, and B = 1's tokens equal an eager session's."""
    model = DeepSeekV41.from_config(tiny_config(), seed=5, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(29)
    prompts = {i: torch.randint(0, 512, (int(n),), generator=g) for i, n in enumerate(range(20, 84))}
    sessions = {}
    for graphs in (False, True):
        s = _cuda_session(model, True, graphs=graphs, slots=64, blocks=1024)
        s.ex.fuse_glue = glue and graphs
        last, pos = {}, {}
        for i, p in prompts.items():
            _, per = s.step([(i, p, 0, 1)])
            last[i], pos[i] = int(per[0][-1].argmax()), len(p)
        toks: list[int] = []
        for k in range(12):  # 6 steps of all 64 requests, then 6 of request 0 alone
            ids = list(prompts) if k < 6 else [0]
            _, per = s.step([(i, torch.tensor([last[i]]), pos[i], 1) for i in ids])
            for i, lg in zip(ids, per):
                last[i], pos[i] = int(lg[-1].argmax()), pos[i] + 1
            toks.append(last[0])
        sessions[graphs] = (s, toks)
    gr = sessions[True][0].ex.graphs()
    assert not gr.failed and not gr.disabled
    assert {1, 64} <= {k.batch for k in gr.graphs} and gr.replays == 12
    assert sessions[True][1] == sessions[False][1]


# ---------------------------------------------------------------- verify steps through the graph path (CPU)


def _padded_static_engine(envs: Any, **kw: Any) -> Any:
    """A speculative engine whose executor runs the cuda backend's path on the CPU: sync-free row steps,
    and every graph step (pure decode and verify) through ``DecodeGraphs(capture=False)``: the padded
    static inputs a captured graph reads, run eagerly."""
    from deepinfer_core.engine import LLMEngine
    from deepinfer_core.engine.config import EngineConfig

    eng = LLMEngine(EngineConfig(**kw), envs=envs)
    ex = eng.executor
    ex.sync_free = True
    ex.cuda_graphs = True
    ex._graphs = cg.DecodeGraphs(ex.state, capture=False)  # the executor's graphs, without CUDA
    return eng


@pytest.mark.parametrize("varlen", [True, False], ids=["mtp_varlen", "fixed_length"])
def test_verify_steps_run_through_the_graph_path_and_equal_eager(varlen: bool) -> None:
    """Speculative verify steps (a request's last token and its drafts as rows) take the graph path, keyed
    by row count and padded like decode steps; the engine's tokens equal the eager speculative engine's
    and the plain engine's (float64, raw KV), and the rows the graphs ran include multi-row requests."""
    from deepinfer_core.engine import LLMEngine
    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.envs import Envs
    from deepinfer_core.sampling_params import SamplingParams

    kw = dict(
        model="tiny-random",
        seed=7,
        dtype="float64",
        quantize=False,
        num_blocks=256,
        block_size=8,
        max_num_seqs=8,
        speculative=True,
    )
    envs = Envs(enable_mtp_varlen=varlen)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 40, 6)]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(6, 20, 6)
    ]

    def tokens(eng: Any) -> dict:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            eng.add_request(f"r{i}", p, sp)
        out = {}
        while eng.has_unfinished():
            out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        return out

    graphed = _padded_static_engine(envs, **kw)
    rows: list[tuple[int, int]] = []
    real = graphed.executor.graphs().run

    def spy(b: ForwardBatch, *a: Any, **k: Any) -> Any:
        rows.append((b.num_requests, b.num_tokens))
        return real(b, *a, **k)

    graphed.executor.graphs().run = spy  # type: ignore[method-assign]
    got = tokens(graphed)
    assert got == tokens(LLMEngine(EngineConfig(**kw), envs=envs))
    assert got == tokens(LLMEngine(EngineConfig(**{**kw, "speculative": False})))
    assert any(t > r for r, t in rows), rows  # verify steps (drafts as rows) took the graph path
    assert graphed.executor.graphs().replays == len(rows)


@pytest.mark.gpu
def test_cuda_verify_steps_replay_graphs_and_equal_eager() -> None:
    """On the GPU: a speculative engine's verify steps replay captured graphs (keyed by row count) and its
    greedy tokens equal the same engine's with graphs off (float64, raw KV)."""
    from deepinfer_core.engine import LLM
    from deepinfer_core.envs import Envs
    from deepinfer_core.sampling_params import SamplingParams

    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 40, 6)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(model="tiny-random", seed=7, dtype="float64", quantize=False, num_blocks=256, max_num_seqs=8)
    out = {}
    for graphs in (False, True):
        llm = LLM(backend="cuda", speculative=True, envs=Envs(cuda_graphs=graphs), **kw)
        out[graphs] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if graphs:
            g = llm.engine.executor.graphs()
            assert not g.failed and g.replays > 0
            assert any(k.batch > 8 for k in g.graphs), g.graphs  # > the 6 requests' bucket: rows of drafts
    assert out[True] == out[False]
