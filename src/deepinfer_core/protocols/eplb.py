"""Seams of the expert placement component (``deepinfer_core.eplb``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ExpertPlacementPolicy(Protocol):
    """A placement policy with DeepSeek EPLB's signature and output conventions."""

    def __call__(
        self, weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Place ``num_replicas`` physical experts per layer given loads ``weight`` [layers, logical].

        Returns ``(phy2log [layers, num_replicas], log2phy [layers, logical, max_replicas] padded with -1,
        logcnt [layers, logical])``; physical slot ``p`` lives on GPU ``p // (num_replicas // num_gpus)``.
        """
        ...
