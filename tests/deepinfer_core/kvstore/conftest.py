"""Fixtures: a real redis-server on a free port in a temp dir, a settable clock, a store per backend."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

from deepinfer_core.kvstore import FileKVStore, InMemoryKVStore, RedisKVStore, TTLPolicy

BACKENDS = ("memory", "file", "redis")


class FakeClock:
    """A clock the test moves by hand (ns). Starts one hour ahead of real time so a Redis server, which
    expires by its own wall clock, never drops a block before this clock says so."""

    def __init__(self) -> None:
        self.now = (time.time_ns() // 1_000_000 + 3_600_000) * 1_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += int(ns)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing on CI: .ci/run must install it (apt-get install -y redis-server)")
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; .ci/run installs it)")
    import redis

    d = tempfile.mkdtemp(prefix="dkv-redis-")
    for _attempt in range(3):  # the free port may be taken between the probe and the server's bind
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", "", "--appendonly", "no",
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        up = False
        for _ in range(200):
            if proc.poll() is not None:
                break
            try:
                up = bool(client.ping())
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        if up:
            break
        proc.kill()
        proc.wait()
    else:
        pytest.fail("redis-server did not start and answer PING (3 attempts, 5 s each)")
    client.close()
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(d, ignore_errors=True)


def make_store(backend: str, clock, ttl: TTLPolicy, request, tmpdir: str | None = None):
    """A fresh, empty store of ``backend`` (Redis: its own namespace on the shared server)."""
    if backend == "memory":
        return InMemoryKVStore(ttl, clock=clock)
    if backend == "file":
        return FileKVStore(tmpdir or tempfile.mkdtemp(prefix="dkv-file-"), ttl, fsync=False, clock=clock)
    url = request.getfixturevalue("redis_url")
    return RedisKVStore(url=url, ttl=ttl, clock=clock, namespace=b"t" + uuid.uuid4().bytes + b":")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param
