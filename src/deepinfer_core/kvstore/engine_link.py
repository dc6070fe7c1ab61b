"""The engine's side of the store: a pool block's bytes in and out of the device caches, and a link
that fetches a prefix's missing blocks and writes finished blocks back.

A pool block is the same row of every block cache (main KV and indexer keys of each KV source layer,
exactly what ``ModelExecutor.copy_blocks`` copies); stored layer-major, one cache after the other, so
the bytes of a block are the same whichever pool row it came from. torch is imported lazily.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from deepinfer_core.kvstore.guard import READ, WRITE, StoreGuard, StoreGuardConfig
from deepinfer_core.kvstore.record import TTLPolicy, block_keys

logger = logging.getLogger(__name__)


class BlockCodec:
    """Reads and writes whole pool blocks across ``caches`` (uint8 tensors [num_blocks, ...], in order)."""

    def __init__(self, caches: Sequence) -> None:
        import torch

        if not caches:
            raise ValueError("caches: need at least one block cache tensor")
        n = int(caches[0].shape[0])
        for i, c in enumerate(caches):
            if c.dtype != torch.uint8 or int(c.shape[0]) != n:
                raise ValueError(
                    f"caches[{i}]: must be uint8 with {n} blocks first, got {c.dtype} {tuple(c.shape)}"
                )
        self.caches = list(caches)
        self.num_blocks = n
        self.widths = [int(c[0].numel()) for c in self.caches]
        self.nbytes = int(sum(self.widths))

    @classmethod
    def from_executor(cls, executor) -> BlockCodec:
        """Main KV then indexer keys of each KV source layer of a ``model.ModelExecutor``."""
        caches = []
        for s in sorted(executor.kv):
            caches += [executor.kv[s], executor.index_keys[s]]
        return cls(caches)

    def _ids(self, block_ids) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 1 or ids.max() >= self.num_blocks):
            raise ValueError(f"block_ids: must lie in [1, {self.num_blocks}) (block 0 is the null block)")
        return ids

    def read(self, block_ids) -> list[np.ndarray]:
        """One uint8 array of ``nbytes`` per block."""
        import torch

        ids = self._ids(block_ids)
        if not ids.size:
            return []
        t = torch.as_tensor(ids, device=self.caches[0].device)
        flat = (
            torch.cat([c.index_select(0, t).reshape(ids.size, -1) for c in self.caches], dim=1).cpu().numpy()
        )
        return [flat[i] for i in range(ids.size)]

    def write(self, block_ids, payloads: Sequence[np.ndarray | bytes]) -> None:
        """Put each payload (``nbytes`` bytes, as ``read`` gives) into its block of every cache."""
        import torch

        ids = self._ids(block_ids)
        if len(payloads) != ids.size:
            raise ValueError(f"payloads: {len(payloads)} for {ids.size} blocks")
        if not ids.size:
            return
        rows = []
        for j, p in enumerate(payloads):
            a = (
                np.frombuffer(p, np.uint8)
                if isinstance(p, bytes | bytearray | memoryview)
                else np.asarray(p, np.uint8)
            )
            if a.size != self.nbytes:
                raise ValueError(f"payloads[{j}]: {a.size} bytes, a block has {self.nbytes}")
            rows.append(a.reshape(-1))
        flat = torch.from_numpy(np.stack(rows)).to(self.caches[0].device)
        t = torch.as_tensor(ids, device=self.caches[0].device)
        off = 0
        for c, w in zip(self.caches, self.widths):
            c.index_copy_(0, t, flat[:, off : off + w].reshape(ids.size, *c.shape[1:]))
            off += w


class StoreLink:
    """A store attached to one engine: ``fetch`` after a GPU prefix miss, ``land`` of the fetched blocks,
    ``write_back`` of finished blocks.

    Keys are ``block_keys(tokens, block_size, extra_key)``; ``extra_key`` must name everything the KV
    depends on besides the tokens (model and weights, cache format), or two engines would share wrong KV.
    Every store call goes through ``guard`` (a ``StoreGuard``, or one built from a ``StoreGuardConfig`` /
    None), so a store fault is a miss or a skipped write and never raises here (docs/kvstore.md, "Faults").
    Configuration errors are raised at construction: a traffic class the store's TTL policy does not
    know, a store capacity below one block, a store that refuses the configuration at start.
    """

    def __init__(
        self,
        store,
        codec: BlockCodec,
        block_size: int,
        *,
        extra_key: bytes,
        traffic_class: str = "chatbot",
        guard: StoreGuard | StoreGuardConfig | None = None,
    ) -> None:
        if not isinstance(extra_key, bytes) or not extra_key:
            raise ValueError("extra_key: must be non-empty bytes naming the model, weights and cache format")
        ttl = getattr(store, "ttl", None)
        if isinstance(ttl, TTLPolicy):
            ttl.ttl_ns(traffic_class)  # ValueError naming the known classes, now rather than at every put
        cap = getattr(store, "capacity_bytes", None)
        if isinstance(cap, int) and cap < codec.nbytes:
            raise ValueError(
                f"capacity_bytes={cap}: the store holds less than one block of this engine "
                f"({codec.nbytes} bytes), so it could never hit"
            )
        self.store = store
        self.codec = codec
        self.block_size = int(block_size)
        self.extra_key = extra_key
        self.traffic_class = traffic_class
        if isinstance(guard, StoreGuard):
            self.guard = guard  # an engine's reset keeps its guard: the breaker's state stays
        else:
            self.guard = StoreGuard(store, guard)
            self.guard.check_store()
        self.fetched_blocks = 0
        self.written_blocks = 0

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        return block_keys(tokens, self.block_size, self.extra_key)

    def fetch(self, tokens: np.ndarray, from_block: int) -> list[np.ndarray]:
        """The stored blocks of ``tokens`` from block ``from_block`` on, up to the first miss (each hit is
        touched, restarting its TTL). A store fault is a miss; with the read breaker open nothing is
        hashed or called; the fetch stops at the first block past ``read_timeout_s`` since it began."""
        g = self.guard
        if not g.allows(READ):
            g.skip(READ)
            return []
        budget = g.config.read_timeout_s
        t0 = time.monotonic()
        out: list[np.ndarray] = []
        for k in self.keys(tokens)[from_block:]:
            if budget is not None and out and time.monotonic() - t0 > budget:
                break
            b = g.get(k)
            if b is None:
                break
            if len(b) != self.codec.nbytes:  # another engine's layout under the same key: a miss
                logger.warning(
                    "kvstore: block of %d bytes, this engine's are %d (miss)", len(b), self.codec.nbytes
                )
                break
            g.touch(k)  # best effort: a store that refuses writes still serves the hit
            out.append(np.frombuffer(b, np.uint8))
        self.fetched_blocks += len(out)
        return out

    def land(self, block_ids, payloads) -> bool:
        """Write fetched blocks into the pool rows ``block_ids`` (the swap-in). False if that failed: the
        rows belong to the sequence alone, so the caller recomputes them (a miss)."""
        try:
            self.codec.write(block_ids, payloads)
        except Exception as e:
            self.guard.note_error("swap_in", e)
            self.fetched_blocks -= len(payloads)
            return False
        return True

    def write_back(self, tokens: np.ndarray, table: np.ndarray, from_block: int, to_block: int) -> None:
        """Store blocks [from_block, to_block) of ``tokens`` (held in pool rows ``table``) unless present.
        With the write breaker open nothing is hashed, copied or called; a failed put ends this call (the
        blocks after it could not be hit without it)."""
        g = self.guard
        if to_block <= from_block:
            return
        if not g.allows(WRITE):
            g.skip(WRITE)
            return
        keys = self.keys(tokens[: to_block * self.block_size])
        todo = [i for i in range(from_block, to_block) if not g.exists(keys[i])]  # a failed lookup: write it
        if not todo:
            return
        for i, data in zip(todo, self.codec.read(np.asarray(table)[todo])):
            if not g.put(keys[i], data, traffic_class=self.traffic_class):
                break
            self.written_blocks += 1


def config_key(cfg) -> bytes:
    """The extra key of an engine's blocks: everything in an ``EngineConfig`` that changes the KV bytes of
    the same tokens (model and its weights, dtype, cache formats, backend, block size). A checkpoint
    directory is named by its resolved path: a store shared across weight updates in place needs a new
    directory (or a store per version)."""
    import os

    model = cfg.model if cfg.model in ("tiny", "tiny-random") else os.path.realpath(cfg.model)
    seed = cfg.seed if cfg.model == "tiny-random" else "-"
    return (
        f"deepinfer-kv|{model}|seed={seed}|{cfg.dtype}|quantize={cfg.quantize}|{cfg.backend}"
        f"|bs={cfg.block_size}"
    ).encode()
