"""The kv concrete classes satisfy their protocols (runtime isinstance) and the format protocol."""

from __future__ import annotations

from deepinfer_core import protocols as P
from deepinfer_core.kv import PagedKVPool, PrefixIndex, StatePool, formats


def test_concrete_classes_satisfy_protocols() -> None:
    pool = PagedKVPool(num_blocks=8, block_size=4)
    assert isinstance(pool, P.KVBlockPool)
    assert isinstance(StatePool(2), P.StatePool)
    assert isinstance(PrefixIndex(pool), P.PrefixIndex)
    for name in formats.FORMATS:
        assert isinstance(formats.get_format(name), formats.CacheFormat)


def test_protocol_rejects_non_pools() -> None:
    assert not isinstance(object(), P.KVBlockPool)
    assert not isinstance(StatePool(1), P.KVBlockPool)
