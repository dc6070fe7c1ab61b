"""The executor's Engram side: the token ring (each slot's recent tokens, the n-gram context across steps),
hashing a step's n-grams into row ids and fetching the rows from the tables of the chosen placement.

Functions of the executor's :class:`~deepinfer_core.model.state.ExecutorState`; the tables are
``EngramTable`` protocol objects placed by the ``engram`` component (:func:`make_engram_tables`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deepinfer_core.device_tokens import TokenFeed, h2d
from deepinfer_core.engram import place_tables, unchecked
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.model.state import ExecutorState, last_rows
from deepinfer_core.protocols.engram import EngramTable


def make_engram_tables(model: DeepSeekV41, placement: str, group: object | None) -> dict[int, EngramTable]:
    """The model's Engram tables in the chosen placement (same rows, same values; ``engram.place_tables``):
    "local" = one device, the model's (the default tables are built on the host from seeded draws, so a
    one-device table elsewhere is copied to the model's device once: every step's fetch is then a device
    gather, and the asynchronous overlap can fetch rows for ids hashed on the device)."""
    if not model.cfg.engram_layer_ids:
        if placement not in ("local", "host", "sharded"):
            raise ValueError(f"engram_placement={placement!r}: must be 'local', 'host' or 'sharded'")
        return {}
    return place_tables(model.engram_tables, placement, model.embed.device, group)


def hashed_row_tables(tables: dict[int, EngramTable]) -> dict[int, EngramTable]:
    """``tables`` for row ids from the hasher: one-device tables skip the id checks (``engram.unchecked``:
    the check would read the ids back, a device synchronisation every step); other kinds keep their fetch."""
    return {lid: unchecked(t) for lid, t in tables.items()}


def engram_fetch(st: ExecutorState, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer: rows [T, row_dim]} for hashed row ids [L, T, columns] from the state's tables (ids from the
    hasher are in range: one-device tables fetch them without the checks that synchronise)."""
    return st.model.engram_fetch(ids, hashed_row_tables(st.engram_tables))


def engram_rows(
    st: ExecutorState,
    b: ForwardBatch,
    tokens: torch.Tensor | None,
    feed: TokenFeed | None = None,
    pos: np.ndarray | None = None,
    row_slots: np.ndarray | None = None,
) -> dict[int, torch.Tensor]:
    """Fetch this step's Engram rows (n-grams continue each sequence from the slot's token ring), then
    record the step's tokens in the ring: :func:`engram_ids`, then the tables' fetch."""
    ids = engram_ids(st, b, tokens, feed, pos, row_slots)
    return {} if ids is None else engram_fetch(st, ids)


def engram_ids(
    st: ExecutorState,
    b: ForwardBatch,
    tokens: torch.Tensor | None,
    feed: TokenFeed | None = None,
    pos: np.ndarray | None = None,
    row_slots: np.ndarray | None = None,
) -> torch.Tensor | None:
    """Hash this step's Engram n-grams (continuing each sequence from the slot's token ring) into row ids
    [L, T, columns] (None without Engram layers), then record the step's tokens in the ring. Runs after
    validation, before any layer. The n-grams are hashed from the host's token ids (``tokens`` is not
    read back: no device synchronisation); with a ``feed`` some ids exist only on the device, so the
    step hashes ``tokens`` (the device ids, feed applied) there, and the ring gets those entries once the
    engine has them (:func:`resolve_fed`). ``pos`` / ``row_slots``: b.positions and each row's slot when
    the caller has them already."""
    resolve_fed(st)  # no-op when the engine resolved them (it does before each next step)
    n_ctx = st.cfg.engram_max_ngram - 1
    # each request's n_ctx tokens before its first row (-1 before the sequence start), from its ring
    back = b.start_pos.astype(np.int64)[:, None] - 1 - np.arange(n_ctx)[None, :]
    ctx = np.where(back >= 0, st.tokens[b.state_slots.astype(np.int64)[:, None], back % st.tok_ring], -1)
    ids = _hash(st, b, tokens, feed, ctx) if st.cfg.engram_layer_ids else None
    keep = last_rows(b, st.tok_ring)
    pos = b.positions if pos is None else pos
    row_slots = np.repeat(b.state_slots, b.query_lens).astype(np.int64) if row_slots is None else row_slots
    st.tokens[row_slots[keep], pos[keep] % st.tok_ring] = b.token_ids[keep]
    if feed is not None and feed.index.size:  # placeholders written above: the real ids when known
        k = keep[feed.index]
        fi = feed.index[k]
        st.fed.append((row_slots[fi], pos[fi] % st.tok_ring, TokenFeed(fi, feed.rows[k], feed.src)))
    if st.spec is not None:
        for i in np.flatnonzero(b.start_pos == 0):
            st.spec.restart(int(b.state_slots[i]))
    return ids


def _hash(
    st: ExecutorState, b: ForwardBatch, tokens: torch.Tensor | None, feed: TokenFeed | None, ctx: np.ndarray
) -> torch.Tensor:
    """The step's row ids: hashed in numpy from the host ids (the batch is validated: ids are in range), or
    on the device from ``tokens`` when a feed holds some of them there."""
    hasher = st.model.engram_hasher
    if feed is None:
        return torch.from_numpy(hasher.hash_host(b.token_ids, b.offsets, ctx))
    assert tokens is not None
    if bool((b.query_lens == 1).all()):  # a decode step: the context's part reduced on the host
        return hash_decode_on_device(hasher, tokens, ctx)
    # the batch was validated on the host: the hash's checks would read device tensors back
    dev = tokens.device
    return hasher.hash(tokens, h2d(b.offsets, dev, np.int64), h2d(ctx, dev, np.int64), validate=False)


def resolve_fed(st: ExecutorState, drop: bool = False) -> None:
    """Write device-fed tokens into the host token ring (waits for their step if the host copy is not
    done); ``drop``: forget them instead (the engine reset: every slot restarts)."""
    for slots, cols, f in [] if drop else st.fed:
        st.tokens[slots, cols] = f.src.host()[f.rows]
    st.fed.clear()


def hash_decode_on_device(hasher: Any, tokens: torch.Tensor, context: np.ndarray) -> torch.Tensor:
    """``EngramHasher.hash`` of a batch of one-token rows (a decode step) whose tokens are on the device,
    without a host synchronisation: row i's n-gram of order k + 1 is (token i, context[i, :k]), the context
    known on the host. Its part of each order's XOR (the wrapping products of the context's canonical ids
    and their multipliers) is reduced in numpy, so the device runs ~8 small kernels (token map, product,
    XOR, modulus, offset) instead of ~40 for the general n-gram build (``hash(..., validate=False)``): the
    fewer launches, the less host time a step costs next to the step in flight. Int32 [L, T, orders * heads],
    the same row ids as ``hash_host`` (tested)."""
    lut, mult = hasher.token_map.lookup, hasher.multipliers  # [V], [L, N] int64
    ctx = np.asarray(context, np.int64)
    c = np.where(ctx < 0, hasher.pad_canonical, lut[np.maximum(ctx, 0)])  # [T, N-1] canonical
    known = np.bitwise_xor.accumulate(
        c[None, :, :] * mult[:, None, 1:], axis=2
    )  # [L, T, N-1], wraps like the op
    dev = tokens.device
    m0, primes, offsets = hasher.decode_params(dev)  # cached: [L, 1], [L, 1, N-1, H], [L, 1, (N-1)*H] int64
    canon = hasher.token_map(tokens, validate=False)  # [T]
    h = torch.bitwise_xor((canon[None, :] * m0).unsqueeze(-1), h2d(known, dev, np.int64))  # [L, T, N-1]
    cols = torch.remainder(h.unsqueeze(-1), primes)  # [L, T, N-1, H]
    return (cols.flatten(2) + offsets).to(torch.int32)
