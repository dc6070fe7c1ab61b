"""Host / device token helpers shared by the engine and the executor (no component of their own).

The asynchronous overlap keeps a step's sampled tokens on the device and feeds them to the next step
before the host has read them: :class:`DeviceTokens` is one step's tokens on their way to the host,
:class:`TokenFeed` the input tokens of a step that exist only on the device, and :func:`h2d` the host to
device copy that never synchronises. They lived in the CUDA decode module; they are general (the CPU runs
the same code path) and the engine imports them, so they sit here, beside neither.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

__all__ = ["DeviceTokens", "TokenFeed", "h2d"]


def h2d(arr: np.ndarray, dev: torch.device, dtype: Any = None) -> torch.Tensor:
    """A host array on ``dev`` without a synchronisation: through pinned memory, non-blocking. A blocking
    copy waits for the work queued before it (with the asynchronous overlap, a whole step), and an
    asynchronous copy from pageable memory lets the driver synchronise with the stream to stage it; torch
    keeps the pinned block until the copy is done. On the CPU: the array as a tensor (no copy)."""
    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=dtype))
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


class DeviceTokens:
    """One step's sampled tokens on their way to the host (the engine's asynchronous overlap).

    ``dev`` stays on the device for the next step's input (:class:`TokenFeed`); on a CUDA device a
    non-blocking copy into pinned host memory is queued behind the step with an event recorded after it,
    so :meth:`host` waits for this step only (never ``torch.cuda.synchronize``). On the CPU the tensor is
    already on the host and the event is a no-op: the same code path, testable without a GPU."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.dev = tokens
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens
        self._np: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        """The host copy is complete (no wait in :meth:`host`)."""
        return self._np is not None or self._event is None or self._event.query()

    def host(self) -> np.ndarray:
        """The tokens as int64 numpy; waits for the step's event on the first call."""
        if self._np is None:
            if self._event is not None:
                self._event.synchronize()
            self._np = self._host.numpy().astype(np.int64)
        return self._np


@attrs.define
class TokenFeed:
    """Input tokens of a step that the previous step sampled and the host has not read: token ``index[j]``
    of the batch (its flat ``token_ids``, which hold a placeholder there) is ``src.dev[rows[j]]``.

    The executor writes them on the device after the host image of the inputs is copied
    (:meth:`apply`), hashes the step's Engram n-grams on the device, and records the values in its host
    token ring once they are known (``ModelExecutor.resolve_fed``)."""

    index: np.ndarray  # int64 positions in the batch's token_ids
    rows: np.ndarray  # int64 rows of src
    src: DeviceTokens

    def apply(self, tokens: torch.Tensor) -> None:
        """Overwrite the fed entries of the device token tensor (int64 [T]); no host synchronisation."""
        if self.index.size == 0:
            return
        dev = tokens.device
        idx, rows = h2d(self.index, dev, np.int64), h2d(self.rows, dev, np.int64)
        # a failed row samples -1: feed a valid id (that request fails at its update; its output is dropped)
        tokens[idx] = self.src.dev[rows].to(tokens.dtype).clamp(min=0)

    def sub(self, lo: int, hi: int) -> TokenFeed:
        """The part of the feed inside tokens [lo, hi), re-based at lo (one request of a split batch)."""
        m = (self.index >= lo) & (self.index < hi)
        return TokenFeed(self.index[m] - lo, self.rows[m], self.src)
