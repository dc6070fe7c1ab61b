"""ModelConfig: released shape, sharing groups, validation naming the field, config.json round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_core.model.config import ConfigError, ModelConfig, flash_config, tiny_config


def test_flash_sharing_groups_match_v41_flash() -> None:
    c = flash_config()
    kinds = [c.layer_kind(i) for i in range(40)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert c.encoder_layers == 20
    # every decoder layer attends to layer 20's KV (the CED global source); encoder groups 2-7, 8-13, 14-19
    assert {c.kv_source_of(i) for i in range(20, 40)} == {20}
    assert [c.kv_source_of(i) for i in (2, 7, 8, 13, 14, 19)] == [2, 2, 8, 8, 14, 14]
    assert [c.index_source_of(i) for i in (23, 24, 27, 39)] == [20, 24, 24, 36]
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]
    assert c.compress_ratios[40:] == (0, 0, 0)


def test_tiny_has_every_feature() -> None:
    c = tiny_config()
    assert [c.layer_kind(i) for i in range(8)] == [
        "swa",
        "swa",
        "full",
        "reuse",
        "full",
        "reuse",
        "reindex",
        "reuse",
    ]
    assert c.encoder_layers == 4 and c.uses_candidates(6)


def test_from_pretrained_round_trip(tmp_path: Path) -> None:
    c = flash_config()
    c.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(architectures=["DeepseekV41ForCausalLM"], torch_dtype="bfloat16", model_type="deepseek_v41")
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_pretrained(tmp_path) == c


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"compress_ratios": [0, 0, 2, 1, 1, 1, 1, 1]}, "compress_ratios"),  # layer 3 ratio != source 2's
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),
        ({"kv_source_layer_ids": [2, 4, 6]}, "kv_source_layer_ids"),  # two decoder sources
        ({"kv_source_layer_ids": [1, 4]}, "kv_source_layer_ids"),  # SWA-only layer as a source
        ({"index_source_layer_ids": [4, 6]}, "index_source_layer_ids"),  # KV source 2 missing
        ({"num_encoder_layers": 3}, "num_encoder_layers"),
        ({"o_groups": 3}, "o_groups"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"candidate_source_layer_id": 5}, "candidate_source_layer_id"),
        ({"engram_layer_ids": [9]}, "engram_layer_ids"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling"),
    ],
)
def test_inconsistent_fields_are_named(over: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}="):
        tiny_config(**over)


def test_unknown_and_missing_fields_are_named(tmp_path: Path) -> None:
    d = tiny_config().to_dict()
    with pytest.raises(ConfigError, match=r"^compress_ratio=.*unknown config field"):
        ModelConfig.from_dict({**d, "compress_ratio": [1]})
    del d["index_topk"]
    with pytest.raises(ConfigError, match=r"^index_topk: required"):
        ModelConfig.from_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_kv_model_config_matches_the_pools_defaults() -> None:
    from deepinfer_core.kv.planner import KVModelConfig

    kv = flash_config().kv_model_config()
    ref = KVModelConfig()  # the kv component's released-shape defaults
    for f in (
        "num_layers",
        "compress_ratios",
        "kv_source_layer_ids",
        "index_source_layer_ids",
        "head_dim",
        "index_head_dim",
        "window",
        "backtracking",
        "num_persisted_layers",
        "num_draft_layers",
    ):
        assert getattr(kv, f) == getattr(ref, f), f
