"""Safetensors checkpoints of the V4.1 model: FP8 block-scaled linears, MXFP4 routed experts.

Layout written by :func:`save_weights` and read by :func:`load_weights` (names are this package's
parameter names; routed experts are split per expert as in released checkpoints):

- ``<base>.weight`` float8_e4m3fn [out, in] + ``<base>.scale`` float8_e8m0fnu [ceil(out/32), ceil(in/32)]
  for attention / indexer / compressor / shared-expert / drafter / Engram linears, mHC projections,
  embedding and head (one power-of-two scale per 32x32 block,
  chosen so the block max never clips: 2^ceil(log2(amax / 448))).
- ``layers.L.ffn.experts.E.w{1,2,3}.weight`` uint8 [out, in/2] (two e2m1 codes per byte, low nibble
  first) + ``.scale`` uint8 [out, in/32] (ue8m0 exponent, bias 127): MXFP4 with one scale per 32 inputs.
- everything else (norms, router, sinks, positional biases, mHC scales, the drafter's Markov and
  confidence heads) in the model dtype (bf16 for the shipped checkpoint).

Loading streams: shards are memory-mapped by ``safe_open`` and read one tensor at a time, dequantised
and copied into the parameter, so no shard is ever held in memory twice. A model whose weights were
first rounded with :func:`quantize_weights_` round-trips bit-exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from deepinfer_core.kv.formats import (
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    pow2_scale_exponent,
    unpack_nibbles,
)
from deepinfer_core.model.model import DeepSeekV41

log = logging.getLogger(__name__)

__all__ = [
    "WeightsError",
    "iter_checkpoint",
    "iter_model",
    "load_state",
    "load_weights",
    "quantize_weights_",
    "save_weights",
]

INDEX_FILE = "model.safetensors.index.json"
FP8_BLOCK = 32
MX_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0

_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.(w[123])$")
_SHARED = re.compile(r"^layers\.(\d+)\.ffn\.s_(w[123])$")
# dense matrices stored FP8: every linear (the drafter's fuse / condition / MLP and the Engram projections
# too), the mHC projections, the embedding and the head (that is what keeps the shipped tiny checkpoint
# under 8 MiB); routers, norms, sinks, biases and the drafter's Markov / confidence heads stay plain
_FP8_LEAVES = (
    "wq_a",
    "wq_b",
    "wkv",
    "wo_a",
    "wo_b",
    "wgate",
    "wq",
    "weights_proj",
    "w_fuse",
    "w_cond",
    "w1",
    "w2",
    "w3",
    "w_v",
    "w_k",
    "phi",
    "embed",
    "head",
)


class WeightsError(ValueError):
    """A checkpoint does not match the model: the message names the tensor."""


@attrs.frozen
class _Entry:
    key: str  # checkpoint base name
    param: str  # model parameter name
    expert: int | None  # slice of a stacked expert parameter
    kind: str  # "fp8" | "mxfp4" | "plain"


def _entries(model: DeepSeekV41, fp8: bool, mxfp4: bool) -> list[_Entry]:
    out = []
    for name, p in model.named_parameters():
        if m := _EXPERT.match(name):
            for e in range(p.shape[0]):
                out.append(
                    _Entry(f"layers.{m[1]}.ffn.experts.{e}.{m[2]}", name, e, "mxfp4" if mxfp4 else "plain")
                )
        elif m := _SHARED.match(name):
            out.append(
                _Entry(f"layers.{m[1]}.ffn.shared_experts.{m[2]}", name, None, "fp8" if fp8 else "plain")
            )
        elif name.rsplit(".", 1)[-1] in _FP8_LEAVES and p.dim() >= 2:
            out.append(_Entry(name, name, None, "fp8" if fp8 else "plain"))
        else:
            out.append(_Entry(name.removesuffix(".weight"), name, None, "plain"))
    return out


# ---------------------------------------------------------------- codecs
def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 values, e8m0 scales [ceil(out/32), ceil(in/32)])."""
    o, i = w.shape
    po, pi = -(-o // FP8_BLOCK) * FP8_BLOCK, -(-i // FP8_BLOCK) * FP8_BLOCK
    wp = torch.zeros(po, pi, dtype=torch.float64)
    wp[:o, :i] = w.detach().to(torch.float64).cpu()
    blocks = wp.view(po // FP8_BLOCK, FP8_BLOCK, pi // FP8_BLOCK, FP8_BLOCK)
    e = pow2_scale_exponent(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:o, :i]
    vals = (w.detach().to(torch.float64).cpu() / full).to(torch.float8_e4m3fn)
    return vals, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_dequantize(vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, i = vals.shape
    e = scale.view(torch.uint8).to(torch.int32) - 127
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)
    full = s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:o, :i]
    return vals.to(torch.float64) * full


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] (in % 32 == 0) -> (packed e2m1 uint8 [out, in/2], ue8m0 uint8 [out, in/32])."""
    o, i = w.shape
    if i % MX_GROUP:
        raise WeightsError(f"MXFP4 needs the input dim to be a multiple of {MX_GROUP}, got {i}")
    g = w.detach().to(torch.float64).cpu().view(o, i // MX_GROUP, MX_GROUP)
    e = pow2_scale_exponent(g.abs().amax(-1), E2M1_MAX)
    scaled = g / torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)[..., None]
    codes = e2m1_encode(scaled.float()).view(o, i)
    return pack_nibbles(codes), (e + 127).to(torch.uint8)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed)).to(torch.float64).view(o, -1, MX_GROUP)
    s = torch.ldexp(torch.ones(scale.shape, dtype=torch.float64), scale.to(torch.int32) - 127)
    return (vals * s[..., None]).view(o, -1)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _encode(e: _Entry, t: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if e.kind == "fp8":
        v, s = fp8_quantize(_as_2d(t))
        return {f"{e.key}.weight": v, f"{e.key}.scale": s}
    if e.kind == "mxfp4":
        v, s = mxfp4_quantize(_as_2d(t))
        return {f"{e.key}.weight": v, f"{e.key}.scale": s}
    key = f"{e.key}.weight" if e.param.endswith(".weight") else e.key
    return {key: t.detach().to(dtype).cpu().contiguous()}


def _tensor_of(model: DeepSeekV41, e: _Entry) -> torch.Tensor:
    p = model.get_parameter(e.param)
    return p[e.expert] if e.expert is not None else p


@torch.no_grad()
def quantize_weights_(model: DeepSeekV41, fp8: bool = True, mxfp4: bool = True) -> DeepSeekV41:
    """Round the weights that the checkpoint stores quantised to their FP8 / MXFP4 values, in place."""
    for e in _entries(model, fp8, mxfp4):
        t = _tensor_of(model, e)
        if e.kind == "fp8":
            t.copy_(fp8_dequantize(*fp8_quantize(_as_2d(t))).view_as(t))
        elif e.kind == "mxfp4":
            t.copy_(mxfp4_dequantize(*mxfp4_quantize(_as_2d(t))).view_as(t))
    return model


# ---------------------------------------------------------------- save / load
@torch.no_grad()
def save_weights(
    model: DeepSeekV41,
    path: str | Path,
    fp8: bool = True,
    mxfp4: bool = True,
    max_shard_bytes: int = 2 << 30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json, shards ``model-0000i-of-0000n.safetensors`` and the index file."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.cfg.save_pretrained(out)
    dt = dtype or next(model.parameters()).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for e in _entries(model, fp8, mxfp4):
        enc = _encode(e, _tensor_of(model, e), dt)
        nbytes = sum(t.numel() * t.element_size() for t in enc.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(enc)
        size += nbytes
    n = len(shards)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = fname
            total += t.numel() * t.element_size()
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return out


@contextlib.contextmanager
def _open_shard(file: Path) -> Iterator[Any]:
    """``safe_open`` whose errors name the file: a truncated or corrupt shard raises WeightsError
    ``<file>: not a readable safetensors file (<why>)`` instead of a bare SafetensorError."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        size = file.stat().st_size if file.exists() else 0
        raise WeightsError(
            f"{file}: not a readable safetensors file ({' '.join(str(e).split())}; "
            f"{size} bytes: truncated or corrupt?)"
        ) from None


def _weight_map(path: Path) -> dict[str, str]:
    idx = path / INDEX_FILE
    if idx.exists():
        try:
            doc = json.loads(idx.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{idx}: not valid JSON ({e})") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise WeightsError(f"{idx}: weight_map: missing, or not an object of tensor name -> shard file")
        return wm
    single = path / "model.safetensors"
    if single.exists():
        with _open_shard(single) as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    raise WeightsError(f"{path}: neither {INDEX_FILE} nor model.safetensors found")


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, dequantised value) of every tensor of a checkpoint directory, one at a time:
    shards are memory-mapped and each tensor is read, decoded and handed over before the next."""
    root = Path(path)
    wm = _weight_map(root)
    by_shard: dict[str, list[str]] = {}
    for key, shard in wm.items():
        by_shard.setdefault(shard, []).append(key)
    for shard, keys in sorted(by_shard.items()):
        if not (root / shard).is_file():
            raise WeightsError(f"{shard}: listed in {INDEX_FILE} but missing from {root}")
        with _open_shard(root / shard) as f:
            names = set(f.keys())
            for key in sorted(keys):
                if key not in names:
                    raise WeightsError(
                        f"{key}: listed in the index under {shard} but not in that file ({root / shard})"
                    )
                if key.endswith(".scale"):
                    continue
                raw = f.get_tensor(key)
                scale_key = f"{key.removesuffix('.weight')}.scale"
                if scale_key in wm:
                    if wm[scale_key] != shard:
                        raise WeightsError(f"{scale_key}: must be in the same shard as {key}")
                    sc = f.get_tensor(scale_key)
                    yield (
                        key,
                        (
                            fp8_dequantize(raw, sc)
                            if raw.dtype == torch.float8_e4m3fn
                            else mxfp4_dequantize(raw, sc)
                        ),
                    )
                else:
                    yield key, raw


def iter_model(model: DeepSeekV41) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, value) of a model's own parameters, unquantised: a checkpoint that exists only
    in memory (the random ``tiny-random`` model is loaded through this and :func:`load_state`)."""
    for e in _entries(model, False, False):
        t = _tensor_of(model, e)
        yield (f"{e.key}.weight" if e.param.endswith(".weight") else e.key), t.detach()


@torch.no_grad()
def load_state(
    model: DeepSeekV41, items: Iterable[tuple[str, torch.Tensor]], progress: bool = False
) -> DeepSeekV41:
    """Fill ``model``'s parameters from (checkpoint key, value) pairs (:func:`iter_checkpoint`,
    :func:`iter_model`), copying each as it comes. Unexpected, misshapen and missing tensors raise
    :class:`WeightsError` naming them."""
    want = {e.key: e for e in _entries(model, True, True)}
    seen: set[str] = set()
    bar = tqdm(total=len(want), desc="load weights", disable=not progress, unit="tensor")
    for key, val in items:
        base = key.removesuffix(".weight")
        e = want.get(base) or want.get(key)
        if e is None:
            raise WeightsError(f"{key}: unexpected tensor (no such parameter in the model)")
        dst = _tensor_of(model, e)
        if val.numel() != dst.numel() or (val.dim() == dst.dim() and val.shape != dst.shape):
            raise WeightsError(
                f"{key}: shape {tuple(val.shape)} does not match parameter {e.param} {tuple(dst.shape)}"
            )
        dst.copy_(val.reshape(dst.shape).to(dst.dtype))
        seen.add(e.key)
        bar.update(1)
    bar.close()
    missing = sorted(set(want) - seen)
    if missing:
        raise WeightsError(f"{missing[0]}: missing from the checkpoint ({len(missing)} missing in all)")
    return model


def load_weights(model: DeepSeekV41, path: str | Path, progress: bool = False) -> DeepSeekV41:
    """Fill ``model``'s parameters from a checkpoint directory, one tensor at a time.

    Quantised tensors are recognised by their ``.scale`` companion. Missing, unexpected or misshapen
    tensors raise :class:`WeightsError` naming them.
    """
    return load_state(model, iter_checkpoint(path), progress)


def checkpoint_bytes(model: DeepSeekV41, fp8: bool = True, mxfp4: bool = True, plain_bytes: int = 2) -> int:
    """Bytes a checkpoint of this model takes (plain tensors at ``plain_bytes`` per value)."""
    total = 0
    for e in _entries(model, fp8, mxfp4):
        t = _tensor_of(model, e)
        o, i = math.prod(t.shape[:-1]), t.shape[-1]
        if e.kind == "fp8":
            total += o * i + -(-o // FP8_BLOCK) * -(-i // FP8_BLOCK)
        elif e.kind == "mxfp4":
            total += o * i // 2 + o * i // MX_GROUP
        else:
            total += t.numel() * plain_bytes
    return total


def iter_checkpoint_names(model: DeepSeekV41) -> Iterator[str]:
    """Base names of the checkpoint tensors, in write order."""
    return (e.key for e in _entries(model, True, True))
