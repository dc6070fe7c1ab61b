"""Model names -> (model, tokenizer): the shipped tiny checkpoint, the random tiny model, any release dir.

- ``"tiny"``: the trained checkpoint shipped in the package (``model/assets/tiny``: ``config.json``,
  FP8 / MXFP4 safetensors, ``tokenizer.json``; made by ``scripts/train_tiny.py``), with its BPE tokenizer;
- ``"tiny-random"``: :func:`~deepinfer_core.model.config.tiny_config` with weights drawn from ``seed``
  (what tests that need fresh weights use) and the byte tokenizer;
- a directory path: any release-format checkpoint (``config.json`` + safetensors + ``tokenizer.json``).

Every source goes through the same loader (:func:`~deepinfer_core.model.weights.load_state` over a
stream of (key, tensor) pairs): a directory streams its shards tensor by tensor
(:func:`~deepinfer_core.model.weights.iter_checkpoint`); the random model streams the parameters of a
freshly seeded model (:func:`~deepinfer_core.model.weights.iter_model`). Errors name what is wrong: a
missing file, an unknown or inconsistent config field (:class:`ConfigError`), a missing, unexpected or
misshapen tensor (:class:`WeightsError`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.config import ConfigError, ModelConfig, tiny_config
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.weights import INDEX_FILE, WeightsError, iter_checkpoint, iter_model, load_state

log = logging.getLogger(__name__)

__all__ = ["BUILTIN_MODELS", "TINY_DIR", "CheckpointError", "load_model", "load_tokenizer", "resolve_model"]

TINY_DIR = Path(__file__).resolve().parent / "assets" / "tiny"
BUILTIN_MODELS = ("tiny", "tiny-random")


class CheckpointError(FileNotFoundError):
    """A checkpoint directory lacks a file it needs: the message names it."""


def resolve_model(name: str) -> Path | None:
    """The directory of ``name`` (None for the in-memory ``tiny-random``); errors name the field."""
    if name == "tiny-random":
        return None
    p = TINY_DIR if name == "tiny" else Path(name)
    if not p.is_dir():
        raise CheckpointError(
            f"model={name!r}: not a built-in model {list(BUILTIN_MODELS)} nor a checkpoint directory"
        )
    for f in ("config.json", "tokenizer.json"):
        if not (p / f).is_file():
            raise CheckpointError(f"{f}: missing from checkpoint directory {p}")
    if not (p / INDEX_FILE).is_file() and not (p / "model.safetensors").is_file():
        raise CheckpointError(
            f"{INDEX_FILE}: missing from checkpoint directory {p} (nor is there a model.safetensors)"
        )
    return p


def load_tokenizer(path: Path | None, vocab_size: int) -> Any:
    """The checkpoint's ``tokenizer.json`` (a V4.1 tokenizer when it has the control tokens), or the byte
    tokenizer for the random model."""
    from deepinfer_core.tokenizer import ByteTokenizer, HFTokenizer, V41Tokenizer

    if path is None:
        return ByteTokenizer(vocab_size)
    file = path / "tokenizer.json"
    try:
        try:
            tok: Any = V41Tokenizer(file)
        except ValueError:  # no V4.1 control tokens: a plain HF tokenizer
            tok = HFTokenizer(file)
    except Exception as e:  # the tokenizers library raises a bare Exception on a corrupt file
        raise ConfigError(f"{file}: not a usable tokenizer.json ({' '.join(str(e).split())[:300]})") from None
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"{path / 'config.json'}: vocab_size={vocab_size}: the tokenizer ({file}) has "
            f"{tok.vocab_size} tokens; the model must cover them"
        )
    return tok


@functools.lru_cache(maxsize=2)
def _decoded(path: str, mtime: float) -> tuple[tuple[str, torch.Tensor], ...]:
    # the shipped checkpoint is decoded once per process (tests and benchmarks build many engines);
    # keyed by mtime so a rewritten checkpoint is read again
    return tuple(iter_checkpoint(path))


def load_model(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[DeepSeekV41, Any]:
    """(model, tokenizer) of a built-in name or a checkpoint directory (module docstring)."""
    path = resolve_model(name)
    if path is None:
        cfg = tiny_config()
        # drawn on the CPU: same on every device
        items: Any = iter_model(DeepSeekV41.from_config(cfg, seed=seed))
    else:
        cfg = ModelConfig.from_pretrained(path)
        if path == TINY_DIR:
            items = _decoded(str(path), (path / "config.json").stat().st_mtime)
        else:
            items = iter_checkpoint(path)
    model = DeepSeekV41(cfg).to(dtype=dtype, device=device)
    try:
        load_state(model, items, progress)
    except WeightsError as e:  # a missing / misshapen tensor is named by key; say which checkpoint
        if path is None or str(path) in str(e):
            raise
        raise WeightsError(f"{path}: {e}") from None
    log.info("model %s: %s", name, f"random weights from seed {seed}" if path is None else path)
    return model, load_tokenizer(path, cfg.vocab_size)
