"""``model.fused_kernels.kernel_defaults``: which one-kernel decode paths an executor turns on by default."""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer_core.model import DeepSeekV41, ModelExecutor
from deepinfer_core.model.config import flash_config, tiny_config
from deepinfer_core.model.fused_kernels import kernel_defaults
from deepinfer_kernels import get_backend

SWITCHES = ("fused_attention", "fused_moe", "fused_head")


def test_off_without_the_cuda_backend_or_a_sync_free_step() -> None:
    model = DeepSeekV41.from_config(tiny_config(), seed=0)
    assert kernel_defaults(model, get_backend("reference"), True) == dict.fromkeys(SWITCHES, False)
    assert kernel_defaults(model, None, True) == dict.fromkeys(SWITCHES, False)
    named_cuda = types.SimpleNamespace(name="cuda")
    assert kernel_defaults(model, named_cuda, False) == dict.fromkeys(SWITCHES, False)
    # the cuda backend's name with the model on the CPU: the kernels take no CPU tensors
    assert kernel_defaults(model.to(torch.bfloat16), named_cuda, True) == dict.fromkeys(SWITCHES, False)
    ex = ModelExecutor(model, 8, 16, 2, backend=get_backend("reference"))
    assert not any(getattr(ex, s) for s in SWITCHES)


def _flash_model() -> DeepSeekV41:
    cfg = flash_config(
        num_hidden_layers=2,
        compress_ratios=[0, 1],
        kv_source_layer_ids=[1],
        index_source_layer_ids=[1],
        num_encoder_layers=1,
        candidate_source_layer_id=1,
        n_routed_experts=8,
        engram_layer_ids=[],
        engram_table_sizes=[],
        dspark_target_layer_ids=[],
        num_nextn_predict_layers=0,
    )
    return DeepSeekV41.from_config(cfg, seed=0, dtype=torch.bfloat16, device="cuda", init_on_device=True)


@pytest.mark.gpu
def test_on_for_the_released_widths() -> None:
    cuda = get_backend("cuda")
    assert kernel_defaults(_flash_model(), cuda, True) == dict.fromkeys(SWITCHES, True)
    # the tiny model's attention has fewer than the kernel's 64 heads (its expert and head widths may fit)
    tiny = DeepSeekV41.from_config(tiny_config(), seed=0, dtype=torch.bfloat16, device="cuda")
    assert tiny.cfg.num_attention_heads != 64 and not kernel_defaults(tiny, cuda, True)["fused_attention"]
    # float32 weights: no kernel takes them
    tiny32 = DeepSeekV41.from_config(tiny_config(), seed=0, device="cuda")
    assert not any(kernel_defaults(tiny32, cuda, True).values())
