"""Cache byte accounting: the released formats' bytes per token and the executor's allocation."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer_core.model.cache import CacheFormats, NativeFormat
from deepinfer_core.model.config import flash_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.weights import INDEX_FILE, checkpoint_bytes, save_weights


def test_flash_formats_have_the_published_sizes() -> None:
    f = flash_config()
    fmt = CacheFormats.make(f.head_dim, f.index_head_dim, quantize=True, dtype=torch.bfloat16)
    assert (fmt.main.bytes_per_token, fmt.swa.bytes_per_token, fmt.index.bytes_per_token) == (288, 528, 68)
    ring = f.sliding_window + 6  # window + backtracking (5 drafts + 1)
    assert f.encoder_layers * ring * fmt.swa.bytes_per_token == 1_415_040


def test_native_format_is_exact_for_float64() -> None:
    x = torch.randn(5, 24, dtype=torch.float64)
    f = NativeFormat(24, torch.float64)
    assert f.bytes_per_token == 192 and torch.equal(f.dequantize(f.quantize(x)), x)


def test_executor_allocation_matches_layout(model64: DeepSeekV41) -> None:
    cfg = model64.cfg
    blocks, bs, slots, bt = 10, 16, 3, 6
    ex = ModelExecutor(model64, blocks, bs, slots, backtrack_tokens=bt, quantize=True)
    got = ex.cache_bytes()
    n_src = len(cfg.kv_source_layer_ids)
    assert got["main_kv"] == n_src * blocks * bs * (cfg.head_dim // 2 + cfg.head_dim // 16)
    assert got["index_keys"] == n_src * blocks * bs * (cfg.index_head_dim // 2 + cfg.index_head_dim // 32)
    assert got["swa_ring"] == cfg.num_hidden_layers * slots * (cfg.sliding_window + bt) * (
        cfg.head_dim + cfg.head_dim // 32
    )
    # a ratio-2 source keeps value + score per token for ratio + backtrack tokens (float64 here);
    # a ratio-1 source completes an entry every token and keeps nothing
    want = sum(
        slots * (2 + bt) * 2 * (cfg.head_dim + cfg.index_head_dim) * 8
        for s in cfg.kv_source_layer_ids
        if cfg.ratio(s) == 2
    )
    assert got["compressor_state"] == want


def test_checkpoint_bytes_matches_written_index(tmp_path: Path, model64: DeepSeekV41) -> None:
    out = save_weights(model64, tmp_path / "c", dtype=torch.float32)
    total = json.loads((out / INDEX_FILE).read_text())["metadata"]["total_size"]
    assert checkpoint_bytes(model64, plain_bytes=4) == total
