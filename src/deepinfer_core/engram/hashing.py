"""N-gram hashing into prime-sized tables, matching DeepSeek's public Engram scheme.

Per layer ``l`` (public reference, facts only): multipliers are odd int64 values ``2 r + 1`` with ``r``
drawn by ``numpy.random.default_rng(seed + 10007 * l).integers(0, half_bound, size=max_ngram)``, where
``half_bound = max(1, (2**63 - 1) // num_canonical // 2)``, so ``token * multiplier`` never overflows for
canonical ids. Table sizes are primes searched upward from each order's base size, every (layer, order,
head) taking the next prime not used before (layers in ``layer_ids`` order, then orders, then heads).
Each layer's sub-tables are concatenated in (order, head) order; offsets are the exclusive prefix sums.

The hash of the n-gram ending at token t is the running XOR of ``token[t - k] * m_k`` over k = 0..n-1,
with ``pad_id`` (canonicalised) standing in for positions before the sequence's first token; row =
``hash mod prime + offset``. The arithmetic itself is the ``engram_hash`` device op
(:mod:`deepinfer_kernels.ops.engram`), so the GPU kernel and this reference share one definition.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deepinfer_core.engram.canonical import CanonicalTokenMap
from deepinfer_core.engram.config import EngramConfig
from deepinfer_kernels import get_op

log = logging.getLogger(__name__)

LAYER_SEED_STRIDE = 10007  # the public reference's per-layer seed step
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for every n < 3.3e24 (far above any table size)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, taken: set[int]) -> int:
    """Smallest prime >= ``start`` not in ``taken``."""
    c = max(start, 2)
    while c in taken or not is_prime(c):
        c += 1
    return c


def derive_multipliers(
    layer_ids: tuple[int, ...], max_ngram: int, num_canonical: int, seed: int
) -> np.ndarray:
    """Odd int64 multipliers [L, max_ngram], one row per layer (public scheme, see module docstring)."""
    half_bound = max(1, (np.iinfo(np.int64).max // num_canonical) // 2)
    out = np.empty((len(layer_ids), max_ngram), dtype=np.int64)
    for i, layer in enumerate(layer_ids):
        rng = np.random.default_rng(seed + LAYER_SEED_STRIDE * int(layer))
        out[i] = rng.integers(0, half_bound, size=max_ngram, dtype=np.int64) * 2 + 1
    return out


def derive_primes(config: EngramConfig) -> np.ndarray:
    """Prime table sizes [L, orders, heads], distinct across all layers, orders and heads."""
    taken: set[int] = set()
    out = np.empty((len(config.layer_ids), config.num_orders, config.heads_per_order), dtype=np.int64)
    for li in range(len(config.layer_ids)):
        for oi, order in enumerate(range(2, config.max_ngram + 1)):
            start = config.base_size(order)
            for h in range(config.heads_per_order):
                p = next_prime(start, taken)
                taken.add(p)
                out[li, oi, h] = p
                start = p + 1
    return out


class EngramHasher:
    """Row ids of every token's n-grams for every Engram layer (see module docstring).

    ``hash(token_ids, cu_seqlens=None, context=None)`` takes raw token ids, either 1-D [T] (a packed
    batch: ``cu_seqlens`` [S+1] marks where each sequence starts; none means one sequence) or 2-D [B, T]
    (B sequences of T tokens), and returns int32 [L, T, orders*heads] (or [L, B, T, orders*heads]).
    ``context`` [S, max_ngram-1] holds, per sequence, the raw tokens just before its first token in this
    batch (column j = j+1 tokens back; -1 = before the sequence start, hashed as pad): this is how a
    chunked-prefill chunk or a decode step continues a sequence.
    """

    def __init__(self, config: EngramConfig, token_map: CanonicalTokenMap | None = None) -> None:
        tm = token_map if token_map is not None else CanonicalTokenMap.identity(config.vocab_size)
        if tm.vocab_size != config.vocab_size:
            raise ValueError(
                f"token_map: covers {tm.vocab_size} ids, config.vocab_size is {config.vocab_size}"
            )
        self.config = config
        self.token_map = tm
        self.pad_canonical = int(tm.lookup[config.pad_id])
        self.multipliers = derive_multipliers(
            config.layer_ids, config.max_ngram, tm.num_canonical, config.seed
        )
        self.primes = derive_primes(config)
        flat = self.primes.reshape(len(config.layer_ids), -1)
        self.offsets = np.concatenate(
            [np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1
        )
        self.layer_rows = flat.sum(axis=1)
        if int(self.layer_rows.max()) >= 2**31:
            raise ValueError(
                f"table_sizes={config.table_sizes}: a layer's table has {int(self.layer_rows.max())} rows; "
                "int32 row ids allow < 2**31 per layer"
            )
        self._dev_cache: dict[
            tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        self._decode_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        log.debug("EngramHasher: layers %s, rows per layer %s", config.layer_ids, self.layer_rows.tolist())

    def layer_index(self, layer_id: int) -> int:
        """Position of model layer ``layer_id`` in the hash output's first axis."""
        try:
            return self.config.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer_id={layer_id}: not an Engram layer; layers are {self.config.layer_ids}"
            ) from None

    def num_rows(self, layer_id: int) -> int:
        """Rows of layer ``layer_id``'s concatenated table."""
        return int(self.layer_rows[self.layer_index(layer_id)])

    def device_params(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.int32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(multipliers int64 [L, N], primes [L, N-1, H], offsets [L, (N-1)*H]) on ``device``, cached per
        (device, dtype): primes and offsets in ``dtype``, int32 as tile_kernels' engram_hash takes them, or
        int64, the dtype the reference op computes in (its casts are then no-ops: no cast kernels per hash,
        which the per-step device hashes of the executor would otherwise launch every step)."""
        key = (torch.device(device), dtype)
        p = self._dev_cache.get(key)
        if p is None:
            dev = key[0]
            p = (
                torch.from_numpy(self.multipliers).to(dev),
                torch.from_numpy(self.primes).to(dev, dtype),  # every row id < 2**31 (checked in __init__)
                torch.from_numpy(self.offsets).to(dev, dtype),
            )
            self._dev_cache[key] = p
        return p

    def decode_params(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`device_params` in int64, laid out to broadcast over a decode step's tokens: (the first
        multiplier of each layer [L, 1], primes [L, 1, N-1, H], offsets [L, 1, (N-1)*H]), cached per device
        (the executor's decode hash takes them every step: no cast kernel, no per-step views)."""
        dev = torch.device(device)
        p = self._decode_cache.get(dev)
        if p is None:
            m, primes, offsets = self.device_params(dev, torch.int64)
            p = self._decode_cache[dev] = (m[:, :1], primes.unsqueeze(1), offsets.unsqueeze(1))
        return p

    def ngram_token_ids(
        self,
        token_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        validate: bool = True,
    ) -> torch.Tensor:
        """Canonical ids int64 [T, max_ngram]: column k = the token k back in the same sequence, else the
        matching ``context`` token, else the pad id. The input layout of the ``engram_hash`` op.
        ``validate=False`` skips the value checks that sync a GPU (ids, cu_seqlens, context ranges; shapes
        are still checked): for a trusted caller inside a step, or under CUDA-graph capture."""
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids: must be 1-D here, got shape {tuple(token_ids.shape)}")
        n = self.config.max_ngram
        dev = token_ids.device
        t = token_ids.shape[0]
        canon = self.token_map(token_ids, validate)
        if cu_seqlens is None:
            # [0, t] made on the device: torch.tensor(..., device=cuda) would be a blocking (syncing) copy
            cu = torch.arange(2, dtype=torch.int64, device=dev) * t
        else:
            cu = (_check_cu_seqlens(cu_seqlens, t) if validate else _shape_cu_seqlens(cu_seqlens)).to(dev)
        num_seqs = cu.shape[0] - 1
        idx = torch.arange(t, device=dev)
        seg = torch.searchsorted(cu[1:], idx, right=True).clamp_max(max(num_seqs - 1, 0))
        dist = idx - cu[seg]  # tokens of the same sequence before this one, in this batch
        if context is not None:
            if tuple(context.shape) != (num_seqs, n - 1):
                raise ValueError(
                    f"context: shape {tuple(context.shape)}, expected [num_seqs={num_seqs}, max_ngram-1={n - 1}]"
                )
            ctx = context.to(dev, torch.int64)
            if validate and ctx.numel() and int(ctx.min()) < -1:
                raise ValueError(
                    f"context: id {int(ctx.min())} is invalid; use -1 for 'before the sequence start'"
                )
            none = ctx < 0
            ctx = torch.where(none, self.pad_canonical, self.token_map(ctx.clamp_min(0), validate))
        out = torch.empty((t, n), dtype=torch.int64, device=dev)
        out[:, 0] = canon
        for k in range(1, n):
            inside = dist >= k
            fallback = (
                torch.full_like(canon, self.pad_canonical)
                if context is None
                else ctx[seg, (k - 1 - dist).clamp(0, n - 2)]
            )
            out[:, k] = torch.where(inside, canon[(idx - k).clamp_min(0)], fallback)
        return out

    def hash_host(self, token_ids: np.ndarray, cu_seqlens: np.ndarray, context: np.ndarray) -> np.ndarray:
        """:meth:`hash` of host arrays (1-D packed ``token_ids``, ``cu_seqlens``, ``context``) from a caller
        that checked them (``validate=False`` semantics), computed in numpy: the same row ids, without
        the chain of small torch ops (the executor's per-step host path, where those cost ~0.3 ms)."""
        n = self.config.max_ngram
        lut = self.token_map.lookup
        canon = lut[np.asarray(token_ids, np.int64)]
        t = canon.shape[0]
        cu = np.asarray(cu_seqlens, np.int64)
        num_seqs = cu.shape[0] - 1
        ctx = np.asarray(context, np.int64)
        if ctx.shape != (num_seqs, n - 1):
            raise ValueError(
                f"context: shape {ctx.shape}, expected [num_seqs={num_seqs}, max_ngram-1={n - 1}]"
            )
        idx = np.arange(t)
        seg = np.minimum(np.searchsorted(cu[1:], idx, side="right"), max(num_seqs - 1, 0))
        dist = idx - cu[seg]  # tokens of the same sequence before this one, in this batch
        ctx = np.where(ctx < 0, self.pad_canonical, lut[np.maximum(ctx, 0)])
        grams = np.empty((t, n), np.int64)
        grams[:, 0] = canon
        for k in range(1, n):
            grams[:, k] = np.where(
                dist >= k, canon[np.maximum(idx - k, 0)], ctx[seg, np.clip(k - 1 - dist, 0, n - 2)]
            )
        # the reference op's maths: int64 products wrap (numpy arrays wrap silently, as torch does)
        prod = grams[None, :, :] * self.multipliers[:, None, :]  # [L, T, N]
        h, cols = prod[:, :, 0], []
        for k in range(1, n):
            h = h ^ prod[:, :, k]
            cols.append(
                np.mod(h[:, :, None], self.primes[:, None, k - 1, :])
            )  # floor mod, like torch.remainder
        return (np.concatenate(cols, axis=-1) + self.offsets[:, None, :]).astype(np.int32)

    def hash(
        self,
        token_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        backend: str = "reference",
        validate: bool = True,
    ) -> torch.Tensor:
        """Row ids int32 [L, T, orders*heads] (or [L, B, T, orders*heads] for 2-D input); see class doc.
        ``validate=False``: see :meth:`ngram_token_ids`; the op's table-size check (``check=False``) is
        skipped too (the sizes are this hasher's primes), so on device tensors the hash reads nothing
        back: no host synchronisation."""
        if token_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: not used with 2-D token_ids (each row is one sequence)")
            b, t = token_ids.shape
            cu = torch.arange(b + 1, dtype=torch.int64, device=token_ids.device) * t
            flat = self.hash(token_ids.reshape(-1), cu, context, backend, validate)
            return flat.reshape(flat.shape[0], b, t, flat.shape[-1])
        grams = self.ngram_token_ids(token_ids, cu_seqlens, context, validate)
        # the reference op computes in int64; tile_kernels (the cuda op's first choice) takes int32
        mult, primes, offsets = self.device_params(
            grams.device, torch.int64 if backend == "reference" else torch.int32
        )
        return get_op("engram_hash", backend)(grams, mult, primes, offsets, check=validate)


def _shape_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens: must be a 1-D int tensor [num_seqs+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens.to(torch.int64)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    cu = _shape_cu_seqlens(cu_seqlens)
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens: must start at 0 and end at num_tokens={num_tokens}, got {int(cu[0])}..{int(cu[-1])}"
        )
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing")
    return cu
