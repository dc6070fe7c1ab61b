"""The reference model on a CUDA device agrees with itself on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.model import DeepSeekV41

from .session import Session
from .spec_driver import greedy_plain, greedy_spec


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


@pytest.mark.gpu
def test_cuda_backend_cache_writes_match_plain_writes() -> None:
    from deepinfer_kernels import get_backend

    seq = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(4))
    gpu = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float32, device="cuda")
    plain = Session(gpu, quantize=True)
    via = Session(gpu, quantize=True)
    via.ex = type(via.ex)(
        gpu,
        via.ex.num_blocks,
        via.ex.block_size,
        via.ex.num_slots,
        quantize=True,
        backend=get_backend("cuda"),
    )
    # the plain row path with the backend's writes (the sync-free path's MoE sums in another order, so its
    # bytes are compared with a tolerance in test_cuda_graphs)
    via.ex.sync_free = via.ex.cuda_graphs = False
    chunks = [60, 17, 1, 1, 1, 20]
    a, b = plain.run(0, seq, chunks), via.run(0, seq, chunks)
    for lid in gpu.cfg.kv_source_layer_ids:
        assert torch.equal(plain.ex.kv[lid], via.ex.kv[lid]), lid
        assert torch.equal(plain.ex.index_keys[lid], via.ex.index_keys[lid]), lid
    assert all(torch.equal(x, y) for x, y in zip(plain.ex.swa, via.ex.swa))
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_dspark_and_placement_keep_greedy_output() -> None:
    """On CUDA (float64), DSpark drafting + in-step verification under an EPLB placement emits exactly
    the CPU model's plain greedy tokens."""
    from deepinfer_core.eplb import rebalance_experts

    g = torch.Generator().manual_seed(5)
    prompts = {0: torch.randint(0, 512, (70,), generator=g), 1: torch.randint(0, 512, (45,), generator=g)}
    cpu = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float64)
    gpu = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float64, device="cuda")
    load = torch.rand(8, 8, generator=g).numpy() + 0.1
    gpu.set_expert_placement(*rebalance_experts(load, 12, 1, 1, 4))
    plain = greedy_plain(Session(cpu), prompts, 16)
    spec, _ = greedy_spec(Session(gpu), prompts, 16)
    assert spec == plain
