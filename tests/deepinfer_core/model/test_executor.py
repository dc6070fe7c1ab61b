"""The executor through the pools against the cache-free full forward (float64, tiny config).

Sequences are 120 tokens: past the window (16), with 60 ratio-2 and 120 ratio-1 compressed entries (top-k
8 selects a strict subset) and 30 candidate blocks of 4 (4 kept), so every mechanism is engaged; the
first test proves it by showing that each of them changes the logits.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from deepinfer_core.model import validation
from deepinfer_core.model.batch import BatchError, ForwardBatch
from deepinfer_core.model.model import DeepSeekV41

from .session import Session, chunks_of

T = 120
TOL = 1e-9  # float64 paths that differ only in summation order agree to ~1e-14; this leaves margin


def _tokens(seed: int, n: int = T) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def seq() -> torch.Tensor:
    return _tokens(7)


@pytest.fixture(scope="module")
def ref(model64: DeepSeekV41, seq: torch.Tensor) -> torch.Tensor:
    return model64.forward_full(seq)[0]


def _variant(model: DeepSeekV41, **over: object) -> DeepSeekV41:
    m = DeepSeekV41(attrs.evolve(model.cfg, **over)).to(torch.float64)
    m.load_state_dict(model.state_dict(), strict=False)
    return m


def test_long_sequence_engages_every_mechanism(
    model64: DeepSeekV41, seq: torch.Tensor, ref: torch.Tensor
) -> None:
    cfg = model64.cfg
    assert cfg.sliding_window < T and cfg.index_topk < T // 2
    assert T // cfg.candidate_block_size > cfg.candidate_topk_blocks
    # widening the window, the top-k or the candidate pool each changes the logits: all three bind
    for over in ({"sliding_window": T}, {"index_topk": T}, {"candidate_topk_blocks": T}):
        other = _variant(model64, **over).forward_full(seq)[0]
        assert (other - ref).abs().max() > 1e-3, over


def test_incremental_decode_equals_full_forward(
    model64: DeepSeekV41, seq: torch.Tensor, ref: torch.Tensor
) -> None:
    s = Session(model64)
    got = s.run(0, seq, [90] + [1] * (T - 90))
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("chunk", [7, 16, 45, T])
def test_chunked_prefill_equals_unchunked(
    model64: DeepSeekV41, seq: torch.Tensor, ref: torch.Tensor, chunk: int
) -> None:
    got = Session(model64).run(0, seq, chunks_of(T, chunk))
    assert (got - ref).abs().max().item() < TOL


def test_batch_of_mixed_lengths_equals_each_alone(model64: DeepSeekV41) -> None:
    seqs = {0: _tokens(1, 110), 1: _tokens(2, 104), 2: _tokens(3, 108)}
    # (seq, start, length, logits rows) per step: prefill chunks, a decode, draft-sized verify chunks
    plan = [
        [(0, 0, 50, 1), (1, 0, 101, 101), (2, 0, 7, 7)],
        [(0, 50, 40, 40), (1, 101, 1, 1), (2, 7, 3, 3)],
        [(2, 10, 98, 98), (0, 90, 20, 20), (1, 102, 2, 2)],
    ]
    batched = Session(model64)
    alone = {sid: Session(model64) for sid in seqs}
    for step in plan:
        items = [(sid, seqs[sid][st : st + n], st, k) for sid, st, n, k in step]
        out, per = batched.step(items)
        counts = torch.zeros_like(out.expert_counts)
        for item, got in zip(items, per):
            o1, (want,) = alone[item[0]].step([item])
            counts += o1.expert_counts
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < TOL
        assert torch.equal(out.expert_counts, counts)
    for sid, toks in seqs.items():  # and the final rows agree with the oracle
        last = model64.forward_full(toks)[0][-1]
        _, (row,) = batched.step([(sid, toks[-1:], len(toks) - 1, 1)])
        assert (row[0] - last).abs().max().item() < TOL


@pytest.mark.parametrize(("fed", "kept"), [(5, 1), (4, 0), (6, 3)])
def test_rollback_leaves_state_as_if_never_fed(model64: DeepSeekV41, fed: int, kept: int) -> None:
    toks = _tokens(11, 112)
    garbage = _tokens(12, fed)
    clean = Session(model64)
    want = clean.run(0, toks, [100] + [1] * 12)
    s = Session(model64)
    s.run(0, toks, [100])
    # a verify step: the real next tokens for the first `kept` rows, garbage after them
    fed_toks = torch.cat((toks[100 : 100 + kept], garbage[kept:]))
    s.step([(0, fed_toks, 100, fed)])
    # roll back the fed - kept rejected tokens: continue right after the accepted ones
    got = s.run(0, toks[100 + kept :], [1] * (12 - kept), start=100 + kept)
    assert (got - want[100 + kept :]).abs().max().item() < TOL


def test_rollback_deeper_than_backtrack_is_refused(model64: DeepSeekV41) -> None:
    s = Session(model64, backtrack=2)
    toks = _tokens(5, 40)
    s.run(0, toks, [30])
    with pytest.raises(BatchError, match="start_pos") as e:
        s.step([(0, toks[27:28], 27, 1)])
    assert e.value.request == 0 and e.value.field == "start_pos"


def test_bad_request_fails_alone_and_touches_nothing(
    model64: DeepSeekV41, seq: torch.Tensor, ref: torch.Tensor
) -> None:
    s = Session(model64)
    s.run(0, seq, [60])
    s._ensure(1, 10)
    ok = (0, seq[60:61], 60, 1)
    bad = torch.tensor([3, 600, 4])  # 600 >= vocab 512
    b = ForwardBatch(
        token_ids=torch.cat((ok[1], bad)).numpy(),
        query_lens=[1, 3],
        start_pos=[60, 0],
        block_tables=s.pool.block_tables([0, 1]),
        state_slots=[0, 1],
        num_logits=[1, 1],
    )
    with pytest.raises(BatchError, match="request 1: token_ids") as e:
        s.ex.execute(b)
    assert e.value.request == 1
    # the good request then runs alone and still matches the oracle
    got = s.run(0, seq[60:], [T - 60], start=60)
    assert (got - ref[60:]).abs().max().item() < TOL


def test_quantized_cache_bounds(model64: DeepSeekV41, seq: torch.Tensor, ref: torch.Tensor) -> None:
    """FP4 main KV / FP8 ring / MXFP4 indexer keys on: chunking still does not matter (same bytes are
    read), and the logits stay within a stated distance of the exact forward."""
    one = Session(model64, quantize=True).run(0, seq, [T])
    inc = Session(model64, quantize=True).run(0, seq, [64, *chunks_of(T - 64, 9)])
    assert (one - inc).abs().max().item() < 1e-6
    rel = ((one - ref).norm() / ref.norm()).item()
    # measured 0.29-0.38 over 3 seeds on random weights (FP4 is coarse and top-k choices flip); bound stated in docs
    assert rel < 0.5, rel
    assert rel > 1e-4  # quantisation really happened
    agree = (one.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.4, agree


def test_expert_counts_match_routing(model64: DeepSeekV41, seq: torch.Tensor) -> None:
    out, _ = Session(model64).step([(0, seq, 0, 1)])
    cfg = model64.cfg
    assert out.expert_counts.shape == (cfg.num_hidden_layers, cfg.n_routed_experts)
    assert (out.expert_counts.sum(1) == T * cfg.num_experts_per_tok).all()
    assert torch.equal(out.expert_counts, model64.forward_full(seq)[1])


def test_encoder_only_prefill_writes_the_decoder_global_kv(model64: DeepSeekV41, seq: torch.Tensor) -> None:
    """CED: the first decoder layer's compressed KV depends only on the encoder, so a prefix prefill can
    stop there; its bytes equal those of a full prefill, and the decoder SWA rings stay untouched."""
    enc = model64.cfg.encoder_layers
    full, part = Session(model64), Session(model64)
    full.run(0, seq, [T])
    part._ensure(0, T)
    out = part.ex.execute(
        ForwardBatch(
            token_ids=seq.numpy(),
            query_lens=[T],
            start_pos=[0],
            block_tables=part.pool.block_tables([0]),
            state_slots=[0],
            num_logits=[0],
            encoder_only=True,
        )
    )
    assert out.logits.shape[0] == 0 and out.expert_counts.shape[0] == enc
    table = torch.as_tensor(full.pool.block_tables([0])[0], dtype=torch.long)
    for cache in ("kv", "index_keys"):
        a, b = getattr(full.ex, cache)[enc][table], getattr(part.ex, cache)[enc][table]
        assert torch.equal(a.view(-1)[: T * a.shape[-1]], b.view(-1)[: T * b.shape[-1]])
    assert not part.ex.swa[enc].any() and full.ex.swa[enc].any()
    assert torch.equal(full.ex.swa[enc - 1], part.ex.swa[enc - 1])
    # a normal step on top of it would read the empty decoder rings: refused
    with pytest.raises(BatchError, match="encoder-only prefix"):
        part.step([(0, seq[:1], T, 1)])


def test_row_path_equals_request_path(model64: DeepSeekV41) -> None:
    """Decode / verify batches (every query_len <= backtrack + 1) take the row-wise path; it must
    agree with the per-request path, rollbacks included, and with the oracle."""
    seqs = {0: _tokens(21, 112), 1: _tokens(22, 112), 2: _tokens(23, 112)}
    rows, per_req = Session(model64), Session(model64)
    per_req.ex.row_path = False
    prefill = [(sid, t[:100], 0, 1) for sid, t in seqs.items()]
    rows.step(prefill)
    per_req.step(prefill)
    pos = dict.fromkeys(seqs, 100)
    for lens in ([1, 3, 7], [7, 1, 2], [2, 5, 1]):
        items = [(sid, seqs[sid][pos[sid] : pos[sid] + n], pos[sid], n) for sid, n in zip(seqs, lens)]
        _, a = rows.step(items)
        _, b = per_req.step(items)
        for x, y in zip(a, b):
            assert (x - y).abs().max().item() < TOL
        for sid, n in zip(seqs, lens):  # accept all but the last fed token: roll one back
            pos[sid] += max(n - 1, 1)
    for sid, toks in seqs.items():
        want = model64.forward_full(toks[: pos[sid] + 1])[0][-1]
        _, (got,) = rows.step([(sid, toks[pos[sid] : pos[sid] + 1], pos[sid], 1)])
        assert (got[0] - want).abs().max().item() < TOL


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("query_lens", {"query_lens": [2]}),
        ("start_pos", {"start_pos": [0, 0]}),
        ("num_logits", {"num_logits": [2]}),
        ("state_slots", {"state_slots": [9]}),
        ("start_pos", {"start_pos": [5]}),
        ("block_tables", {"block_tables": [[0]]}),
    ],
)
def test_invalid_fields_are_named(model64: DeepSeekV41, field: str, kw: dict) -> None:
    s = Session(model64)
    s._ensure(0, 1)
    base = {
        "token_ids": [3],
        "query_lens": [1],
        "start_pos": [0],
        "block_tables": s.pool.block_tables([0]),
        "state_slots": [0],
        "num_logits": [1],
    }
    with pytest.raises(BatchError, match=field):
        s.ex.execute(ForwardBatch(**{**base, **kw}))


@pytest.mark.parametrize(
    ("base", "over"),
    [
        ({}, {"rope_interleave": False}),
        ({}, {"compress_rope_position": "last"}),
        ({}, {"compress_rope_theta": None}),
        ({"swiglu_limit": 0.5}, {"swiglu_limit": 0.5, "shared_expert_clamp": False}),
    ],
)
def test_choice_switches_change_output_and_stay_exact(
    model64: DeepSeekV41, seq: torch.Tensor, base: dict, over: dict
) -> None:
    """Each config switch for a point where sources disagree is live (changes the logits), and the
    executor still matches the oracle under it."""
    before = _variant(model64, **base).forward_full(seq)[0] if base else model64.forward_full(seq)[0]
    m = _variant(model64, **over)
    want = m.forward_full(seq)[0]
    assert (want - before).abs().max() > 1e-6
    got = Session(m).run(0, seq, [50, 33, 37])
    assert (got - want).abs().max().item() < TOL


def test_captured_layer_states_match_a_truncated_model(model64: DeepSeekV41, seq: torch.Tensor) -> None:
    """capture_layers returns a layer's output residual for the logits rows: the last layer's, normed,
    gives the logits, and layer 5's equals layer 5's of the same model cut after it."""

    def run(m: DeepSeekV41, layers: tuple[int, ...]):
        s = Session(m)
        s._ensure(0, T)
        return s.ex.execute(
            ForwardBatch(
                token_ids=seq.numpy(),
                query_lens=[T],
                start_pos=[0],
                block_tables=s.pool.block_tables([0]),
                state_slots=[0],
                num_logits=[3],
                capture_layers=layers,
            )
        )

    out = run(model64, (5, 7))
    assert set(out.captured) == {5, 7} and out.captured[5].shape == (3, model64.cfg.hidden_size)
    assert torch.allclose(model64.logits(model64.norm(out.captured[7])), out.logits, atol=1e-12)
    cut = DeepSeekV41(
        attrs.evolve(
            model64.cfg,
            num_hidden_layers=6,
            compress_ratios=[0, 0, 2, 2, 1, 1],
            index_source_layer_ids=[2, 4],
            num_nextn_predict_layers=0,
            dspark_target_layer_ids=[],
        )
    ).to(torch.float64)
    # mHC coefficients are stacked per layer: keep the first 6 layers' (the drafter is dropped)
    sd = {
        k: (v[:6] if k.startswith("residual.") else v)
        for k, v in model64.state_dict().items()
        if not k.startswith("drafter.")
    }
    cut.load_state_dict(sd, strict=False)
    assert torch.allclose(run(cut, (5,)).captured[5], out.captured[5], atol=1e-12)


@pytest.mark.parametrize("quantize", [True, False])
def test_backend_ops_write_the_same_caches(model64: DeepSeekV41, seq: torch.Tensor, quantize: bool) -> None:
    """Cache writes through deepinfer_kernels' reference kv_store / swa_ring_write ops give bit-identical
    caches and logits to the executor's own writes (chunked prefill and decode, both paths)."""
    from deepinfer_kernels import get_backend

    plain, via = Session(model64, quantize=quantize), Session(model64, quantize=quantize)
    via.ex = type(via.ex)(
        model64,
        via.ex.num_blocks,
        via.ex.block_size,
        via.ex.num_slots,
        quantize=quantize,
        backend=get_backend("reference"),
    )
    chunks = [40, 23, 30, 1, 1, 5, 20]
    a, b = plain.run(0, seq, chunks), via.run(0, seq, chunks)
    assert torch.equal(a, b)
    for lid in model64.cfg.kv_source_layer_ids:
        assert torch.equal(plain.ex.kv[lid], via.ex.kv[lid]) and torch.equal(
            plain.ex.index_keys[lid], via.ex.index_keys[lid]
        )
    assert all(torch.equal(x, y) for x, y in zip(plain.ex.swa, via.ex.swa))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_vectorised_validation_agrees_with_the_per_request_rules(
    model64: DeepSeekV41, data: st.DataObject
) -> None:
    """The numpy fast path of ``validate`` accepts exactly the batches the request-by-request rules
    accept (which stay the error reporter): batches drawn valid against an executor with history, then
    (most of the time) one field pushed to or past a boundary: slots, the rollback window, token ids,
    logits counts, floors, snapshots, block-table entries, query lengths."""
    from deepinfer_core.model.executor import ModelExecutor

    ex = ModelExecutor(model64, 64, 16, 6, backtrack_tokens=3, quantize=False)
    ex.state.slot_end[:] = data.draw(st.lists(st.integers(0, 90), min_size=6, max_size=6))
    ex.state.encoder_only[:] = data.draw(st.lists(st.booleans(), min_size=6, max_size=6))
    ex.state.min_start[:] = data.draw(st.lists(st.integers(0, 60), min_size=6, max_size=6))
    v = model64.cfg.vocab_size
    r = data.draw(st.integers(1, 4))
    slots = data.draw(st.permutations(range(6)))[:r]
    q = data.draw(st.lists(st.integers(1, 5), min_size=r, max_size=r))
    start = [
        data.draw(
            st.sampled_from(
                sorted(
                    {
                        0,
                        max(int(ex.state.slot_end[sl]) - 3, 0),
                        int(ex.state.slot_end[sl]),
                        int(ex.state.min_start[sl]),
                    }
                )
            )
        )
        for sl in slots
    ]
    floor = [data.draw(st.integers(0, s0)) if data.draw(st.booleans()) else s0 for s0 in start]
    need = max(ex.blocks_needed(s0 + n0) for s0, n0 in zip(start, q))
    width = need + data.draw(st.integers(0, 2))
    b = dict(
        token_ids=data.draw(st.lists(st.integers(0, v - 1), min_size=sum(q), max_size=sum(q))),
        query_lens=q,
        start_pos=start,
        state_slots=list(slots),
        num_logits=[data.draw(st.integers(0, n0)) for n0 in q],
        block_tables=[data.draw(st.lists(st.integers(1, 63), min_size=width, max_size=width)) for _ in q],
        decoder_floor=floor,
        snapshot_pos=[
            data.draw(st.sampled_from([0, s0 + 1, s0 + n0, s0, s0 + n0 + 1])) for s0, n0 in zip(start, q)
        ],
    )
    bad = data.draw(
        st.sampled_from([None, None, "slot", "dup", "token", "start", "logits", "floor", "table", "qlen"])
    )
    i = data.draw(st.integers(0, r - 1))
    if bad == "slot":
        b["state_slots"][i] = data.draw(st.sampled_from([-1, 6]))
    elif bad == "dup" and r > 1:
        b["state_slots"][i] = b["state_slots"][(i + 1) % r]
    elif bad == "token":
        b["token_ids"][data.draw(st.integers(0, sum(q) - 1))] = data.draw(st.sampled_from([-1, v]))
    elif bad == "start":
        b["start_pos"][i] = data.draw(
            st.sampled_from(
                [-1, int(ex.state.slot_end[slots[i]]) + 1, max(int(ex.state.slot_end[slots[i]]) - 4, 1)]
            )
        )
    elif bad == "logits":
        b["num_logits"][i] = data.draw(st.sampled_from([-1, q[i] + 1]))
    elif bad == "floor":
        b["decoder_floor"][i] = data.draw(st.sampled_from([-1, start[i] + 1]))
    elif bad == "table" and width:
        b["block_tables"][i][data.draw(st.integers(0, width - 1))] = data.draw(st.sampled_from([0, -1, 64]))
    elif bad == "qlen":
        b["query_lens"][i] = 0
        b["token_ids"] = b["token_ids"][: sum(b["query_lens"])]
    batch = ForwardBatch(**b)
    try:
        validation.validate_rows(ex.state, batch)
        loop_ok = True
    except BatchError:
        loop_ok = False
    event(f"accepted: {loop_ok}")
    assert validation.rows_ok(ex.state, batch) == loop_ok


def test_executor_attributes_are_its_state_fields(model64: DeepSeekV41) -> None:
    """The executor's attributes are its ExecutorState's fields (one source of truth): set on one, seen on
    the other, including the caches the modules of a step write."""
    ex = Session(model64).ex
    st = ex.state
    assert ex.kv is st.kv and ex.swa is st.swa and ex.index_keys is st.index_keys
    ex.prefill_path, ex.row_path, ex.fused_attention = "dense", False, True
    assert (st.prefill_path, st.row_path, st.fused_attention) == ("dense", False, True)
    st.prefill_tile = 16
    assert ex.prefill_tile == 16
    assert type(ex).kv.name == "kv"  # the class attribute is the descriptor


def test_slot_state_round_trip(model64: DeepSeekV41, seq: torch.Tensor) -> None:
    """slot_state / load_slot_state move a slot's whole state: the next decode step on the new slot (same
    blocks) gives the logits of that step on the original slot; a state with missing fields is refused."""
    s = Session(model64)
    s.step([(0, seq[:40], 0, 1)])
    s._ensure(0, 41)
    orig = s.slot[0]
    other = (orig + 1) % s.ex.num_slots
    s.ex.load_slot_state(other, s.ex.slot_state(orig))

    def decode(slot: int) -> torch.Tensor:  # rewrites the same block entries with the same values
        b = ForwardBatch(
            token_ids=seq[40:41].numpy(),
            query_lens=[1],
            start_pos=[40],
            block_tables=s.pool.block_tables([0]),
            state_slots=[slot],
            num_logits=[1],
        )
        return s.ex.execute(b).logits

    moved, there = decode(other), decode(orig)
    assert torch.equal(moved, there)
    with pytest.raises(ValueError, match="slot state: fields"):
        s.ex.load_slot_state(other, {k: v for k, v in s.ex.slot_state(orig).items() if k != "floor"})
