"""The concrete EPLB policy satisfies its seam in deepinfer_core.protocols."""

from __future__ import annotations

import numpy as np

from deepinfer_core.eplb import rebalance_experts
from deepinfer_core.protocols import ExpertPlacementPolicy


def test_rebalance_experts_is_an_expert_placement_policy() -> None:
    assert isinstance(rebalance_experts, ExpertPlacementPolicy)
    policy: ExpertPlacementPolicy = rebalance_experts
    phy2log, log2phy, logcnt = policy(np.ones((1, 8)), 8, 1, 1, 2)
    assert phy2log.shape == (1, 8) and log2phy.shape == (1, 8, 1) and logcnt.shape == (1, 8)
