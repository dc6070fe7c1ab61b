"""Crash safety and concurrent writers, on a real directory and a real Redis server.

Writers are real: threads, and separate Python processes (one SIGKILLed in the middle of a block).
Every read must be a miss or one of the written blocks, whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.kvstore import FileKVStore, RedisKVStore, TTLPolicy

from .conftest import FakeClock, make_store

TTL = TTLPolicy({"agent": 3600.0, "chatbot": 3600.0})


def _payloads(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("backend", ["memory", "file", "redis"])
def test_threads_writing_one_key(backend, request, tmp_path):
    store = make_store(backend, FakeClock(), TTL, request, str(tmp_path))
    key = os.urandom(16)
    blocks = _payloads(6, 200_000, 1)
    allowed = set(blocks)
    bad: list[str] = []
    stop = threading.Event()

    def writer(i):
        for _ in range(15):
            store.put(key, blocks[i])

    def reader():
        while not stop.is_set():
            got = store.get(key)
            if got is not None and got not in allowed:
                bad.append(f"torn read of {len(got)} bytes")

    rs = [threading.Thread(target=reader) for _ in range(2)]
    ws = [threading.Thread(target=writer, args=(i,)) for i in range(len(blocks))]
    for t in rs + ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    for t in rs:
        t.join()
    assert not bad
    assert store.get(key) in allowed


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from deepinfer_core.kvstore import FileKVStore, RedisKVStore, TTLPolicy
    kind, where, seed, key_hex = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ttl = TTLPolicy({"agent": 3600.0, "chatbot": 3600.0})
    store = FileKVStore(where, ttl, fsync=False) if kind == "file" else RedisKVStore(url=where, ttl=ttl, namespace=sys.argv[5].encode())
    data = np.random.default_rng(seed).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    for _ in range(20):
        store.put(bytes.fromhex(key_hex), data)
""")


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_processes_writing_one_key(backend, request, tmp_path):
    key = os.urandom(16)
    ns = "p" + os.urandom(4).hex() + ":"
    where = str(tmp_path) if backend == "file" else request.getfixturevalue("redis_url")
    ttl = TTLPolicy({"agent": 3600.0, "chatbot": 3600.0})
    store = (
        FileKVStore(where, ttl, fsync=False)
        if backend == "file"
        else RedisKVStore(url=where, ttl=ttl, namespace=ns.encode())
    )
    seeds = [11, 12, 13, 14]
    allowed = {np.random.default_rng(s).integers(0, 256, 300_000, dtype=np.uint8).tobytes() for s in seeds}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, backend, where, str(s), key.hex(), ns])
        for s in seeds
    ]
    reads = torn = 0
    while any(p.poll() is None for p in procs):
        got = store.get(key)
        if got is not None:
            reads += 1
            torn += got not in allowed
    assert all(p.wait(60) == 0 for p in procs)
    assert torn == 0
    assert store.get(key) in allowed
    if backend == "file":  # no temp file left behind by writers that finished
        assert [f.name for f in tmp_path.rglob(".tmp.*")] == []


_CRASHER = textwrap.dedent("""
    import os, signal, sys
    from deepinfer_core.kvstore import FileKVStore, TTLPolicy
    store = FileKVStore(sys.argv[1], TTLPolicy({"chatbot": 3600.0}), fsync=False)
    n = [0]
    def die():
        n[0] += 1
        if n[0] == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
    store.put(bytes.fromhex(sys.argv[2]), os.urandom(9 << 20), _after_chunk=die)
""")


@pytest.mark.parametrize("old", [False, True])
def test_writer_killed_mid_block_leaves_old_or_miss(tmp_path, old):
    store = FileKVStore(tmp_path, TTLPolicy({"chatbot": 3600.0}), fsync=False)
    key = os.urandom(16)
    if old:
        store.put(key, b"the old block")
    # chunks are 4 MiB: die after the header and after the first 4 MiB of a 9 MiB payload
    for n in (1, 2):
        p = subprocess.run([sys.executable, "-c", _CRASHER, str(tmp_path), key.hex(), str(n)])
        assert p.returncode == -signal.SIGKILL
        assert store.get(key) == (b"the old block" if old else None)
    tmps = list(tmp_path.rglob(".tmp.*"))
    assert len(tmps) == 2 and all(t.stat().st_size > 0 for t in tmps)  # the torn writes exist, unseen
    assert store.sweep(tmp_grace_s=3600) == (0, 0)  # young temp files may be live writers: kept
    assert store.sweep(tmp_grace_s=0) == (0, 2)
    assert store.get(key) == (b"the old block" if old else None)


@settings(max_examples=40)
@given(
    data=st.binary(min_size=1, max_size=2000),
    cut=st.floats(0, 1, exclude_max=True),
    flip=st.integers(0, 10**6),
    mode=st.sampled_from(["truncate", "flip", "append", "other_key"]),
)
def test_damaged_file_is_a_miss(data, cut, flip, mode):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = FileKVStore(d, TTL, fsync=False)
        key, other = os.urandom(16), os.urandom(16)
        store.put(key, data)
        path = store.path(key)
        raw = bytearray(path.read_bytes())
        mt = path.stat().st_mtime_ns
        if mode == "truncate":
            raw = raw[: int(cut * len(raw))]
        elif mode == "flip":
            raw[flip % len(raw)] ^= 1 << (flip % 8)
        elif mode == "append":
            raw += b"\0"
        if mode == "other_key":  # a whole, valid record, but filed under another key's name
            path.parent.mkdir(exist_ok=True)
            dst = store.path(other)
            dst.parent.mkdir(exist_ok=True)
            os.rename(path, dst)
            key = other
        else:
            path.write_bytes(bytes(raw))
            os.utime(path, ns=(mt, mt))
        assert store.get(key) is None
        assert not store.exists(key) and not store.touch(key)


def test_damaged_redis_value_is_a_miss(redis_url):
    store = RedisKVStore(url=redis_url, ttl=TTL, namespace=b"dmg" + os.urandom(4) + b":")
    rng = np.random.default_rng(3)
    for i in range(30):
        key = os.urandom(16)
        data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
        store.put(key, data)
        raw = store.client.get(store._k(key))
        if i % 3 == 0:
            store.client.setrange(store._k(key), int(rng.integers(0, len(raw))), bytes([raw[0] ^ 0x5A]))
        elif i % 3 == 1:
            store.client.set(store._k(key), raw[: int(rng.integers(0, len(raw)))])
        else:
            store.client.append(store._k(key), b"x")
        assert store.get(key) is None and not store.exists(key)
    assert store.stats.corrupt >= 30


crash_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.binary(min_size=0, max_size=400)),
    st.tuples(st.just("crash"), st.integers(0, 2), st.binary(min_size=1, max_size=400), st.integers(1, 12)),
    st.tuples(st.just("get"), st.integers(0, 2)),
    st.tuples(st.just("sweep"), st.just(0)),
)


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(crash_op, min_size=1, max_size=12))
def test_random_ops_with_writers_killed_mid_write(ops):
    """Random puts, some by a forked writer that dies (os._exit) after its k-th write call: every read
    is the last completed put of that key or a miss, never a torn block; sweeping keeps completed ones."""
    import tempfile

    keys = [bytes([i]) * 16 for i in range(3)]
    with tempfile.TemporaryDirectory() as d:
        store = FileKVStore(d, TTL, fsync=False)
        store.chunk_bytes = 64  # several write calls per record, so a writer can die between any two
        model: dict[bytes, bytes] = {}
        for o in ops:
            k = keys[o[1]]
            if o[0] == "put":
                store.put(k, o[2])
                model[k] = o[2]
            elif o[0] == "crash":
                pid = os.fork()
                if pid == 0:  # the child writes until its k-th write call, then dies without cleanup
                    calls = [0]

                    def die(calls=calls, at=o[3]):
                        calls[0] += 1
                        if calls[0] >= at:
                            os._exit(9)

                    try:
                        store.put(k, o[2], _after_chunk=die)
                    finally:
                        os._exit(0)  # finished before its death point: a complete put
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) == 0:
                    model[k] = o[2]
            elif o[0] == "get":
                assert store.get(k) == model.get(k)
            else:
                store.sweep(tmp_grace_s=0)
        for k in keys:
            assert store.get(k) == model.get(k)
        store.sweep(tmp_grace_s=0)
        assert not list(Path(d).rglob(".tmp.*"))
        for k in keys:
            assert store.get(k) == model.get(k)


def test_redis_client_dying_mid_set_stores_nothing(redis_url):
    """A SET whose bytes stop half way (the client died) is never applied: the server parses the whole
    command first. Sent by hand over a raw socket."""
    import socket
    from urllib.parse import urlparse

    store = RedisKVStore(url=redis_url, ttl=TTL, namespace=b"cut" + os.urandom(4) + b":")
    key = os.urandom(16)
    store.put(key, b"old whole block")
    value = b"x" * 100_000
    rk = store._k(key)
    cmd = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(rk), rk, len(value), value)
    u = urlparse(redis_url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(cmd[: len(cmd) // 2])
    assert store.get(key) == b"old whole block"
