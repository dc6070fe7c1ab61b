"""The executor's device caches: paged compressed KV + indexer keys, SWA rings, compressor state.

Layouts (all owned by the executor, addressed by what the caller passes in the batch):

- per Full (KV source) layer: main KV ``uint8 [num_blocks, block_size, main.bytes_per_token]`` and
  indexer keys ``uint8 [num_blocks, block_size, index.bytes_per_token]``. Compressed entry j of a
  ratio-r layer lives at logical slot j * r / min_ratio of its block table (so a table sized for the
  tokens always has room and block b holds only block b's tokens' entries; at ratio 2 half of it stays
  unused, see docs/model.md).
- per layer: SWA ring ``uint8 [num_slots, window + backtrack, swa.bytes_per_token]``, token p at p % ring.
- per Full layer with ratio > 1: compressor state ``float [num_slots, ratio + backtrack, state_dim]``,
  the per-token (value, score) pairs of the newest tokens, token p at p % ring. Because every entry is
  addressed by position, rolling back k <= backtrack tokens needs no undo: the next step simply starts
  at the earlier position and overwrites.

Byte formats come from ``deepinfer_core.kv.formats`` (FP4 main KV, FP8 SWA ring, MXFP4 indexer keys);
with quantisation off, :class:`NativeFormat` stores the model dtype's raw bytes (exact, any dtype).
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch


class CacheFormat(Protocol):
    """What the executor needs of a byte format (``deepinfer_core.kv.formats`` objects satisfy it)."""

    @property
    def bytes_per_token(self) -> int: ...

    def quantize(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, b: torch.Tensor) -> torch.Tensor: ...


@attrs.frozen
class NativeFormat:
    """Raw bytes of ``dtype`` (exact for float64 too; the kv RawFormat covers bf16/fp16/fp32 only)."""

    dim: int
    dtype: torch.dtype = torch.float32
    name: str = "native"

    @property
    def bytes_per_token(self) -> int:
        return self.dim * self.dtype.itemsize

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).contiguous().view(torch.uint8)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(self.dtype)


@attrs.frozen(kw_only=True)
class CacheFormats:
    main: CacheFormat
    swa: CacheFormat
    index: CacheFormat
    quantized: bool

    @classmethod
    def make(cls, head_dim: int, index_dim: int, quantize: bool, dtype: torch.dtype) -> CacheFormats:
        """FP4 / FP8 / MXFP4 as released when ``quantize``; else exact raw bytes of ``dtype``."""
        if not quantize:
            return cls(
                main=NativeFormat(head_dim, dtype),
                swa=NativeFormat(head_dim, dtype),
                index=NativeFormat(index_dim, dtype),
                quantized=False,
            )
        from deepinfer_core.kv import formats as F

        return cls(
            main=F.get_format("fp4", head_dim),
            swa=F.get_format("fp8", head_dim),
            index=F.get_format("mxfp4", index_dim),
            quantized=True,
        )


def roundtrip(fmt: CacheFormat, x: torch.Tensor) -> torch.Tensor:
    """What reading back a write of ``x`` returns, in x's dtype."""
    return fmt.dequantize(fmt.quantize(x)).to(x.dtype)
