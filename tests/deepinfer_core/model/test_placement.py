"""Expert placement (EPLB phy2log / log2phy / logcnt) in the MoE: outputs do not depend on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.eplb import rebalance_experts
from deepinfer_core.model.model import DeepSeekV41

from .session import Session

TOL = 1e-9


def _placement(seed: int, layers: int = 8, experts: int = 8, slots: int = 12, gpus: int = 4):
    load = np.random.default_rng(seed).pareto(1.0, (layers, experts)) + 0.1
    return rebalance_experts(load, slots, 1, 1, gpus)


def test_two_placements_with_replicas_give_the_oracle_output(model64: DeepSeekV41) -> None:
    a, b = _placement(1), _placement(2)
    assert a[2].max() > 1 and b[2].max() > 1 and not np.array_equal(a[0], b[0])  # replicas, different plans
    seq = torch.randint(0, 512, (110,), generator=torch.Generator().manual_seed(13))
    want = model64.forward_full(seq)[0]
    try:
        outs = []
        for p in (a, b):
            model64.set_expert_placement(*p)
            outs.append(Session(model64).run(0, seq, [64, 40, 1, 5]))
        # switching at run time, between steps of one sequence
        s = Session(model64)
        model64.set_expert_placement(*a)
        first = s.run(0, seq, [70])
        model64.set_expert_placement(*b)
        rest = s.run(0, seq[70:], [30, 1, 1, 8], start=70)
        outs.append(torch.cat((first, rest)))
    finally:
        model64.set_expert_placement(None)
    for o in outs:
        assert (o - want).abs().max().item() < TOL


def test_tokens_spread_evenly_over_replicas(model64: DeepSeekV41) -> None:
    phy2log, log2phy, logcnt = _placement(3)
    moe = model64.layers[2].ffn
    try:
        model64.set_expert_placement(phy2log, log2phy, logcnt)
        ids = torch.randint(0, 8, (500, 2), generator=torch.Generator().manual_seed(4))
        slots = moe.slots(ids)
        assert torch.equal(torch.as_tensor(phy2log[2])[slots], ids)  # every pair lands on its expert
        per_slot = torch.bincount(slots.reshape(-1), minlength=12)
        for e in range(8):
            reps = per_slot[torch.as_tensor(np.flatnonzero(phy2log[2] == e))]
            assert int(reps.max() - reps.min()) <= 1  # round robin
        assert torch.equal(moe.slots(ids), slots)  # deterministic
    finally:
        model64.set_expert_placement(None)


def test_bad_placements_are_named(model64: DeepSeekV41) -> None:
    phy2log, log2phy, logcnt = _placement(5)
    bad = phy2log.copy()
    bad[0, :] = 0
    with pytest.raises(ValueError, match="phy2log: layer 0 has no slot for expert 1"):
        model64.set_expert_placement(bad)
    with pytest.raises(ValueError, match="phy2log: shape"):
        model64.set_expert_placement(phy2log[:3])
    wrong = log2phy.copy()
    e = int(np.argmax(logcnt[0]))
    wrong[0, e, 0] = (wrong[0, e, 0] + 1) % 12
    with pytest.raises(ValueError, match="log2phy: layer 0"):
        model64.set_expert_placement(phy2log, wrong, logcnt)
    with pytest.raises(ValueError, match="logcnt"):
        model64.set_expert_placement(phy2log, None, logcnt + 1)
    assert all(b.ffn.placement is None for b in model64.layers)  # nothing half-applied
