"""Loader errors name the file and the field (issue #35): a broken checkpoint directory says which file is
wrong and what in it, and another architecture's config.json is refused as such, not as a list of
missing fields. Each case breaks one file of a copy of the shipped checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer_core.model.checkpoint import TINY_DIR, load_model
from deepinfer_core.model.config import MODEL_TYPES, ConfigError, ModelConfig
from deepinfer_core.model.weights import INDEX_FILE, WeightsError


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(TINY_DIR, d)
    return d


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize(
    ("model_type", "arch"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")],
)
def test_other_architectures_are_refused_as_such(ckpt: Path, model_type: str, arch: str) -> None:
    cfg = _config(ckpt)
    cfg.update(model_type=model_type, architectures=[arch], intermediate_size=11008)  # a field V4.1 lacks
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model(str(ckpt))
    msg = str(e.value)
    assert msg.startswith(
        f"{ckpt / 'config.json'}: model_type: unsupported architecture (model_type {model_type!r}"
    )
    assert "this library runs DeepSeek-V4.1" in msg and arch in msg and "\n" not in msg


def test_own_model_types_load(ckpt: Path) -> None:
    cfg = _config(ckpt)
    for mt in (*MODEL_TYPES, None):
        d = {**cfg, "model_type": mt} if mt else cfg
        assert ModelConfig.from_dict(d).vocab_size == cfg["vocab_size"]


def test_config_errors_name_the_file_and_the_field(ckpt: Path) -> None:
    f = ckpt / "config.json"
    cfg = _config(ckpt)
    f.write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match=rf"^{f}: hidden_size: required config field is missing"):
        load_model(str(ckpt))
    f.write_text(json.dumps({**cfg, "o_groups": 3}))
    with pytest.raises(ConfigError, match=rf"^{f}: o_groups"):
        load_model(str(ckpt))
    f.write_text('{"vocab_size": 512,')
    with pytest.raises(ConfigError, match=rf"^{f}: not valid JSON"):
        load_model(str(ckpt))
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=rf"^{f}: top level must be an object, got list"):
        load_model(str(ckpt))


def test_weight_file_errors_name_the_file(ckpt: Path) -> None:
    shards = sorted(ckpt.glob("*.safetensors"))
    f = shards[0]
    data = f.read_bytes()
    for cut in (0, 7, 100, len(data) - 1):
        f.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match=rf"^{f}: not a readable safetensors file \(.*{cut} bytes"):
            load_model(str(ckpt))
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsError, match=rf"^{f}: not a readable safetensors file"):
        load_model(str(ckpt))


def test_index_and_tokenizer_errors_name_the_file(ckpt: Path) -> None:
    idx = ckpt / INDEX_FILE
    if idx.exists():
        good = idx.read_text()
        idx.write_text("{not json")
        with pytest.raises(WeightsError, match=rf"^{idx}: not valid JSON"):
            load_model(str(ckpt))
        idx.write_text(json.dumps({"metadata": {}}))
        with pytest.raises(WeightsError, match=rf"^{idx}: weight_map: missing"):
            load_model(str(ckpt))
        idx.write_text(good)
    tok = ckpt / "tokenizer.json"
    tok.write_text('{"model": 3}')
    with pytest.raises(ConfigError, match=rf"^{tok}: not a usable tokenizer.json"):
        load_model(str(ckpt))


def test_a_tensor_error_names_the_checkpoint_and_the_tensor(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = sorted(ckpt.glob("*.safetensors"))[0]
    tensors = load_file(str(f))
    key = next(
        k
        for k in sorted(tensors)
        if tensors[k].dtype.is_floating_point
        and tensors[k].shape[-1] > 1
        and f"{k.removesuffix('.weight')}.scale" not in tensors
    )  # a plain tensor, not a quantised pair
    tensors[key] = tensors[key][..., :1].contiguous()  # the wrong shape
    save_file(tensors, str(f))
    with pytest.raises(WeightsError) as e:
        load_model(str(ckpt))
    assert str(e.value).startswith(f"{ckpt}: ") and key.removesuffix(".weight") in str(e.value)
