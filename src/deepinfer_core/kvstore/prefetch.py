"""Asynchronous prefetch of blocks from a store into host memory.

The Q&A's path is 3FS -> host shared memory (asynchronously, ahead of the step that needs the KV) ->
HBM. ``Prefetcher`` is the first hop: ``prefetch(keys)`` returns at once with a handle; worker threads
read the blocks (file and Redis backends release the GIL in I/O) and land them as numpy uint8 arrays.
A bound on bytes in flight keeps host memory in check: a batch waits for room before it reads more.
A store fault is a miss, never an exception out of a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from deepinfer_core.kvstore.guard import StoreGuard, StoreGuardConfig
from deepinfer_core.kvstore.record import check_key

logger = logging.getLogger(__name__)


class PrefetchBatch:
    """Blocks being fetched; ``result()`` gives one uint8 array (or None for a miss) per key, in order.

    The prefix use: only the leading run of hits is usable (a block's KV needs all blocks before it),
    which ``leading_hits()`` returns. A read that failed is a miss (the prefetcher's ``StoreGuard``); with
    a ``timeout``, a read still running when it expires is a miss too (its bytes are not waited for)."""

    def __init__(self, keys: list[bytes], futures: list[Future]) -> None:
        self.keys = keys
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> list[np.ndarray | None]:
        end = None if timeout is None else time.monotonic() + timeout
        return [_get(f, end) for f in self._futures]

    def leading_hits(self, timeout: float | None = None) -> list[np.ndarray]:
        end = None if timeout is None else time.monotonic() + timeout
        out = []
        for f in self._futures:
            b = _get(f, end)
            if b is None:
                break
            out.append(b)
        return out


def _get(f: Future, end: float | None) -> np.ndarray | None:
    """A read's block, or None (a miss) if it is still running at ``end``."""
    try:
        return f.result(None if end is None else max(0.0, end - time.monotonic()))
    except TimeoutError:
        return None


class Prefetcher:
    """Reads blocks of ``store`` on ``num_workers`` threads, at most ``max_inflight_bytes`` held by
    unfinished reads (a read reserves ``expected_block_bytes`` until it knows its size).

    Reads go through a ``StoreGuard`` (``store`` itself if it is one, else one without deadlines: the
    reads are already off the caller's path, which bounds its wait with ``result(timeout)``), so a store
    fault is a miss and its breaker skips a store that is down."""

    def __init__(
        self,
        store,
        *,
        num_workers: int = 4,
        max_inflight_bytes: int = 1 << 30,
        expected_block_bytes: int = 1 << 20,
    ) -> None:
        for name, v in (
            ("num_workers", num_workers),
            ("max_inflight_bytes", max_inflight_bytes),
            ("expected_block_bytes", expected_block_bytes),
        ):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Prefetcher.{name}={v!r}: must be an int >= 1")
        if expected_block_bytes > max_inflight_bytes:
            raise ValueError("Prefetcher.expected_block_bytes: must be <= max_inflight_bytes")
        self.store = (
            store
            if isinstance(store, StoreGuard)
            else StoreGuard(store, StoreGuardConfig(read_timeout_s=None, write_timeout_s=None))
        )
        self.max_inflight_bytes = max_inflight_bytes
        self.expected_block_bytes = expected_block_bytes
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="kvstore-prefetch")
        self._room = threading.Condition()
        self._inflight = 0

    def _reserve(self, n: int) -> None:
        with self._room:
            while self._inflight + n > self.max_inflight_bytes:
                self._room.wait()
            self._inflight += n

    def _release(self, n: int) -> None:
        with self._room:
            self._inflight -= n
            self._room.notify_all()

    def _fetch(self, key: bytes) -> np.ndarray | None:
        self._reserve(self.expected_block_bytes)
        try:
            data = self.store.get(key)
        finally:
            self._release(self.expected_block_bytes)
        if data is None:
            return None
        return np.frombuffer(data, dtype=np.uint8)

    def prefetch(self, keys: Sequence[bytes]) -> PrefetchBatch:
        """Start reading ``keys``; returns at once."""
        ks = [check_key(k) for k in keys]
        return PrefetchBatch(ks, [self._pool.submit(self._fetch, k) for k in ks])

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
