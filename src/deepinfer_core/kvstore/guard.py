"""Failure isolation for an external KV block store: a store fault costs hits, never requests.

Every call the engine makes to its store goes through one ``StoreGuard``. A backend's exception, or a
call that runs past its deadline, becomes a miss (reads: ``get`` / ``exists``) or a skipped write
(``put`` / ``touch`` / ``delete``); it is counted by kind (``GuardStats.errors``, the engine's
``kv_store_errors``), logged once per cause (then summarised with its rate every ``log_interval_s``),
and never raised. A circuit breaker per side (reads, writes) stops calling a failing store:

- ``failure_threshold`` consecutive failures open the side (a full disk or a refused permission opens
  the write side at once: the next write would fail the same way); a store that is down (timeouts,
  refused connections) opens both sides, since neither can answer;
- while open, calls return a miss / skip at once, without touching the store, so a step costs no store
  time at all;
- after a back-off (``backoff_s``, doubled per failed probe, capped at ``max_backoff_s``, 0-10% jitter so
  engines sharing a store do not probe in step) one probe runs on a worker thread, off the step's path:
  a ``get`` of a fixed probe key for reads, a ``put`` of an empty record under it for writes; when it
  answers the side closes, else it stays open for the next, longer back-off.

Deadlines: a backend that bounds its own calls within the guard's timeout (``call_timeout_s``: 0 for
the in-memory store, the socket timeout for a Redis client) is called inline; any other call (a POSIX
or FUSE directory, a wrapped store) runs on a daemon worker thread and is abandoned at the deadline (it
may finish later; its result is dropped). At most ``max_hung_calls`` abandoned calls may be pending:
past that the store counts as hung and calls fail at once. Daemon threads never hold up the process's
exit.
"""

from __future__ import annotations

import collections
import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs

log = logging.getLogger(__name__)

READ, WRITE = "read", "write"
# The kinds ``GuardStats.errors`` counts (the engine's kv_store_errors), in the order docs/kvstore.md lists them.
KINDS = ("timeout", "connection", "full", "permission", "io", "server", "invalid", "memory", "other")
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_PERM = {errno.EACCES, errno.EPERM, errno.EROFS}
PROBE_KEY = b"deepinfer-kvstore-probe\x00"  # 24 bytes; block_keys are hashes, so no block is filed here


class CallTimeout(TimeoutError):
    """A store call ran past the guard's deadline (or too many calls are already hung)."""


def classify(exc: BaseException) -> str:
    """The kind of a backend's exception (one of ``KINDS``). Redis errors are named by class, so this
    module needs no redis import."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, TimeoutError) or "TimeoutError" in names:
        return "timeout"
    if "AuthenticationError" in names or "ReadOnlyError" in names or "NoPermissionError" in names:
        return "permission"
    if isinstance(exc, ConnectionError) or "ConnectionError" in names:
        return "connection"
    if isinstance(exc, OSError):
        if exc.errno in _FULL:
            return "full"
        if isinstance(exc, PermissionError) or exc.errno in _PERM:
            return "permission"
        return "io"
    if "OutOfMemoryError" in names or ("ResponseError" in names and str(exc).startswith("OOM")):
        return "full"  # Redis at maxmemory without eviction: the store is full
    if "RedisError" in names:
        return "server"
    if isinstance(exc, ValueError | TypeError | KeyError | IndexError):
        return "invalid"
    if isinstance(exc, MemoryError):
        return "memory"
    return "other"


def _positive(v: object, *, none_ok: bool, hi: float) -> bool:
    if v is None:
        return none_ok
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= hi


@attrs.frozen(kw_only=True)
class StoreGuardConfig:
    """How the engine isolates its store's faults (``EngineConfig.kv_store_guard``; docs/kvstore.md).

    ``read_timeout_s`` bounds one read (``get`` / ``exists``) and a whole ``StoreLink.fetch`` stops at the
    first block past it; ``write_timeout_s`` bounds one write (``put`` / ``touch``); None: no deadline (the
    call runs inline). ``failure_threshold`` consecutive failures open a side's breaker for ``backoff_s``,
    doubled per failed probe up to ``max_backoff_s``. ``max_hung_calls``: abandoned calls allowed to be
    pending before the store counts as hung. ``log_interval_s``: a cause already logged is summarised
    (count and rate) at most this often.
    """

    read_timeout_s: float | None = 0.1
    write_timeout_s: float | None = 0.5
    failure_threshold: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_hung_calls: int = 4
    log_interval_s: float = 60.0

    def __attrs_post_init__(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"StoreGuardConfig.{field}={getattr(self, field)!r}: {msg}")

        for f in ("read_timeout_s", "write_timeout_s"):
            if not _positive(getattr(self, f), none_ok=True, hi=3600):
                raise bad(f, "must be None (no deadline) or seconds in (0, 3600]")
        for f in ("backoff_s", "max_backoff_s", "log_interval_s"):
            if not _positive(getattr(self, f), none_ok=False, hi=86400):
                raise bad(f, "must be seconds in (0, 86400]")
        if self.max_backoff_s < self.backoff_s:
            raise bad("max_backoff_s", f"must be >= backoff_s={self.backoff_s}")
        for f, hi in (("failure_threshold", 10**6), ("max_hung_calls", 1024)):
            v = getattr(self, f)
            if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi):
                raise bad(f, f"must be an int in [1, {hi}]")

    def timeout(self, side: str) -> float | None:
        return self.read_timeout_s if side == READ else self.write_timeout_s


@attrs.define
class GuardStats:
    """What a guard counted: ``errors`` by kind (``KINDS``) and ``op_errors`` by operation, calls not made
    because a breaker was open, breaker openings, probes, and calls abandoned at their deadline that
    have not returned yet (``hung``)."""

    errors: dict[str, int] = attrs.field(factory=dict)
    op_errors: dict[str, int] = attrs.field(factory=dict)
    skipped_reads: int = 0
    skipped_writes: int = 0
    breaker_opens: int = 0
    probes: int = 0
    hung: int = 0

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


@attrs.define
class _Breaker:
    side: str
    state: str = "closed"  # closed | open | probing
    failures: int = 0  # consecutive
    opens: int = 0  # openings since the last successful call (the back-off's exponent)
    until: float = 0.0  # open: when the next probe may start
    since: float = 0.0  # when it (last) left the closed state
    skipped: int = 0  # calls skipped since it opened


class _Workers:
    """Daemon threads for calls with a deadline and for probes. A thread idle for ``idle_s`` exits; a
    call stuck in the store keeps its thread, never the process (daemon)."""

    def __init__(self, max_threads: int, idle_s: float = 10.0) -> None:
        self._max = max_threads
        self._idle_s = idle_s
        self._cv = threading.Condition(threading.Lock())
        self._q: collections.deque = collections.deque()
        self._threads = 0
        self._waiting = 0  # idle threads not yet woken for a queued item

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            self._q.append((fut, fn, args))
            if self._waiting:
                self._waiting -= 1
                self._cv.notify()
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._run, name="kvstore-guard", daemon=True).start()
        return fut

    def _run(self) -> None:
        with self._cv:
            while True:
                if not self._q:
                    self._waiting += 1
                    if not self._cv.wait(self._idle_s) and not self._q:
                        self._waiting -= 1
                        self._threads -= 1
                        return
                    if not self._q:  # woken for an item another thread took
                        continue
                fut, fn, args = self._q.popleft()
                self._cv.release()
                try:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(*args))
                        except BaseException as e:  # handed to the waiter (or dropped if it gave up)
                            fut.set_exception(e)
                finally:
                    self._cv.acquire()


class _CauseLog:
    """Log a cause (side, kind, exception type) once; then a summary with its count and rate at most
    every ``interval_s``."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._seen: dict[tuple[str, str, str], list] = {}  # cause -> [total, since last log, last log time]

    def record(self, side: str, op: str, kind: str, exc: BaseException) -> None:
        cause = (side, kind, type(exc).__name__)
        now = self.clock()
        ent = self._seen.get(cause)
        what = "a miss" if side == READ else "a skipped write"
        if ent is None:
            self._seen[cause] = [1, 0, now]
            log.warning(
                "kvstore: %s failed (%s, kind %r): %s; treated as %s. Later %s errors of this cause are "
                "counted (kv_store_errors[%r]) and summarised every %.0f s",
                op,
                type(exc).__name__,
                kind,
                _short(exc),
                what,
                side,
                kind,
                self.interval_s,
            )
            return
        ent[0] += 1
        ent[1] += 1
        if now - ent[2] >= self.interval_s:
            log.warning(
                "kvstore: %d more %s errors (%s, kind %r) in the last %.0f s (%.2f/s, %d in all); last: %s",
                ent[1],
                side,
                type(exc).__name__,
                kind,
                now - ent[2],
                ent[1] / max(now - ent[2], 1e-9),
                ent[0],
                _short(exc),
            )
            ent[1], ent[2] = 0, now


def _short(exc: BaseException, n: int = 200) -> str:
    s = str(exc)
    return s if len(s) <= n else s[:n] + "..."


class StoreGuard:
    """A ``KVBlockStore`` in front of ``store`` whose calls never raise (see the module docstring).

    ``get`` -> bytes | None, ``exists`` / ``touch`` / ``delete`` -> bool, ``put`` -> bool (written); a fault is a
    None / False. ``allows(side)`` says whether a call of that side would reach the store now (a caller
    skips its own preparation, e.g. hashing or a device copy, when it would not). ``clock``: monotonic
    seconds (tests inject one).
    """

    def __init__(
        self,
        store: Any,
        config: StoreGuardConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config is not None and not isinstance(config, StoreGuardConfig):
            raise TypeError(f"config: must be a StoreGuardConfig, got {type(config).__name__}")
        self.store = store
        self.config = cfg = config if config is not None else StoreGuardConfig()
        self.clock = clock
        self.stats = GuardStats()
        self._lock = threading.Lock()
        self._breakers = {READ: _Breaker(READ), WRITE: _Breaker(WRITE)}
        self._workers = _Workers(cfg.max_hung_calls + 2)
        self._log = _CauseLog(cfg.log_interval_s, clock)
        own = getattr(store, "call_timeout_s", None)  # the backend's own bound on a call, if any
        self._inline = {
            s: cfg.timeout(s) is None or (own is not None and own <= cfg.timeout(s)) for s in (READ, WRITE)
        }
        self._probe_class: str | None = None  # the traffic class of the last put (a write probe's class)

    # ------------------------------------------------------------------ the store's calls
    def get(self, key: bytes) -> bytes | None:
        return self._call(READ, "get", self.store.get, (key,), None)

    def exists(self, key: bytes) -> bool:
        return bool(self._call(READ, "exists", self.store.exists, (key,), False))

    def touch(self, key: bytes, *, traffic_class: str | None = None) -> bool:
        # restarting a TTL is a write: a read-only or full store refuses it while its reads still hit
        return bool(
            self._call(
                WRITE, "touch", lambda k: self.store.touch(k, traffic_class=traffic_class), (key,), False
            )
        )

    def put(self, key: bytes, data: Any, *, traffic_class: str = "chatbot") -> bool:
        self._probe_class = traffic_class
        ok = self._call(
            WRITE,
            "put",
            lambda k, d: self.store.put(k, d, traffic_class=traffic_class) or True,
            (key, data),
            False,
        )
        return bool(ok)

    def delete(self, key: bytes) -> bool:
        return bool(self._call(WRITE, "delete", self.store.delete, (key,), False))

    # ------------------------------------------------------------------ state
    def allows(self, side: str) -> bool:
        """Whether a ``side`` call would reach the store now (closed breaker). An open breaker whose
        back-off has passed starts its probe here (on a worker thread) and still answers False."""
        b = self._breakers[side]
        if b.state == "closed":
            return True
        with self._lock:
            if b.state == "open" and self.clock() >= b.until and self.stats.hung < self.config.max_hung_calls:
                b.state = "probing"
                self.stats.probes += 1
                self._workers.submit(self._probe, side)
            return b.state == "closed"

    def skip(self, side: str) -> None:
        """Count a call (or a caller's whole operation) not made because ``side``'s breaker is open."""
        with self._lock:
            self._breakers[side].skipped += 1
            if side == READ:
                self.stats.skipped_reads += 1
            else:
                self.stats.skipped_writes += 1

    def state(self, side: str) -> str:
        """ "closed" (calls go through), "open" (skipped; waiting for the back-off) or "probing"."""
        return self._breakers[side].state

    def check_store(self) -> None:
        """At start: the backend's own ``check()`` (when it has one). A configuration error (ValueError,
        TypeError: a wrong Redis version or password, ...) is raised; a store that does not answer (it is
        down, the network is) starts with both breakers open, a warning, and probes in the background."""
        check = getattr(self.store, "check", None)
        if check is None:
            return
        try:
            if self._inline[READ]:
                check()
            else:
                self._deadline(check, (), self.config.timeout(READ))
        except (ValueError, TypeError):
            raise
        except Exception as e:
            kind = classify(e)
            self._count("check", kind)
            log.warning(
                "kvstore: the store did not answer at start (%s: %s, kind %r); the engine starts without "
                "it (every lookup a miss, no writes) and probes it every %.3g-%.3g s",
                type(e).__name__,
                _short(e),
                kind,
                self.config.backoff_s,
                self.config.max_backoff_s,
            )
            with self._lock:
                for b in self._breakers.values():
                    self._open(b, quiet=True)

    def note_error(self, op: str, exc: BaseException) -> None:
        """Count and log a failure of the engine's side of a store operation (e.g. landing fetched
        blocks), which says nothing about the store's health: no breaker moves."""
        kind = classify(exc)
        with self._lock:
            self._count(op, kind)
            self._log.record(READ, op, kind, exc)

    # ------------------------------------------------------------------ internals
    def _call(self, side: str, op: str, fn: Callable[..., Any], args: tuple, default: Any) -> Any:
        if not self.allows(side):
            self.skip(side)
            return default
        try:
            out = fn(*args) if self._inline[side] else self._deadline(fn, args, self.config.timeout(side))
        except Exception as e:  # every backend error is a miss / a skipped write (BaseException passes)
            self._failed(side, op, e)
            return default
        b = self._breakers[side]
        if b.failures or b.opens:
            with self._lock:
                b.failures = b.opens = 0
        return out

    def _deadline(self, fn: Callable[..., Any], args: tuple, timeout: float | None) -> Any:
        with self._lock:
            if self.stats.hung >= self.config.max_hung_calls:
                raise CallTimeout(f"{self.stats.hung} earlier calls still hang in the store")
        fut = self._workers.submit(fn, *args)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():  # the call itself raised a TimeoutError
                raise
            with self._lock:
                self.stats.hung += 1
            fut.add_done_callback(self._unhung)
            raise CallTimeout(f"no answer within {timeout} s") from None

    def _unhung(self, _fut: Future) -> None:
        with self._lock:
            self.stats.hung -= 1

    def _count(self, op: str, kind: str) -> None:
        s = self.stats
        s.errors[kind] = s.errors.get(kind, 0) + 1
        s.op_errors[op] = s.op_errors.get(op, 0) + 1

    def _failed(self, side: str, op: str, exc: Exception) -> None:
        kind = classify(exc)
        with self._lock:
            self._log.record(side, op, kind, exc)
            self._count(op, kind)
            b = self._breakers[side]
            b.failures += 1
            at_once = side == WRITE and kind in ("full", "permission")
            if b.state == "closed" and (at_once or b.failures >= self.config.failure_threshold):
                self._open(
                    b, why=f"{b.failures} consecutive failures, last {type(exc).__name__}: {_short(exc)}"
                )
                if kind in ("timeout", "connection"):  # the store is down or unreachable: both sides are
                    other = self._breakers[WRITE if side == READ else READ]
                    if other.state == "closed":
                        self._open(other, why=f"the {side}s found the store unreachable")

    def _open(self, b: _Breaker, why: str = "", quiet: bool = False) -> None:
        """(under the lock) Open ``b`` for its next back-off."""
        cfg, now = self.config, self.clock()
        b.opens += 1
        wait = min(cfg.max_backoff_s, cfg.backoff_s * 2.0 ** min(b.opens - 1, 60)) * (
            1.0 + 0.1 * random.random()
        )
        if b.state == "closed":
            b.since, b.skipped = now, 0
            self.stats.breaker_opens += 1
            if not quiet:
                log.warning(
                    "kvstore: %ss paused for %.2f s (%s); every %s meanwhile is a %s, probed after the "
                    "back-off (doubling to %.0f s)",
                    b.side,
                    wait,
                    why,
                    b.side,
                    "miss" if b.side == READ else "skipped write",
                    cfg.max_backoff_s,
                )
        else:
            log.debug("kvstore: %s probe failed; next in %.2f s", b.side, wait)
        b.state, b.until, b.failures = "open", now + wait, 0

    def _probe(self, side: str) -> None:
        """One call to see whether the store answers again (on a worker thread, with the side's deadline)."""
        try:
            if side == READ:
                fn: Callable[[], Any] = lambda: self.store.get(PROBE_KEY)  # noqa: E731 - a hit or a miss both answer
            else:
                cls = self._probe_class or next(
                    iter(getattr(getattr(self.store, "ttl", None), "ttls_s", None) or ["chatbot"])
                )
                fn = lambda: self.store.put(PROBE_KEY, b"", traffic_class=cls)  # noqa: E731
            if self._inline[side]:
                fn()
            else:
                self._deadline(fn, (), self.config.timeout(side))
        except Exception as e:
            kind = classify(e)
            with self._lock:
                self._log.record(side, f"{side} probe", kind, e)
                self._count(f"probe_{side}", kind)
                self._open(self._breakers[side])
            return
        with self._lock:
            b = self._breakers[side]
            b.state, b.failures = "closed", 0  # ``opens`` stays until a real call succeeds (a full disk
            # answers a small probe, then refuses the next block: the back-off keeps growing)
            log.warning(
                "kvstore: %ss resumed: the store answered a probe after %.1f s (%d calls skipped meanwhile)",
                side,
                self.clock() - b.since,
                b.skipped,
            )
