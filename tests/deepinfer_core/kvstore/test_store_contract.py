"""The KVBlockStore contract, checked the same way on the in-memory, file and Redis backends.

Oracle: a plain dict model of (class, payload, expiry) driven by the same random operations; the
clock is moved by hand so expiry is checked at its exact instant.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.kvstore import FileKVStore, InMemoryKVStore, RedisKVStore, TTLPolicy
from deepinfer_core.protocols.kvstore import KVBlockStore

from .conftest import FakeClock, make_store

MS = 1_000_000
TTL = TTLPolicy({"agent": 0.005, "chatbot": 0.012})  # 5 ms / 12 ms: whole ms, so Redis is exact too

op = st.one_of(
    st.tuples(
        st.just("put"),
        st.integers(0, 3),
        st.binary(min_size=0, max_size=300),
        st.sampled_from(["agent", "chatbot"]),
    ),
    st.tuples(st.just("get"), st.integers(0, 3)),
    st.tuples(st.just("exists"), st.integers(0, 3)),
    st.tuples(st.just("touch"), st.integers(0, 3), st.sampled_from([None, "agent", "chatbot"])),
    st.tuples(st.just("delete"), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.integers(0, 8)),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    keys=st.lists(st.binary(min_size=16, max_size=32), min_size=4, max_size=4, unique=True),
)
def test_random_ops_match_model(backend, request, ops, keys):
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as d:
        store = make_store(backend, clock, TTL, request, d)
        model: dict[bytes, tuple[str, bytes, int]] = {}

        def live(k):
            ent = model.get(k)
            if ent is not None and clock() >= ent[2]:
                del model[k]
                ent = None
            return ent

        for o in ops:
            kind = o[0]
            if kind == "advance":
                clock.advance(o[1] * MS)
                continue
            k = keys[o[1]]
            if kind == "put":
                store.put(k, o[2], traffic_class=o[3])
                model[k] = (o[3], o[2], clock() + TTL.ttl_ns(o[3]))
            elif kind == "get":
                ent = live(k)
                assert store.get(k) == (None if ent is None else ent[1])
            elif kind == "exists":
                assert store.exists(k) == (live(k) is not None)
            elif kind == "touch":
                ent = live(k)
                assert store.touch(k, traffic_class=o[2]) == (ent is not None)
                if ent is not None:  # the block keeps its put class; the touch's class sets this TTL only
                    model[k] = (ent[0], ent[1], clock() + TTL.ttl_ns(ent[0] if o[2] is None else o[2]))
            elif kind == "delete":
                had = k in model  # an expired, not yet removed block may still be deleted: accept either
                got = store.delete(k)
                if had and live(k) is not None:
                    assert got
                model.pop(k, None)
        for k in keys:  # final state: everything the model holds is whole in the store
            ent = live(k)
            assert store.get(k) == (None if ent is None else ent[1])


def test_expiry_is_exact(backend, request):
    clock = FakeClock()
    unit = MS if backend == "redis" else 1  # Redis keeps ms, the others ns
    ttl = TTLPolicy({"agent": 0.003, "chatbot": 0.007})
    store = make_store(backend, clock, ttl, request)
    k1, k2 = os.urandom(16), os.urandom(16)
    store.put(k1, b"agent-block", traffic_class="agent")
    store.put(k2, b"chat-block", traffic_class="chatbot")
    clock.advance(3 * MS - unit)
    assert store.get(k1) == b"agent-block"
    clock.advance(unit)
    assert store.get(k1) is None and not store.exists(k1) and not store.touch(k1)
    assert store.get(k2) == b"chat-block"
    assert store.touch(k2)  # restarts the 7 ms
    clock.advance(7 * MS - unit)
    assert store.get(k2) == b"chat-block"
    clock.advance(unit)
    assert store.get(k2) is None


def test_default_ttls_are_the_qa_ones():
    p = TTLPolicy()
    assert p.ttl_ns("agent") == 3 * 86400 * 10**9
    assert p.ttl_ns("chatbot") == 7 * 86400 * 10**9


def test_satisfies_protocol(backend, request):
    assert isinstance(make_store(backend, FakeClock(), TTL, request), KVBlockStore)


def test_numpy_and_memoryview_payloads(backend, request):
    import numpy as np

    store = make_store(backend, FakeClock(), TTL, request)
    arr = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    k = os.urandom(16)
    store.put(k, arr)
    assert np.array_equal(np.frombuffer(store.get(k), np.float32).reshape(3, 5), arr)
    store.put(k, memoryview(b"xyz"))
    assert store.get(k) == b"xyz"


def test_bad_input_names_the_field(tmp_path):
    store = InMemoryKVStore(TTL)
    with pytest.raises(ValueError, match=r"key: must be 16\.\.64 bytes"):
        store.put(b"short", b"x")
    with pytest.raises(TypeError, match="key: must be bytes"):
        store.get("a string key" * 2)
    with pytest.raises(ValueError, match=r"traffic_class='batch': must be one of \['agent', 'chatbot'\]"):
        store.put(os.urandom(16), b"x", traffic_class="batch")
    with pytest.raises(TypeError, match="data: must be bytes"):
        store.put(os.urandom(16), [1, 2, 3])
    with pytest.raises(ValueError, match=r"TTLPolicy.ttls_s\['agent'\]=0"):
        TTLPolicy({"agent": 0})
    with pytest.raises(ValueError, match="capacity_bytes"):
        InMemoryKVStore(capacity_bytes=0)
    with pytest.raises(ValueError, match="exactly one of client= or url="):
        RedisKVStore()
    f = FileKVStore(tmp_path, TTL)
    with pytest.raises(ValueError, match="traffic_class="):
        f.touch(os.urandom(16), traffic_class="nope")


@settings(max_examples=30)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    cap=st.integers(50, 200),
    reads=st.lists(st.integers(0, 29), max_size=30),
)
def test_memory_capacity_is_lru(sizes, cap, reads):
    """Oracle: a list in recency order, oldest evicted first until the bytes fit."""
    clock = FakeClock()
    store = InMemoryKVStore(TTLPolicy({"chatbot": 1000.0}), capacity_bytes=cap, clock=clock)
    keys = [i.to_bytes(16, "little") for i in range(len(sizes))]
    order: list[int] = []
    for i, n in enumerate(sizes):
        store.put(keys[i], bytes([i]) * n)
        order.append(i)
        while sum(sizes[j] for j in order) > cap:
            order.pop(0)
        r = reads[i] if i < len(reads) else None
        if r is not None and r <= i:
            hit = store.get(keys[r])
            assert (hit is not None) == (r in order)
            if hit is not None:
                assert hit == bytes([r]) * sizes[r]
                order.remove(r)
                order.append(r)
    assert store.used_bytes == sum(sizes[j] for j in order) <= cap
    assert {k for k in keys if store.exists(k)} == {keys[j] for j in order}


def test_touch_with_a_class_does_not_reclass_the_block(backend, request):
    """Found by the model test (its saved example): put as agent, touch as chatbot, touch without a class
    -> the agent TTL again on every backend (the in-memory store used to keep the chatbot class)."""
    clock = FakeClock()
    store = make_store(backend, clock, TTL, request)
    k = os.urandom(16)
    store.put(k, b"", traffic_class="agent")
    assert store.touch(k, traffic_class="chatbot")
    clock.advance(10 * MS)  # inside chatbot's 12 ms, past agent's 5
    assert store.get(k) == b""
    assert store.touch(k)  # its own class: agent, 5 ms from now
    clock.advance(5 * MS)
    assert store.get(k) is None and not store.exists(k)
