"""Weight migration over torch.distributed: gloo ranks on CPU (NCCL on GPUs) carry out a re-plan's moves.

The ranks run ``deepinfer_core.eplb.selfcheck`` (spawned ranks cannot import a test module under pytest's
importlib mode): each rank's received weights are compared with the oracle weights of the new placement,
sent == received == cross-GPU moves, and a corrupted transfer must fail verification.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.eplb import selfcheck

pytestmark = pytest.mark.distributed


def test_moves_transfer_weights_exactly_4_ranks_and_2_rank_subgroups() -> None:
    selfcheck.run(4)


@pytest.mark.slow
def test_moves_transfer_weights_exactly_2_ranks() -> None:
    selfcheck.run(2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_moves_transfer_weights_exactly_nccl_2_gpus() -> None:
    selfcheck.run(2, backend="nccl")
