"""Engram hashing configuration, validated once at construction."""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive int")


def _tuple_of_ints(value: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@attrs.frozen(slots=True)
class EngramConfig:
    """What the hash needs: which layers, which n-gram orders, how many heads, how big each table is.

    Fields mirror DeepSeek's public Engram reference (``engram_vocab_size``, ``max_ngram_size``,
    ``n_head_per_ngram``, ``layer_ids``, ``pad_id``, ``seed``):

    - ``layer_ids``: model layers that carry an Engram module; each gets its own multipliers and table.
    - ``max_ngram``: highest n-gram order; orders 2..max_ngram are hashed (the unigram only seeds the XOR).
    - ``heads_per_order``: hash heads per order; each (order, head) is one prime-sized sub-table.
    - ``table_sizes``: base size per order (one int applies to every order); primes are searched
      upward from it, distinct across all layers and heads.
    - ``vocab_size``: size of the raw token vocabulary (ids accepted by the hash).
    - ``pad_id``: raw token id hashed in place of tokens before a sequence's first token.
    - ``seed``: base seed; layer ``l`` draws its multipliers from ``seed + 10007 * l`` (public scheme).
    - ``head_dim``: values per table row (the protocol's ``row_dim``).
    """

    layer_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    max_ngram: int
    heads_per_order: int
    table_sizes: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    vocab_size: int
    pad_id: int = 2
    seed: int = 0
    head_dim: int = 256

    def __attrs_post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("layer_ids=(): at least one Engram layer is needed")
        if len(set(self.layer_ids)) != len(self.layer_ids) or min(self.layer_ids) < 0:
            raise ValueError(f"layer_ids={self.layer_ids}: must be distinct non-negative ints")
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or self.max_ngram < 2:
            raise ValueError(f"max_ngram={self.max_ngram!r}: must be an int >= 2 (orders 2..max_ngram)")
        _positive("heads_per_order", self.heads_per_order)
        _positive("vocab_size", self.vocab_size)
        _positive("head_dim", self.head_dim)
        n_orders = self.max_ngram - 1
        if len(self.table_sizes) not in (1, n_orders):
            raise ValueError(
                f"table_sizes={self.table_sizes}: give one base size or one per order ({n_orders} for orders 2..{self.max_ngram})"
            )
        for s in self.table_sizes:
            # The device kernels index rows with int32 (tile_kernels' engram_hash), so every prime and every
            # layer's concatenated table must stay below 2**31.
            if s < 2 or s >= 2**31:
                raise ValueError(f"table_sizes={self.table_sizes}: each base size must be in [2, 2**31)")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id={self.pad_id}: must be a token id in [0, vocab_size={self.vocab_size})")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: must be >= 0")

    @property
    def num_orders(self) -> int:
        """Number of hashed orders (2..max_ngram)."""
        return self.max_ngram - 1

    @property
    def num_columns(self) -> int:
        """Row ids per token and layer: orders x heads."""
        return self.num_orders * self.heads_per_order

    def base_size(self, order: int) -> int:
        """Base table size of n-gram ``order`` (2..max_ngram)."""
        if not 2 <= order <= self.max_ngram:
            raise ValueError(f"order={order}: must be in [2, {self.max_ngram}]")
        return self.table_sizes[0] if len(self.table_sizes) == 1 else self.table_sizes[order - 2]

    @classmethod
    def v41_flash(cls) -> EngramConfig:
        """DeepSeek-V4.1-Flash's shape as far as public sources show it: layers 1 and 14, orders 2..4,
        8 heads, head_dim 256, vocab 129,280, pad 2. The per-order base size is not published; 16,000,000
        gives 24 sub-tables of ~16M rows, i.e. the reported ~384M rows per layer (an assumption)."""
        return cls(
            layer_ids=(1, 14),
            max_ngram=4,
            heads_per_order=8,
            table_sizes=16_000_000,
            vocab_size=129_280,
            pad_id=2,
            seed=0,
            head_dim=256,
        )

    @classmethod
    def tiny(cls) -> EngramConfig:
        """The tiny test model's Engram: layers 1 and 3, orders 2-3, 2 heads, small primes, vocab 512."""
        return cls(
            layer_ids=(1, 3),
            max_ngram=3,
            heads_per_order=2,
            table_sizes=(1009, 2003),
            vocab_size=512,
            pad_id=2,
            seed=0,
            head_dim=64,
        )
