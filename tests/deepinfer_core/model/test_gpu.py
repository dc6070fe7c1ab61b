"""The reference model on a CUDA device agrees with itself on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.model import DeepSeekV41

from .session import Session


@pytest.mark.gpu
def test_cuda_executor_matches_cpu_oracle() -> None:
    seq = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(3))
    cpu = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float64)
    gpu = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float64, device="cuda")
    ref = cpu.forward_full(seq)[0]
    assert (gpu.forward_full(seq.cuda())[0].cpu() - ref).abs().max().item() < 1e-9
    for chunks in ([90] + [1] * 30, [7] * 17 + [1]):
        got = Session(gpu).run(0, seq, chunks).cpu()
        assert (got - ref).abs().max().item() < 1e-9
    q = Session(gpu, quantize=True).run(0, seq, [120]).cpu()
    assert ((q - ref).norm() / ref.norm()).item() < 0.5
