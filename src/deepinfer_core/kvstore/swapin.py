"""Layer-by-layer swap-in of prefetched blocks into a device KV cache, overlapped with the forward.

A stored block is layer-major: ``num_layers`` equal slices of ``layer_nbytes`` (``pack_layers`` builds
one). The forward calls ``wait_layer(i)`` just before layer i reads its cache; on CUDA the copies run
on a side stream, one event per layer, so layer i waits only for its own slice while later slices are
still in flight (DeepSeek drives this copy with an RDMA NIC to spare the copy engine and SMs; a side
stream is the portable stand-in). Without CUDA the copy of layer i happens inside ``wait_layer(i)``,
so results and call order are the same and tests run on the CPU.

torch is imported lazily: the rest of ``kvstore`` moves bytes and never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_layers(layers: Sequence[np.ndarray]) -> np.ndarray:
    """One block's per-layer byte slices (equal sizes) as the stored layer-major uint8 buffer."""
    views = [np.ascontiguousarray(x).view(np.uint8).reshape(-1) for x in layers]
    if not views or len({v.size for v in views}) != 1:
        raise ValueError("layers: need >= 1 slices, all of the same byte size")
    return np.concatenate(views)


def stage(host_blocks: Sequence[np.ndarray], num_layers: int, layer_bytes: int, *, pin: bool = False):
    """Layer-major host blocks as one [num_layers, n, layer_bytes] uint8 tensor (each layer's slice
    contiguous), pinned if ``pin`` so device copies from it are asynchronous. A prefetcher can stage
    ahead of the step, off the critical path."""
    import torch

    for j, b in enumerate(host_blocks):
        if b.dtype != np.uint8 or b.size != num_layers * layer_bytes:
            raise ValueError(
                f"host_blocks[{j}]: must be uint8 of {num_layers} x {layer_bytes} bytes, got {b.dtype} {b.size}"
            )
    stacked = (
        np.stack(list(host_blocks)) if len(host_blocks) else np.empty((0, num_layers * layer_bytes), np.uint8)
    )
    t = torch.from_numpy(
        np.ascontiguousarray(stacked.reshape(-1, num_layers, layer_bytes).transpose(1, 0, 2))
    )
    return t.pin_memory() if pin else t


class LayerwiseSwapIn:
    """Copies host blocks into ``dst_layers`` (one uint8 tensor [pool_blocks, layer_nbytes] per layer,
    typically a byte view of that layer's KV cache) at the rows ``block_ids``."""

    def __init__(self, dst_layers: Sequence, host_blocks, block_ids: Sequence[int]) -> None:
        """``host_blocks``: a list of layer-major uint8 arrays (one per block), or blocks already staged
        by ``stage`` (a [num_layers, n, layer_bytes] uint8 tensor, pinned for CUDA: no host copy then)."""
        import torch

        self._torch = torch
        if not dst_layers:
            raise ValueError("dst_layers: need at least one layer")
        self.dst = list(dst_layers)
        nl = len(self.dst)
        width = int(self.dst[0].shape[1])
        for i, d in enumerate(self.dst):
            if d.dtype != torch.uint8 or d.dim() != 2 or int(d.shape[1]) != width:
                raise ValueError(
                    f"dst_layers[{i}]: must be uint8 [pool_blocks, {width}], got {d.dtype} {tuple(d.shape)}"
                )
        device = self.dst[0].device
        self._cuda = device.type == "cuda"
        if isinstance(host_blocks, torch.Tensor):
            if (
                host_blocks.dtype != torch.uint8
                or tuple(host_blocks.shape[::2]) != (nl, width)
                or host_blocks.dim() != 3
            ):
                raise ValueError(
                    f"host_blocks: a staged tensor must be uint8 [{nl}, n, {width}], got "
                    f"{host_blocks.dtype} {tuple(host_blocks.shape)}"
                )
            self._src = host_blocks.contiguous()
        else:
            self._src = stage(host_blocks, nl, width, pin=self._cuda)
        nblk = int(self._src.shape[1])
        if nblk != len(block_ids):
            raise ValueError(f"block_ids: {len(block_ids)} ids for {nblk} host blocks")
        rows = int(self.dst[0].shape[0])
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise ValueError(f"block_ids: must lie in [0, {rows}), got {ids.min()}..{ids.max()}")
        self.num_layers = nl
        self._ids = torch.from_numpy(ids).to(device)
        self._done = 0
        self._events: list = []
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(
                torch.cuda.current_stream(device)
            )  # the cache may be written just before
            with torch.cuda.stream(self._stream):
                for i in range(nl):
                    src = self._src[i].to(device, non_blocking=True)
                    self.dst[i].index_copy_(0, self._ids, src)
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    self._events.append(ev)

    def wait_layer(self, i: int) -> None:
        """Make the caller's stream wait until layer i's blocks are in place (CPU: copy them now)."""
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer={i}: must be in [0, {self.num_layers})")
        if self._cuda:
            self._torch.cuda.current_stream(self.dst[i].device).wait_event(self._events[i])
            return
        while self._done <= i:
            self.dst[self._done].index_copy_(0, self._ids, self._src[self._done])
            self._done += 1

    def wait_all(self) -> None:
        self.wait_layer(self.num_layers - 1)
        if self._cuda:
            for i in range(self.num_layers):
                self._torch.cuda.current_stream(self.dst[i].device).wait_event(self._events[i])
