"""Fixtures: a real redis-server on a free port in a temp dir, a settable clock, a store per backend."""

from __future__ import annotations

import os
import shutil
import signal
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


class RedisServer:
    """A redis-server of its own on 127.0.0.1 (a free port, a temp dir, no persistence), stopped by its pid.
    ``kill`` / ``stop`` (SIGSTOP) / ``cont`` / ``restart`` (same port) let a test take it down and back."""

    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            if os.environ.get("CI"):
                pytest.fail(
                    "redis-server is missing on CI: .ci/run must install it (apt-get install -y redis-server)"
                )
            pytest.skip(
                "redis-server binary not found (apt-get install -y redis-server; .ci/run installs it)"
            )
        self.dir = tempfile.mkdtemp(prefix="dkv-redis-")
        self.proc: subprocess.Popen | None = None
        for _attempt in range(3):  # the free port may be taken between the probe and the server's bind
            self.port = _free_port()
            if self._spawn():
                break
        else:
            pytest.fail("redis-server did not start and answer PING (3 attempts, 5 s each)")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self) -> bool:
        import redis

        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        try:
            for _ in range(200):
                if self.proc.poll() is not None:
                    break
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.025)
        finally:
            client.close()
        self.kill()
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Killed (or stopped) and started again on the same port, empty."""
        if self.proc is not None and self.proc.poll() is None:
            self.cont()
        self.kill()
        for _ in range(40):  # the port can linger a moment after the kill
            if self._spawn():
                return
            time.sleep(0.05)
        pytest.fail(f"redis-server did not restart on port {self.port}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.cont()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url():
    server = RedisServer()
    yield server.url
    server.close()


@pytest.fixture
def redis_server():
    """A server this test alone may kill, stop and restart."""
    server = RedisServer()
    yield server
    server.close()


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
