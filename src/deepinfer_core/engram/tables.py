"""Engram tables on one device and in host memory, in bf16 or fp8 e4m3 with power-of-two block scales.

Storage formats (``fmt``):

- ``"bf16"``: [rows, dim] bfloat16, 2 * dim bytes per row.
- ``"fp8"``: [rows, dim] float8_e4m3fn plus one scale per 32 values stored as its biased exponent byte
  (ue8m0, scale = 2**(code - 127)), dim + dim / 32 bytes per row: 264 B for V4.1's head_dim 256, which is
  what makes its two ~384M-row tables 202.76 GB. Power-of-two scales make dequantisation exact in bf16.

``fetch`` returns dequantised rows (bf16 by default) in the caller's order and shape; ids outside
[0, num_rows) raise ``IndexError`` naming the id and the range. ``LocalEngramTable.fetch(ids, check=False)``
skips that range check, which reads the ids' min / max back (on a GPU a device synchronisation, and
impossible under CUDA-graph capture), for ids in range by construction (the hasher's).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from deepinfer_kernels import get_op
from deepinfer_kernels.ops.engram import dequantize_fp8

log = logging.getLogger(__name__)

TableFormat = Literal["bf16", "fp8"]
FORMATS: tuple[str, ...] = ("bf16", "fp8")
SCALE_BLOCK = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(values: torch.Tensor, block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, D] floats -> (fp8 e4m3 [R, D], uint8 exponent codes [R, D // block]); each block's scale is the
    smallest power of two that keeps its largest magnitude within the e4m3 range."""
    if values.dim() != 2 or values.shape[1] % block:
        raise ValueError(
            f"values: must be [rows, dim] with dim divisible by {block}, got {tuple(values.shape)}"
        )
    v = values.to(torch.float32).unflatten(-1, (values.shape[1] // block, block))
    amax = v.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax.clamp_min(1e-30) / FP8_MAX)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    data = (v * torch.exp2(-exp).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    return data, (exp + 127).to(torch.uint8)


def bytes_per_row(row_dim: int, fmt: str, block: int = SCALE_BLOCK) -> int:
    """Stored bytes of one row (values plus scales)."""
    if fmt == "bf16":
        return 2 * row_dim
    if fmt == "fp8":
        if row_dim % block:
            raise ValueError(f"row_dim={row_dim}: fp8 tables need a multiple of {block}")
        return row_dim + row_dim // block
    raise ValueError(f"fmt={fmt!r}: must be one of {FORMATS}")


def _check_int_ids(row_ids: torch.Tensor) -> None:
    dt = row_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise TypeError(f"row_ids: must be an integer tensor, got {row_ids.dtype}")


def check_row_ids(row_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Flattened int64 ids, or ``IndexError``/``TypeError`` naming the bad id or dtype."""
    _check_int_ids(row_ids)
    flat = row_ids.reshape(-1).to(torch.int64)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_rows:
            raise IndexError(f"row_ids: id {lo if lo < 0 else hi} is outside [0, num_rows={num_rows})")
    return flat


def make_storage(values: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scales) of ``values`` [R, D] in format ``fmt``."""
    if fmt == "bf16":
        return values.to(torch.bfloat16).contiguous(), None
    if fmt == "fp8":
        return quantize_fp8(values)
    raise ValueError(f"fmt={fmt!r}: must be one of {FORMATS}")


def random_values(num_rows: int, row_dim: int, seed: int = 0) -> torch.Tensor:
    """Reproducible N(0, 0.02) rows (initialisation scale of embedding tables), for demos and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, row_dim, generator=g) * 0.02


def _check_storage(data: torch.Tensor, scales: torch.Tensor | None) -> str:
    if data.dim() != 2:
        raise ValueError(f"data: must be [rows, dim], got shape {tuple(data.shape)}")
    if data.dtype == torch.float8_e4m3fn:
        if (
            scales is None
            or scales.dtype != torch.uint8
            or scales.dim() != 2
            or scales.shape[0] != data.shape[0]
        ):
            raise ValueError("scales: an fp8 table needs uint8 exponent codes [rows, dim // 32]")
        if scales.shape[1] == 0 or data.shape[1] % scales.shape[1]:
            raise ValueError(f"scales: {scales.shape[1]} blocks do not divide dim {data.shape[1]}")
        return "fp8"
    if data.dtype == torch.bfloat16:
        if scales is not None:
            raise ValueError("scales: only fp8 tables take scales")
        return "bf16"
    raise ValueError(
        f"data: dtype {data.dtype} is not a table format; use bfloat16 or float8_e4m3fn (+ scales)"
    )


class LocalEngramTable:
    """The whole table on one device; ``fetch`` is one gather (the ``engram_gather`` op)."""

    def __init__(
        self,
        data: torch.Tensor,
        scales: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        backend: str = "reference",
    ) -> None:
        self.fmt = _check_storage(data, scales)
        dev = torch.device(device) if device is not None else data.device
        self.data = data.to(dev)
        self.scales = scales.to(dev) if scales is not None else None
        self.out_dtype = out_dtype
        self._gather = get_op("engram_gather", backend)

    @classmethod
    def from_values(
        cls, values: torch.Tensor, fmt: str = "bf16", device: torch.device | str | None = None
    ) -> LocalEngramTable:
        data, scales = make_storage(values, fmt)
        return cls(data, scales, device)

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_dim(self) -> int:
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (
            self.scales.numel() if self.scales is not None else 0
        )

    def fetch(self, row_ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Rows [*row_ids.shape, row_dim] in ``out_dtype``. ``check=False``: no id range check and no host
        synchronisation (see the module docstring); the ids keep their dtype (int32 ids index directly)."""
        if check:
            ids = check_row_ids(row_ids, self.num_rows)
        else:
            _check_int_ids(row_ids)
            # int32 / int64 ids index as they are (no cast kernel); the op flattens and reshapes back
            ids = row_ids if row_ids.dtype in (torch.int32, torch.int64) else row_ids.to(torch.int64)
        dev = self.data.device
        if ids.device != dev:
            if ids.device.type == "cpu" and dev.type == "cuda":
                # pinned + non-blocking: a blocking copy would wait for the device's queued work
                ids = ids.pin_memory().to(dev, non_blocking=True)
            else:
                # device ids, host table: a blocking copy (the ids must have landed before the gather
                # reads them; a non-blocking one would race)
                ids = ids.to(dev)
        # the ids are checked above (or vouched for): the op's own range check would only repeat it
        out = self._gather(self.data, ids, self.scales, self.out_dtype, check=False)
        return out.reshape(*row_ids.shape, self.row_dim) if check else out

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> LocalEngramTable:
        """The same table (rows, scales, output dtype, gather op) on ``device``."""
        t = LocalEngramTable.__new__(LocalEngramTable)
        t.fmt, t.out_dtype, t._gather = self.fmt, self.out_dtype, self._gather
        t.data = self.data.to(device)
        t.scales = self.scales.to(device) if self.scales is not None else None
        return t


def _pin_if_cuda(t: torch.Tensor) -> torch.Tensor:
    # Pinned (page-locked) memory makes host->device copies asynchronous and full-bandwidth; it only
    # exists with a CUDA runtime, so a CPU-only machine keeps plain pageable memory.
    if torch.cuda.is_available():
        return t.pin_memory()
    return t


class HostEngramTable:
    """The table in host memory (pinned when CUDA exists): gather on the CPU, copy only the gathered
    rows (still quantised) to ``device``, dequantise there. The community recipe for four-GPU serving."""

    def __init__(
        self,
        data: torch.Tensor,
        scales: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.fmt = _check_storage(data, scales)
        self.data = _pin_if_cuda(data.to("cpu").contiguous())
        self.scales = _pin_if_cuda(scales.to("cpu").contiguous()) if scales is not None else None
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        self.pinned = self.data.is_pinned()
        log.debug("HostEngramTable: %d rows, fmt %s, pinned=%s", self.num_rows, self.fmt, self.pinned)

    @classmethod
    def from_values(
        cls, values: torch.Tensor, fmt: str = "bf16", device: torch.device | str = "cpu"
    ) -> HostEngramTable:
        data, scales = make_storage(values, fmt)
        return cls(data, scales, device)

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_dim(self) -> int:
        return int(self.data.shape[1])

    def fetch(self, row_ids: torch.Tensor) -> torch.Tensor:
        flat = check_row_ids(row_ids, self.num_rows).cpu()
        # Gather straight into a pinned staging buffer (torch's host caching allocator recycles it), so the
        # copy to the device is one asynchronous DMA of the still-quantised rows.
        raw = self.data.view(torch.uint8)  # gather bytes: uint8 index kernels exist for every dtype's rows
        rows = torch.empty((flat.numel(), raw.shape[1]), dtype=torch.uint8, pin_memory=self.pinned)
        torch.index_select(raw, 0, flat, out=rows)
        sc = None
        if self.scales is not None:
            sc = torch.empty((flat.numel(), self.scales.shape[1]), dtype=torch.uint8, pin_memory=self.pinned)
            torch.index_select(self.scales, 0, flat, out=sc)
        rows = rows.to(self.device, non_blocking=True).view(self.data.dtype)
        if sc is not None:
            out = dequantize_fp8(rows, sc.to(self.device, non_blocking=True), self.out_dtype)
        else:
            out = rows.to(self.out_dtype)
        return out.reshape(*row_ids.shape, self.row_dim)
