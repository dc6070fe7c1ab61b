"""Fault injection for KV stores: the exceptions every backend can raise, and a store proxy that raises
them, answers slowly or hangs at the calls a seeded schedule picks."""

from __future__ import annotations

import errno
import random
import threading
import time

import redis.exceptions as rx

# (exception, the kind StoreGuard must count it as): the oracle is this hand-written table, what each
# errno / client error means for a store, not the classifier's code.
BACKEND_ERRORS: list[tuple[BaseException, str]] = [
    # POSIX directory / FUSE mount (FileKVStore)
    (OSError(errno.EIO, "Input/output error"), "io"),
    (IsADirectoryError(errno.EISDIR, "Is a directory"), "io"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), "io"),
    (FileExistsError(errno.EEXIST, "File exists"), "io"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), "io"),
    (OSError(errno.ESTALE, "Stale file handle"), "io"),
    (OSError(errno.ENOTCONN, "Transport endpoint is not connected"), "io"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links"), "io"),
    (OSError(errno.EMFILE, "Too many open files"), "io"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission"),
    (PermissionError(errno.EPERM, "Operation not permitted"), "permission"),
    (OSError(errno.EROFS, "Read-only file system"), "permission"),
    (OSError(errno.ENOSPC, "No space left on device"), "full"),
    (OSError(errno.EFBIG, "File too large"), "full"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "full"),
    # sockets (a remote store, any client)
    (TimeoutError("timed out"), "timeout"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connection"),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "connection"),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), "connection"),
    # redis-py
    (rx.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."), "connection"),
    (rx.TimeoutError("Timeout reading from 127.0.0.1:6379"), "timeout"),
    (rx.BusyLoadingError("LOADING Redis is loading the dataset in memory"), "connection"),
    (rx.ReadOnlyError("READONLY You can't write against a read only replica."), "permission"),
    (rx.AuthenticationError("WRONGPASS invalid username-password pair"), "permission"),
    (rx.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."), "full"),
    (rx.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), "full"),
    (rx.ResponseError("ERR unknown command 'PEXPIRETIME'"), "server"),
    (rx.DataError("Invalid input of type: 'NoneType'"), "server"),
    # anything else a backend (or a wrapper around one) may raise
    (ValueError("data: 24576 bytes exceed capacity_bytes=12288"), "invalid"),
    (TypeError("unsupported operand"), "invalid"),
    (KeyError("block"), "invalid"),
    (MemoryError(), "memory"),
    (RuntimeError("unexpected"), "other"),
    (AssertionError("backend invariant"), "other"),
]


class FaultyStore:
    """A ``KVBlockStore`` that forwards to ``inner`` except where its schedule injects a fault: raise one
    of ``errors``, answer ``slow_s`` late (below the guard's timeout), ``late_s`` late (past it), or hang
    until ``release()``. ``rate``: the share of calls that fault while ``on``; ``rng``: the schedule."""

    def __init__(
        self,
        inner,
        *,
        seed: int,
        rate: float,
        errors: list[BaseException],
        modes: tuple[str, ...],
        slow_s: float = 0.005,
        late_s: float = 0.3,
    ) -> None:
        self.inner = inner
        self.ttl = getattr(inner, "ttl", None)
        self.rng = random.Random(seed)
        self.rate = rate
        self.errors = errors
        self.modes = modes
        self.slow_s, self.late_s = slow_s, late_s
        self.on = False
        self.faults = 0
        self.calls = 0
        self._hang = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        """Restore the store: no more faults, every hung call returns."""
        self.on = False
        self._hang.set()

    def _maybe_fault(self) -> None:
        with self._lock:
            self.calls += 1
            if not self.on or self.rng.random() >= self.rate:
                return
            self.faults += 1
            mode = self.rng.choice(self.modes)
            err = self.rng.choice(self.errors)
        if mode == "raise":
            raise err
        if mode == "slow":
            time.sleep(self.slow_s)
        elif mode == "late":
            time.sleep(self.late_s)
        elif mode == "hang":
            self._hang.wait(30)

    def put(self, key, data, *, traffic_class="chatbot"):
        self._maybe_fault()
        return self.inner.put(key, data, traffic_class=traffic_class)

    def get(self, key):
        self._maybe_fault()
        return self.inner.get(key)

    def exists(self, key):
        self._maybe_fault()
        return self.inner.exists(key)

    def touch(self, key, *, traffic_class=None):
        self._maybe_fault()
        return self.inner.touch(key, traffic_class=traffic_class)

    def delete(self, key):
        self._maybe_fault()
        return self.inner.delete(key)
