"""Replay plans run on the executor after a real prefix hit (pool + prefix index, shared blocks).

Exact mode against the cache-free full forward; bounded mode against the masked reference
(``reference.masked_forward``), both in float64 with raw (unquantised) KV: equal to 1e-9. Sequence A
is computed first and its full blocks cached; B shares A's first 96 tokens, then differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.kv import PagedKVPool, PrefixIndex
from deepinfer_core.model.batch import BatchError, ForwardBatch
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.swa import ENCODER_REPLAY, ENCODER_RESTORE, EXACT, ReplayConfig, plan_replay
from deepinfer_core.swa.run import run_plan

from .reference import masked_forward

TOL = 1e-9
BS = 8
SHARED = 96


def _toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n)


class Rig:
    """Executor + pool + prefix index; A is prefilled (chunks of 40) with encoder snapshots."""

    def __init__(self, model: DeepSeekV41, seed: int, n_a: int = 130, n_b: int = 150) -> None:
        self.model = model
        self.ex = ModelExecutor(model, 96, BS, 4, quantize=False)
        self.pool = PagedKVPool(96, BS)
        self.index = PrefixIndex(self.pool)
        a = _toks(seed, n_a)
        b = np.concatenate((a[:SHARED], _toks(seed + 1, n_b - SHARED)))
        self.a, self.b = a, b
        assert self.pool.allocate(1, n_a)
        self.snaps: dict[int, torch.Tensor] = {}
        table = self.pool.block_table(1)
        for c0 in range(0, n_a, 40):
            c1 = min(n_a, c0 + 40)
            xs = [x for x in range(BS, n_a + 1, BS) if c0 < x <= c1]
            sp = xs[-1] if xs else 0  # one snapshot per request and step: the chunk's last boundary
            out = self.ex.execute(
                ForwardBatch(
                    token_ids=a[c0:c1],
                    query_lens=[c1 - c0],
                    start_pos=[c0],
                    block_tables=table[None],
                    state_slots=[0],
                    num_logits=[1],
                    snapshot_pos=[sp],
                )
            )
            if sp:
                self.snaps[sp] = out.snapshots[0]
        self.index.insert_seq(1, a)

    def rings(self, x: int) -> torch.Tensor:
        return self.snaps[x] if x in self.snaps else self.snaps_at(x)

    def snaps_at(self, x: int) -> torch.Tensor:
        """A's encoder rings at ``x`` from a fresh run whose chunk [x - 8, x + 32) snapshots inside."""
        ex = ModelExecutor(self.model, 96, BS, 4, quantize=False)
        t = self.pool.block_table(1)[None]
        ex.execute(
            ForwardBatch(
                token_ids=self.a[: x - 8],
                query_lens=[x - 8],
                start_pos=[0],
                block_tables=t,
                state_slots=[0],
                num_logits=[0],
            )
        )
        out = ex.execute(
            ForwardBatch(
                token_ids=self.a[x - 8 : x + 32],
                query_lens=[40],
                start_pos=[x - 8],
                block_tables=t,
                state_slots=[0],
                num_logits=[1],
                snapshot_pos=[x],
            )
        )
        return out.snapshots[0]

    def hit_b(self, cfg: ReplayConfig, extra: int = 8, host: bool = True):
        n, blocks = self.index.match(self.b)
        assert n == SHARED
        plan = plan_replay(cfg, len(self.b), n, host_state=host)
        assert self.pool.allocate(2, len(self.b) + extra, prefix_blocks=blocks[: plan.hit // BS])
        return plan, self.pool.block_table(2)


def _rings(ex: ModelExecutor, lid: int, slot: int, positions: range) -> torch.Tensor:
    p = torch.as_tensor(list(positions))
    return ex.swa[lid][slot, p % ex.swa_ring].view(torch.float64)


def _cfg(model: DeepSeekV41, mode: str, keep: int = 22) -> ReplayConfig:
    return ReplayConfig.from_model(model.cfg, keep=keep, block_size=BS, mode=mode)


def test_snapshot_inside_a_chunk_equals_the_rings_of_a_run_ending_there(model64: DeepSeekV41) -> None:
    rig = Rig(model64, 11)
    x = 80  # A's chunk [80, 120) snapshots at 120; [40, 80) at 80: compare 80 with a run that ends at 80
    ex = ModelExecutor(model64, 96, BS, 4, quantize=False)
    pool = PagedKVPool(96, BS)
    assert pool.allocate(1, x)
    ex.execute(
        ForwardBatch(
            token_ids=rig.a[:x],
            query_lens=[x],
            start_pos=[0],
            block_tables=pool.block_table(1)[None],
            state_slots=[0],
            num_logits=[1],
        )
    )
    want = ex.encoder_rings(0)
    w, ring = model64.cfg.sliding_window, ex.swa_ring
    keep = torch.as_tensor([p % ring for p in range(x - ring, x)])
    f64 = torch.float64  # different chunkings round differently: compare values, not bytes
    assert (rig.snaps[x][:, keep].view(f64) - want[:, keep].view(f64)).abs().max().item() < TOL
    # a snapshot inside a chunk (A's [80, 120) at 88) against the rings of a run ending at 88
    ex.execute(
        ForwardBatch(
            token_ids=rig.a[x:88],
            query_lens=[8],
            start_pos=[x],
            block_tables=pool.block_table(1)[None],
            state_slots=[0],
            num_logits=[1],
        )
    ) if pool.append_slots(1, 8) else None
    keep = torch.as_tensor([p % ring for p in range(88 - ring, 88)])
    got88 = rig.snaps_at(88)
    assert (got88[:, keep].view(f64) - ex.encoder_rings(0)[:, keep].view(f64)).abs().max().item() < TOL
    assert w < ring


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("chunk", [None, 7])
def test_exact_mode_reproduces_the_no_cache_logits(
    model64: DeepSeekV41, host: bool, chunk: int | None
) -> None:
    rig = Rig(model64, 21)
    plan, table = rig.hit_b(_cfg(model64, EXACT), host=host)
    assert plan.exact and plan.hit == 88  # <= 150 - 61, whole blocks
    assert plan.steps[0].kind == (ENCODER_RESTORE if host else ENCODER_REPLAY)
    shared = plan.hit // BS
    before = {s: t[table[:shared]].clone() for s, t in rig.ex.kv.items()}
    ref = model64.forward_full(torch.as_tensor(rig.b))[0]
    got = run_plan(rig.ex, plan, rig.b, 1, table, host_rings=rig.rings(plan.hit), chunk=chunk)
    assert (got - ref[-1]).abs().max().item() < TOL
    for s, t in rig.ex.kv.items():  # the shared blocks were only read
        assert torch.equal(t[table[:shared]], before[s])
    # decoding on from the rebuilt state stays exact (rings, compressor groups, engram context)
    seq = list(rig.b)
    for _ in range(5):
        seq.append(int(ref[-1].argmax()))
        ref = model64.forward_full(torch.as_tensor(seq))[0]
        out = rig.ex.execute(
            ForwardBatch(
                token_ids=seq[-1:],
                query_lens=[1],
                start_pos=[len(seq) - 1],
                block_tables=table[None],
                state_slots=[1],
                num_logits=[1],
            )
        )
        assert (out.logits[-1] - ref[-1]).abs().max().item() < TOL


@pytest.mark.parametrize("host", [True, False])
def test_bounded_state_equals_the_masked_reference(model64: DeepSeekV41, host: bool) -> None:
    rig = Rig(model64, 31)
    plan, table = rig.hit_b(_cfg(model64, "bounded"), host=host)
    assert plan.hit == SHARED and not plan.exact
    t0 = plan.tail_start
    enc_floor = 0 if host else plan.steps[0].start
    logits, keys, _ = masked_forward(
        model64,
        torch.as_tensor(rig.b),
        enc_floor=enc_floor,
        dec_floor=t0,
        cached_below=0 if host else plan.hit,
    )
    got = run_plan(rig.ex, plan, rig.b, 1, table, host_rings=rig.rings(plan.hit))
    assert (got - logits[-1]).abs().max().item() < TOL
    n, w = len(rig.b), model64.cfg.sliding_window
    for lid in range(model64.cfg.num_hidden_layers):
        win = range(n - w + 1, n)
        assert (_rings(rig.ex, lid, 1, win) - keys[lid][n - w + 1 :]).abs().max().item() < TOL, lid
    # and the approximation is real: the exact logits differ
    exact = model64.forward_full(torch.as_tensor(rig.b))[0][-1]
    assert (got - exact).abs().max().item() > 1e-6


def test_replay_and_restore_refuse_bad_input(model64: DeepSeekV41) -> None:
    rig = Rig(model64, 41)
    _plan, table = rig.hit_b(_cfg(model64, "bounded"))
    with pytest.raises(BatchError, match="rings"):
        rig.ex.restore_encoder(1, SHARED, torch.zeros(2, 2, 2, dtype=torch.uint8), rig.b[:SHARED])
    with pytest.raises(BatchError, match="token_ids"):
        rig.ex.replay_encoder(1, np.array([600]), 10, table, rig.b[:10])
    with pytest.raises(BatchError, match="block_tables"):
        rig.ex.replay_encoder(1, rig.b[80:96], 80, np.zeros_like(table), rig.b[:80])
    rig.ex.restore_encoder(1, SHARED, rig.rings(SHARED), rig.b[:SHARED])
    row = dict(query_lens=[4], block_tables=table[None], state_slots=[1], num_logits=[0])
    with pytest.raises(
        BatchError, match="decoder_floor"
    ):  # a full step on encoder-only rings needs the floor
        rig.ex.execute(ForwardBatch(token_ids=rig.b[SHARED : SHARED + 4], start_pos=[SHARED], **row))
    with pytest.raises(BatchError, match="no rollback"):
        rig.ex.execute(
            ForwardBatch(
                token_ids=rig.b[SHARED - 2 : SHARED + 2], start_pos=[SHARED - 2], encoder_only=True, **row
            )
        )
    with pytest.raises(BatchError, match="snapshot_pos"):
        rig.ex.execute(
            ForwardBatch(
                token_ids=rig.b[SHARED : SHARED + 4],
                start_pos=[SHARED],
                encoder_only=True,
                snapshot_pos=[SHARED],
                **row,
            )
        )


def test_persisted_half_bytes(model64: DeepSeekV41) -> None:
    # the host copy is the encoder rings: layers x (window + backtrack) x the FP8 ring format's bytes
    from deepinfer_core.kv.formats import get_format
    from deepinfer_core.model.config import flash_config

    q = ModelExecutor(model64, 8, BS, 2, quantize=True)
    cfg = model64.cfg
    fp8 = get_format("fp8", cfg.head_dim).bytes_per_token
    assert q.encoder_rings(0).numel() == cfg.encoder_layers * (cfg.sliding_window + 6) * fp8
    big = flash_config()
    assert (
        big.encoder_layers * (big.sliding_window + 6) * get_format("fp8", big.head_dim).bytes_per_token
        == 1_415_040
    )
