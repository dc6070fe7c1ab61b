"""Safetensors checkpoints: exact round trip, FP8 / MXFP4 codecs against float64 references, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.model.config import ModelConfig, tiny_config
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.weights import (
    INDEX_FILE,
    WeightsError,
    fp8_dequantize,
    fp8_quantize,
    load_weights,
    mxfp4_dequantize,
    mxfp4_quantize,
    quantize_weights_,
    save_weights,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _small() -> ModelConfig:
    return tiny_config(
        num_hidden_layers=5,
        compress_ratios=[0, 0, 2, 1, 1],
        kv_source_layer_ids=[2, 3],
        index_source_layer_ids=[2, 3, 4],
        num_encoder_layers=3,
        candidate_source_layer_id=3,
        engram_layer_ids=[1],
        dspark_target_layer_ids=[4],
        num_nextn_predict_layers=0,
    )


def test_fp8_block_scaled_codec() -> None:
    w = torch.randn(70, 100, dtype=torch.float64) * torch.logspace(-3, 2, 100, dtype=torch.float64)
    v, s = fp8_quantize(w)
    assert v.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 4)
    back = fp8_dequantize(v, s)
    # oracle: per 32x32 block, scale is the smallest power of two with max/scale <= 448, and each
    # value is within half an e4m3 step (relative 2^-4) or half a subnormal step of the original
    for bi in range(3):
        for bj in range(4):
            blk = w[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32]
            sc = 2.0 ** (s.view(torch.uint8)[bi, bj].item() - 127)
            assert blk.abs().max() / sc <= 448 and blk.abs().max() / sc > 224
            err = (back[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32] - blk).abs()
            assert (err <= blk.abs() * 2.0**-4 + sc * 2.0**-10).all()


def test_mxfp4_codec() -> None:
    w = torch.randn(6, 64, dtype=torch.float64) * 3
    p, s = mxfp4_quantize(w)
    assert p.shape == (6, 32) and s.shape == (6, 2)
    back = mxfp4_dequantize(p, s)
    for r in range(6):
        for g in range(2):
            blk = w[r, g * 32 : (g + 1) * 32]
            sc = 2.0 ** (int(s[r, g]) - 127)
            assert blk.abs().max() / sc <= 6 and blk.abs().max() / sc > 3
            # brute force nearest grid point (ties may go either way: compare distances)
            grid = torch.cat((-E2M1.flip(0), E2M1)) * sc
            best = (blk[:, None] - grid[None]).abs().min(1).values
            assert torch.allclose((back[r, g * 32 : (g + 1) * 32] - blk).abs(), best, rtol=0, atol=1e-12)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    cfg = _small()
    src = quantize_weights_(DeepSeekV41.from_config(cfg, seed=3))
    out = save_weights(src, tmp_path / "ckpt", max_shard_bytes=300_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1  # the index really spans several shards
    with safe_open(str(out / index["weight_map"]["layers.2.ffn.experts.3.w1.weight"]), framework="pt") as f:
        assert f.get_tensor("layers.2.ffn.experts.3.w1.weight").dtype == torch.uint8
    with safe_open(str(out / index["weight_map"]["layers.2.attn.wq_b.weight"]), framework="pt") as f:
        assert f.get_tensor("layers.2.attn.wq_b.weight").dtype == torch.float8_e4m3fn
    assert ModelConfig.from_pretrained(out) == cfg
    dst = load_weights(DeepSeekV41.from_config(ModelConfig.from_pretrained(out), seed=99), out)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), name
    toks = torch.randint(0, cfg.vocab_size, (40,))
    assert torch.equal(src.forward_full(toks)[0], dst.forward_full(toks)[0])


def test_unquantised_weights_do_change_on_fp8_round(tmp_path: Path) -> None:
    m = DeepSeekV41.from_config(_small(), seed=3)
    before = m.layers[2].attn.wq_b.detach().clone()
    quantize_weights_(m)
    assert not torch.equal(before, m.layers[2].attn.wq_b)  # the round trip test is not vacuous


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    m = DeepSeekV41.from_config(_small(), seed=3)
    out = save_weights(m, tmp_path / "c")
    idx = json.loads((out / INDEX_FILE).read_text())
    del idx["weight_map"]["layers.1.attn.attn_sink"]
    (out / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(WeightsError, match=r"layers\.1\.attn\.attn_sink: missing"):
        load_weights(DeepSeekV41.from_config(_small()), out)
    bigger = tiny_config()
    with pytest.raises(WeightsError, match=r"unexpected tensor|does not match"):
        load_weights(
            DeepSeekV41.from_config(_small()), save_weights(DeepSeekV41.from_config(bigger), tmp_path / "d")
        )
    with pytest.raises(WeightsError, match="neither"):
        load_weights(m, tmp_path)
