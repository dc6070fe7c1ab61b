"""The replay planner on edge cases and, by hypothesis, its invariants on random shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.swa import (
    ENCODER_PREFILL,
    ENCODER_REPLAY,
    ENCODER_RESTORE,
    EXACT,
    PREFILL,
    TAIL,
    ReplayConfig,
    plan_replay,
)

# the tiny model's shape: 8 layers, encoder 0-3, window 16, ratios [0,0,2,2,1,1,1,1]
TINY = dict(window=16, num_layers=8, encoder_layers=4, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], block_size=8)


def kinds(p):
    return [s.kind for s in p.steps]


def test_hit_shorter_than_window_replays_from_zero_exactly():
    cfg = ReplayConfig(keep=22, **TINY)
    p = plan_replay(cfg, 100, 8)
    assert p.hit == 8 and kinds(p) == [ENCODER_REPLAY, ENCODER_PREFILL, TAIL]
    rep, pre, tail = p.steps
    assert (rep.start, rep.end, rep.layers, rep.writes_blocks) == (0, 8, (0, 4), False)
    assert (pre.start, pre.end, pre.layers, pre.source_layer) == (8, 78, (0, 4), 4)
    assert (tail.start, tail.end, tail.layers, tail.floor, tail.floor_layers) == (78, 100, (0, 8), 78, (4, 8))
    assert p.encoder_replay_tokens == 8 and p.decoder_replay_tokens == 22 and p.replayed_tokens == 30
    assert not p.exact  # 22 tail tokens < 4 * 15 + 1


def test_hit_exactly_window_and_longer():
    cfg = ReplayConfig(keep=22, **TINY)
    p = plan_replay(cfg, 100, 16)
    assert (p.steps[0].start, p.steps[0].end) == (0, 16)
    p = plan_replay(cfg, 100, 64)
    rep = p.steps[0]
    assert (rep.start, rep.end, rep.floor) == (48, 64, 48)  # the last w tokens, truncated at 48
    assert p.encoder_replay_tokens == 16


def test_host_copy_skips_the_encoder_replay():
    cfg = ReplayConfig(keep=22, **TINY)
    p = plan_replay(cfg, 100, 64, host_state=True)
    assert kinds(p) == [ENCODER_RESTORE, ENCODER_PREFILL, TAIL] and p.encoder_replay_tokens == 0
    assert plan_replay(cfg, 100, 64, host_state=[32, 64]).encoder_restored
    assert not plan_replay(cfg, 100, 64, host_state=[32, 56]).encoder_restored


def test_hit_is_trimmed_to_leave_the_tail_new_and_to_blocks():
    cfg = ReplayConfig(keep=22, **TINY)
    p = plan_replay(cfg, 100, 96)
    assert p.hit == 72 and p.requested_hit == 96  # <= 100 - 22 = 78, down to a block of 8
    assert p.steps[-1].start == 78
    assert plan_replay(cfg, 20, 16).hit == 0  # nothing left once the tail is new: a plain prefill
    assert kinds(plan_replay(cfg, 20, 16)) == [PREFILL]


def test_pending_drafts_extend_the_tail():
    cfg = ReplayConfig(keep=18, **TINY)
    assert plan_replay(cfg, 200, 64).decoder_replay_tokens == 18
    assert plan_replay(cfg, 200, 64, pending_drafts=6).decoder_replay_tokens == 22  # w + d
    ex = ReplayConfig(keep=18, mode=EXACT, **TINY)
    assert plan_replay(ex, 200, 64, pending_drafts=6).decoder_replay_tokens == 4 * 15 + 1 + 6


def test_hit_ending_inside_a_compression_group():
    cfg = ReplayConfig(keep=22, **{**TINY, "block_size": 1})
    assert cfg.align == 2
    p = plan_replay(cfg, 100, 41)
    assert p.hit == 40  # the ratio-2 group [40, 42) is recomputed, not rebuilt from a partial state
    c4 = ReplayConfig(
        keep=10, window=8, num_layers=4, encoder_layers=2, compress_ratios=[4, 4, 1, 1], block_size=6
    )
    assert c4.align == 12 and plan_replay(c4, 200, 100).hit == 96


def test_exact_mode_spans():
    cfg = ReplayConfig(keep=22, mode=EXACT, **TINY)
    p = plan_replay(cfg, 300, 160)
    rep, pre, tail = p.steps
    assert rep.end - rep.start == 4 * 15 and tail.num_tokens == 4 * 15 + 1 and p.exact
    assert pre.start == 160 and pre.end == 300 - 61


def test_masks_truncate_only_the_decoder_in_the_tail():
    cfg = ReplayConfig(keep=22, **TINY)
    tail = plan_replay(cfg, 100, 64).steps[-1]
    k, m = tail.swa_mask(2, 16)
    assert k[0] == 78 - 15 and m[0].sum() == 16  # encoder: full window into the rings
    k, m = tail.swa_mask(5, 16)
    assert (m[:, k < 78] == 0).all() and m[0].sum() == 1 and m[-1].sum() == 16
    with pytest.raises(ValueError, match="layer"):
        plan_replay(cfg, 100, 64).steps[0].swa_mask(6, 16)


def test_bad_input_names_the_field():
    cfg = ReplayConfig(keep=22, **TINY)
    for kw, field in (
        ({"hit": 101}, "hit"),
        ({"hit": -1}, "hit"),
        ({"pending_drafts": -1}, "pending_drafts"),
    ):
        args = {"num_tokens": 100, "hit": 8, **kw}
        with pytest.raises(ValueError, match=field):
            plan_replay(cfg, **args)
    with pytest.raises(ValueError, match="num_tokens"):
        plan_replay(cfg, 0, 0)
    with pytest.raises(ValueError, match="mode"):
        ReplayConfig(keep=22, mode="fast", **{k: v for k, v in TINY.items()})
    with pytest.raises(ValueError, match="encoder_layers"):
        ReplayConfig(keep=2, window=4, num_layers=2, encoder_layers=3)


@st.composite
def shapes(draw):
    nl = draw(st.integers(2, 12))
    e = draw(st.integers(1, nl))
    ratios = draw(st.lists(st.sampled_from([0, 1, 2, 4]), min_size=nl, max_size=nl))
    cfg = ReplayConfig(
        window=draw(st.integers(1, 40)),
        num_layers=nl,
        encoder_layers=e,
        keep=draw(st.integers(1, 200)),
        compress_ratios=ratios,
        block_size=draw(st.integers(1, 32)),
        mode=draw(st.sampled_from(["bounded", "exact"])),
        encoder_replay=draw(st.none() | st.integers(1, 100)),
    )
    n = draw(st.integers(1, 3000))
    return cfg, n, draw(st.integers(0, n)), draw(st.integers(0, 6)), draw(st.booleans())


@given(shapes())
def test_plan_invariants(case):
    cfg, n, h0, d, host = case
    p = plan_replay(cfg, n, h0, d, host)
    assert 0 <= p.hit <= min(h0, n - 1) and p.hit % cfg.align == 0
    compute = [s for s in p.steps if s.kind in (PREFILL, ENCODER_PREFILL, TAIL)]
    # the computed steps cover [hit, n) in order, once; the last one yields the logits
    assert compute[0].start == p.hit and compute[-1].end == n and compute[-1].logits
    assert all(a.end == b.start for a, b in itertools.pairwise(compute))
    for s in p.steps:
        assert s.writes_blocks == (s.kind in (PREFILL, ENCODER_PREFILL, TAIL))
        if s.kind == ENCODER_REPLAY:
            assert (
                0 <= s.start < s.end == p.hit and s.floor == s.start and s.layers == (0, cfg.encoder_layers)
            )
    if p.hit:
        tail = p.steps[-1]
        assert tail.kind == TAIL and tail.floor == tail.start
        assert tail.floor_layers == (cfg.encoder_layers, cfg.num_layers)
        if cfg.decoder_layers:
            want = cfg.exact_tail(d) if cfg.mode == EXACT else max(cfg.keep, cfg.window + d)
            assert tail.num_tokens == want  # the hit never eats into the tail
        # exact mode is exact; bounded mode claims exactness only when its spans reach the exact ones
        if cfg.mode == EXACT:
            assert p.exact
        enc_ok = (
            p.encoder_restored
            or p.steps[0].kind != ENCODER_REPLAY
            or p.steps[0].start == 0
            or p.encoder_replay_tokens >= cfg.exact_encoder_replay()
        )
        dec_ok = not cfg.decoder_layers or tail.start == 0 or tail.num_tokens >= cfg.exact_tail(d)
        assert p.exact == (enc_ok and dec_ok)
        # work: never more than a full prefill plus the bounded replays
        work = sum(p.token_layer_counts().values())
        assert work <= n * (cfg.num_layers + 1) + p.encoder_replay_tokens * cfg.encoder_layers
    else:
        assert [s.kind for s in p.steps] == [PREFILL] and p.exact
    k, m = p.steps[-1].swa_mask(cfg.num_layers - 1, cfg.window)
    assert m.shape == (p.steps[-1].num_tokens, k.shape[0]) and m.any(axis=1).all()  # each query sees itself
    assert np.all(m.sum(axis=1) <= cfg.window)
