"""StoreGuard: every backend error is a miss or a skipped write (counted by kind, logged once per cause),
the circuit breaker (threshold, exponential capped back-off, probes off the caller's path, recovery),
deadlines on hung calls, and the config's validation. Oracles: the hand-written error table of
faults.py, a fake clock, and counts of the calls that really reached the store."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import EngineConfig
from deepinfer_core.kvstore import (
    KINDS,
    InMemoryKVStore,
    Prefetcher,
    StoreGuard,
    StoreGuardConfig,
    TTLPolicy,
    classify,
)

from .faults import BACKEND_ERRORS


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Scripted:
    """A store whose every call raises ``self.error`` (None: forwards to a real in-memory store), hangs
    while ``self.hang`` is set, and counts the calls that reached it."""

    def __init__(self, bounded: bool = True) -> None:
        self.inner = InMemoryKVStore(TTLPolicy({"chatbot": 1000.0, "agent": 100.0}))
        self.ttl = self.inner.ttl
        if bounded:
            self.call_timeout_s = 0.0
        self.error: BaseException | None = None
        self.hang: threading.Event | None = None
        self.calls = 0
        self.threads: set[int] = set()

    def _enter(self) -> None:
        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.hang is not None:
            self.hang.wait(20)
        if self.error is not None:
            raise self.error

    def put(self, key, data, *, traffic_class="chatbot"):
        self._enter()
        return self.inner.put(key, data, traffic_class=traffic_class)

    def get(self, key):
        self._enter()
        return self.inner.get(key)

    def exists(self, key):
        self._enter()
        return self.inner.exists(key)

    def touch(self, key, *, traffic_class=None):
        self._enter()
        return self.inner.touch(key, traffic_class=traffic_class)

    def delete(self, key):
        self._enter()
        return self.inner.delete(key)


def _settle(g: StoreGuard, side: str, timeout: float = 5.0) -> str:
    """Wait for a probe in flight to finish; the side's state."""
    end = time.monotonic() + timeout
    while g.state(side) == "probing" and time.monotonic() < end:
        time.sleep(0.002)
    return g.state(side)


K = [os.urandom(16) for _ in range(8)]


@pytest.mark.parametrize(
    "exc,kind", BACKEND_ERRORS, ids=[f"{type(e).__name__}-{k}" for e, k in BACKEND_ERRORS]
)
def test_every_backend_error_is_a_miss_or_a_skipped_write(exc, kind):
    assert classify(exc) == kind and kind in KINDS
    s = Scripted()
    s.inner.put(K[0], b"abc")
    g = StoreGuard(s, StoreGuardConfig(failure_threshold=1000))
    s.error = exc
    assert g.get(K[0]) is None
    assert g.exists(K[0]) is False
    assert g.touch(K[0]) is False
    assert g.put(K[1], b"x") is False
    assert g.delete(K[0]) is False
    if kind in ("full", "permission"):  # the write side opens at once: the put and delete never ran
        assert g.stats.errors == {kind: 3} and g.stats.skipped_writes == 2 and g.state("write") == "open"
        assert g.stats.op_errors == {"get": 1, "exists": 1, "touch": 1}
    else:
        assert g.stats.errors == {kind: 5}
        assert g.stats.op_errors == {"get": 1, "exists": 1, "touch": 1, "put": 1, "delete": 1}
    s.error = None
    assert g.get(K[0]) == b"abc"  # nothing was lost; a later read sees the store as it is


def test_breaker_opens_after_threshold_skips_the_store_then_probes_with_capped_exponential_backoff():
    clock, s = Clock(), Scripted()
    cfg = StoreGuardConfig(failure_threshold=3, backoff_s=1.0, max_backoff_s=4.0)
    g = StoreGuard(s, cfg, clock=clock)
    s.inner.put(K[0], b"hit")
    s.error = ValueError("boom")  # not a "store down" kind: only the read side counts it
    for i in range(3):
        assert g.state("read") == "closed"
        assert g.get(K[0]) is None
        assert s.calls == i + 1
    assert g.state("read") == "open" and g.state("write") == "closed"
    for _ in range(100):  # open: no call reaches the store
        assert g.get(K[0]) is None and g.exists(K[0]) is False
    assert s.calls == 3 and g.stats.skipped_reads == 200
    br = g._breakers["read"]
    waits = [br.until - clock.t]
    for _ in range(5):  # each failed probe doubles the wait, up to max_backoff_s (plus <= 10% jitter)
        clock.t = br.until - 0.001
        n = s.calls
        g.get(K[0])
        assert g.state("read") == "open" and s.calls == n  # not yet: no probe
        clock.t = br.until
        g.get(K[0])  # starts the probe (on a worker thread); this call itself is skipped
        assert _settle(g, "read") == "open" and s.calls == n + 1
        waits.append(br.until - clock.t)
    assert 1.0 <= waits[0] <= 1.1 and 2.0 <= waits[1] <= 2.2 and 4.0 <= waits[2] <= 4.4
    assert all(4.0 <= w <= 4.4 for w in waits[3:])  # capped
    assert g.stats.probes == 5 and g.stats.op_errors.get("probe_read") == 5
    s.error = None  # the store answers again: the next probe closes the breaker
    clock.t += 5.0
    g.get(K[0])
    assert _settle(g, "read") == "closed"
    assert g.get(K[0]) == b"hit"


def test_store_down_opens_both_sides_full_disk_only_writes():
    clock, s = Clock(), Scripted()
    g = StoreGuard(s, StoreGuardConfig(failure_threshold=2), clock=clock)
    s.error = ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    g.get(K[0])
    g.get(K[0])
    assert g.state("read") == "open" and g.state("write") == "open"  # unreachable: writes cannot work either
    n = s.calls
    assert g.put(K[1], b"x") is False and s.calls == n

    clock2, s2 = Clock(), Scripted()
    g2 = StoreGuard(s2, StoreGuardConfig(failure_threshold=5), clock=clock2)
    s2.inner.put(K[0], b"old")
    s2.error = OSError(errno.ENOSPC, "No space left on device")
    assert g2.put(K[1], b"new") is False
    assert g2.state("write") == "open" and g2.state("read") == "closed"  # at once: the next put fails alike
    s2.error = None
    assert g2.get(K[0]) == b"old"  # reads go on hitting
    n = s2.calls
    assert g2.put(K[2], b"x") is False and g2.touch(K[0]) is False and s2.calls == n
    assert g2.stats.skipped_writes == 2 and g2.stats.errors == {"full": 1}


def test_a_probe_that_succeeds_on_a_full_disk_keeps_growing_the_backoff():
    """A write probe (a tiny record) may succeed on a nearly full disk while the next block fails: the
    back-off keeps doubling until a real write succeeds."""
    clock, s = Clock(), Scripted()
    cfg = StoreGuardConfig(backoff_s=1.0, max_backoff_s=64.0)
    g = StoreGuard(s, cfg, clock=clock)
    full = OSError(errno.EFBIG, "File too large")
    s.error = full
    g.put(K[0], b"block")
    for _ in range(3):
        s.error = None  # the probe's tiny record fits
        clock.t += 100.0
        assert g.put(K[0], b"block") is False  # this call starts the probe, and is skipped
        assert _settle(g, "write") == "closed"
        s.error = full  # the real block does not
        t0 = clock.t
        assert g.put(K[0], b"block") is False
        assert g.state("write") == "open"
    b = g._breakers["write"]
    assert b.opens == 4 and 8.0 <= b.until - t0 <= 8.8
    s.error = None
    clock.t += 100.0
    g.put(K[0], b"block")
    _settle(g, "write")
    assert g.put(K[0], b"block") is True and b.opens == 0  # a real write resets the back-off


def test_hung_calls_are_abandoned_at_the_deadline_and_bounded():
    s = Scripted(
        bounded=False
    )  # no call_timeout_s: the guard gives every call a worker thread and a deadline
    cfg = StoreGuardConfig(
        read_timeout_s=0.05, write_timeout_s=0.05, failure_threshold=1000, max_hung_calls=3
    )
    g = StoreGuard(s, cfg)
    s.inner.put(K[0], b"v")
    assert g.get(K[0]) == b"v" and threading.get_ident() not in s.threads
    s.hang = threading.Event()
    for i in range(3):
        t0 = time.perf_counter()
        assert g.get(K[0]) is None
        assert time.perf_counter() - t0 < 0.05 + 0.5
        assert g.stats.hung == i + 1
    n = s.calls
    t0 = time.perf_counter()
    assert g.get(K[0]) is None and g.put(K[1], b"x") is False  # hung store: no new call, no wait
    assert time.perf_counter() - t0 < 0.05 and s.calls == n
    assert g.stats.errors == {"timeout": 5}
    s.hang.set()  # the hung calls return; their results are dropped
    end = time.monotonic() + 5
    while g.stats.hung and time.monotonic() < end:
        time.sleep(0.005)
    assert g.stats.hung == 0
    s.hang = None
    assert g.get(K[0]) == b"v"


def test_inline_when_the_store_bounds_its_own_calls():
    s = Scripted(bounded=True)
    g = StoreGuard(s)
    g.get(K[0])
    assert s.threads == {threading.get_ident()}


def test_each_cause_is_logged_once_then_summarised_with_its_rate(caplog):
    clock, s = Clock(), Scripted()
    g = StoreGuard(s, StoreGuardConfig(failure_threshold=10**6, log_interval_s=60.0), clock=clock)
    s.error = OSError(errno.EIO, "Input/output error")
    caplog.set_level(logging.WARNING, logger="deepinfer_core.kvstore.guard")
    for _ in range(50):
        g.get(K[0])
        clock.t += 0.5
    recs = [r.getMessage() for r in caplog.records]
    assert len(recs) == 1 and "get failed (OSError, kind 'io')" in recs[0] and "treated as a miss" in recs[0]
    clock.t += 60
    g.get(K[0])
    recs = [r.getMessage() for r in caplog.records]
    assert len(recs) == 2 and "50 more read errors" in recs[1] and "/s" in recs[1]
    s.error = PermissionError(errno.EACCES, "Permission denied")
    g.get(K[0])
    g.put(K[0], b"x")  # another cause (and side): logged once more each
    recs = [r.getMessage() for r in caplog.records]
    assert sum("kind 'permission'" in m for m in recs) == 2
    assert g.stats.errors == {"io": 51, "permission": 2}


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["get", "exists", "touch", "put", "delete"]),
            st.sampled_from([None, None, "io", "full", "connection", "timeout", "invalid"]),
            st.floats(0, 3),
        ),
        max_size=60,
    ),
    threshold=st.integers(1, 4),
)
def test_random_calls_never_raise_and_never_reach_an_open_side(ops, threshold):
    """Invariants over random call / outcome / clock sequences: nothing raises, a call reaches the store
    only when its side is closed (or as that side's probe), every error is counted once by its kind."""
    errs = {
        "io": OSError(errno.EIO, "eio"),
        "full": OSError(errno.ENOSPC, "full"),
        "connection": ConnectionResetError("reset"),
        "timeout": TimeoutError("t"),
        "invalid": ValueError("v"),
    }
    clock, s = Clock(), Scripted()
    g = StoreGuard(
        s, StoreGuardConfig(failure_threshold=threshold, backoff_s=0.5, max_backoff_s=2.0), clock=clock
    )
    counted = 0
    for op, err, dt in ops:
        clock.t += dt
        side = "read" if op in ("get", "exists") else "write"
        s.error = errs[err] if err else None
        _settle(g, "read")
        _settle(g, "write")
        was = g.state(side)
        probes = g.stats.probes
        n = s.calls
        fn = getattr(g, op)
        out = fn(K[0], b"d") if op == "put" else fn(K[0])
        _settle(g, "read")
        _settle(g, "write")
        if was != "closed":
            assert s.calls - n == g.stats.probes - probes  # only a probe reached the store
            assert out in (None, False)
        else:
            assert s.calls - n == 1
            counted += err is not None
            if err is None:
                assert out is not False or op in ("touch", "delete", "exists")
    probe_errs = sum(v for k, v in g.stats.op_errors.items() if k.startswith("probe_"))
    assert g.stats.total_errors == counted + probe_errs


def test_prefetcher_reads_faults_as_misses():
    s = Scripted(bounded=False)
    for k in K[:4]:
        s.inner.put(k, np.full(8, 7, np.uint8))
    with Prefetcher(s, num_workers=1) as pf:  # its own guard: after 3 failures the breaker skips the store
        s.error = OSError(errno.EIO, "eio")
        assert pf.prefetch(K[:4]).result() == [None] * 4
        assert pf.store.state("read") == "open" and s.calls == 3
    g = StoreGuard(s, StoreGuardConfig(read_timeout_s=None, failure_threshold=100))
    with Prefetcher(g, num_workers=2) as pf:
        s.error = None
        assert len(pf.prefetch(K[:4] + K[6:7]).leading_hits()) == 4
        s.hang = threading.Event()
        t0 = time.perf_counter()
        assert pf.prefetch(K[:2]).leading_hits(timeout=0.05) == []  # a read still running is a miss
        assert time.perf_counter() - t0 < 1.0
        s.hang.set()


@pytest.mark.parametrize(
    "field,value",
    [
        ("read_timeout_s", 0),
        ("read_timeout_s", -1.0),
        ("write_timeout_s", "1"),
        ("failure_threshold", 0),
        ("failure_threshold", 2.5),
        ("backoff_s", 0),
        ("max_backoff_s", 0.5),
        ("max_hung_calls", 0),
        ("log_interval_s", None),
        ("read_timeout_s", True),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"StoreGuardConfig\.{field}="):
        StoreGuardConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"EngineConfig\.kv_store_guard: StoreGuardConfig\.{field}="):
        EngineConfig(kv_store_guard={field: value})
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_store_guard: .*unexpected keyword"):
        EngineConfig(kv_store_guard={"read_timeout": 1.0})
    with pytest.raises(ValueError, match=r"EngineConfig\.kv_store_guard: float: must be None"):
        EngineConfig(kv_store_guard=1.0)
    assert EngineConfig(kv_store_guard={"read_timeout_s": None}).kv_store_guard == StoreGuardConfig(
        read_timeout_s=None
    )
