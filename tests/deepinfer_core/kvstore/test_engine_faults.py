"""A fault in the KV store tier is a cache miss, never a failed request (issue #34).

Random workloads (prefix hits and misses, aborts, preemptions under a tight pool, speculation on and
off, async scheduling) run on an engine whose store (memory, POSIX directory, a real Redis) faults at
random points: every exception a backend can raise, slow calls, calls past the deadline, hung calls; on
the POSIX store also directories and FIFOs where records go; a read-only store of another user and a
full disk (in a subprocess); a real redis-server killed, SIGSTOPped and restarted. After every step no
request has failed; every request's tokens equal the store-less run's (exact mode, float64: the oracle
is an engine without prefix caching); at the end every block and state slot is free; with the store
restored the engine hits it again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.kvstore import FileKVStore, InMemoryKVStore, RedisKVStore, StoreGuardConfig, TTLPolicy
from deepinfer_core.sampling_params import SamplingParams

from .faults import BACKEND_ERRORS, FaultyStore

EXACT = {"model": "tiny-random", "seed": 5, "dtype": "float64", "quantize": False}
BS = 16
# short deadlines and back-offs so that breakers open, probe and close within a test
FAST = StoreGuardConfig(
    read_timeout_s=0.05,
    write_timeout_s=0.05,
    failure_threshold=3,
    backoff_s=0.02,
    max_backoff_s=0.2,
    max_hung_calls=4,
)
_WANT: dict[tuple, list[int]] = {}


@functools.cache
def reference() -> LLM:
    return LLM(
        num_blocks=512, block_size=BS, max_num_seqs=16, async_scheduling=False, prefix_caching=False, **EXACT
    )


def want(prompts, params) -> list[list[int]]:
    """The store-less tokens of each (prompt, max_tokens), computed once per pair."""
    keys = [(tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    todo = [i for i, k in enumerate(keys) if k not in _WANT]
    if todo:
        got = reference().generate([prompts[i] for i in todo], [params[i] for i in todo], use_tqdm=False)
        for i, g in zip(todo, got):
            assert g.ok, g.error
            _WANT[keys[i]] = list(g.token_ids)
    return [_WANT[k] for k in keys]


def workload(seed: int, n_req: int, lo: int = 80, hi: int = 96):
    """Prompts on two shared prefixes (long enough to leave a hit past the exact decoder tail of 61
    tokens), plus a short unrelated one in the same batches; small sizes keep CI fast."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 259, int(rng.integers(lo, hi))).tolist() for _ in range(2)]
    prompts = [
        prefixes[int(rng.integers(0, 2))] + rng.integers(3, 259, int(rng.integers(0, 12))).tolist()
        for _ in range(n_req)
    ]
    if n_req > 2:  # a short prompt that never reaches the store, in the same batches
        prompts[-1] = rng.integers(3, 259, int(rng.integers(5, 30))).tolist()
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 6)), ignore_eos=True) for _ in prompts
    ]
    return prompts, params


def drive(llm: LLM, prompts, params, *, aborts=None, on_step=None, tag="r") -> dict:
    """Add the requests, step to the end; after every step: no request failed, and each finished one has
    the store-less tokens (an aborted one a prefix of them)."""
    eng = llm.engine
    ref = want(prompts, params)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    outs: dict = {}
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, f"{o.request_id} failed: {o.error}"
            i = ids.index(o.request_id)
            if not o.finished:  # a streamed (cumulative) output: the tokens so far, a prefix
                assert list(o.token_ids) == ref[i][: len(o.token_ids)], o.request_id
                continue
            if o.finish_reason == "abort":
                assert list(o.token_ids) == ref[i][: len(o.token_ids)]
            else:
                assert list(o.token_ids) == ref[i], o.request_id
            outs[o.request_id] = o
        step += 1
        for i, at in (aborts or {}).items():
            if at == step:
                eng.abort(ids[i])
        if on_step is not None:
            on_step(step)
        assert step < 3000
    assert set(outs) == set(ids)
    return outs


def check_free(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv_pool.num_free_blocks == eng.config.num_blocks - 1
    assert eng.state_pool.num_free_slots == eng.config.max_num_seqs
    eng.kv_pool.check_invariants()


def wait_closed(llm: LLM, timeout: float = 10.0) -> None:
    """Let the breakers probe the restored store until both sides are closed."""
    g = llm.engine.prefix.link.guard
    end = time.monotonic() + timeout
    while not (g.allows("read") and g.allows("write")):
        assert time.monotonic() < end, (g.state("read"), g.state("write"), g.stats)
        time.sleep(0.01)


def recovers(llm: LLM, seed: int) -> None:
    """With the store restored, new prompts are written back and, once the GPU index is gone, hit the store."""
    wait_closed(llm)
    link = llm.engine.prefix.link
    prompts, params = workload(seed + 1, 1, 90, 100)
    drive(llm, prompts, params, tag="w")
    written = link.written_blocks
    llm.engine.reset()  # an empty GPU index: only the store can serve the prefix now (the guard is kept)
    link = llm.engine.prefix.link  # (a reset builds a new link around the same guard)
    outs = drive(llm, prompts, params, tag="h")
    assert written > 0 and link.fetched_blocks > 0, link.guard.stats
    assert any(o.cached_tokens > 0 for o in outs.values())
    check_free(llm)


def make_inner(backend: str, request, tmpdir: str):
    if backend == "memory":
        return InMemoryKVStore()
    if backend == "file":
        return FileKVStore(tmpdir, fsync=False)
    return RedisKVStore(url=request.getfixturevalue("redis_url"), namespace=b"f" + uuid.uuid4().bytes + b":")


def engine(store, *, tight: bool, spec: bool, async_mode: bool, prompts, params) -> LLM:
    need = max(-(-(len(p) + sp.max_tokens + 8) // BS) for p, sp in zip(prompts, params))
    return LLM(
        kv_store=store,
        kv_store_guard=FAST,
        num_blocks=need + 4 if tight else 256,
        block_size=BS,
        max_num_seqs=4,
        async_scheduling=async_mode,
        swa_replay="exact",
        speculative=spec,
        num_speculative_tokens=2,
        preemption_policy="deepinfer" if tight else "guarded",
        **EXACT,
    )


@pytest.mark.parametrize("backend", ["memory", "file", "redis"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_faults_cost_hits_never_requests(backend, request, data, caplog):
    caplog.set_level(logging.ERROR)  # the guard's warnings are expected here
    seed = data.draw(st.integers(0, 2**31), "seed")
    prompts, params = workload(seed, data.draw(st.integers(2, 4), "n_req"))
    spec, tight, async_mode = (
        data.draw(st.booleans(), "spec"),
        data.draw(st.booleans(), "tight"),
        data.draw(st.booleans(), "async"),
    )
    errors = data.draw(
        st.lists(st.sampled_from([e for e, _ in BACKEND_ERRORS]), min_size=1, max_size=4), "errors"
    )
    modes = tuple(
        data.draw(
            st.lists(
                st.sampled_from(["raise", "raise", "slow", "late", "hang"]),
                min_size=1,
                max_size=3,
                unique=True,
            ),
            "modes",
        )
    )
    rate = data.draw(st.sampled_from([0.15, 0.5, 1.0]), "rate")
    on_at, off_at = data.draw(st.integers(0, 8), "on_at"), data.draw(st.integers(5, 60), "off_at")
    aborts = data.draw(
        st.dictionaries(st.integers(0, len(prompts) - 1), st.integers(1, 12), max_size=2), "aborts"
    )
    damage_at = data.draw(st.integers(1, 10), "damage_at") if backend == "file" else None

    tmp = tempfile.mkdtemp(prefix="dkv-faults-")
    store = FaultyStore(
        make_inner(backend, request, tmp), seed=seed, rate=rate, errors=errors, modes=modes, late_s=0.12
    )
    llm = engine(store, tight=tight, spec=spec, async_mode=async_mode, prompts=prompts, params=params)
    link = llm.engine.prefix.link

    def on_step(step: int) -> None:
        if step == on_at:
            store.on = True
        if step == off_at:
            store.on = False
        if step == damage_at:  # a directory or a FIFO where each of these blocks' records goes
            for j, p in enumerate(prompts):
                for k in link.keys(np.asarray(p, np.int64)):
                    path = store.inner.path(k)
                    if not path.exists():
                        path.parent.mkdir(exist_ok=True)
                        path.mkdir() if j % 2 == 0 else os.mkfifo(path)

    try:
        drive(llm, prompts, params, aborts=aborts, on_step=on_step)  # first wave: the writer
        check_free(llm)
        llm.engine.reset()  # the second wave can hit only the store (the guard and its breakers stay)
        drive(llm, prompts, params, aborts={i: at + 2 for i, at in aborts.items()}, on_step=on_step, tag="s")
        check_free(llm)
        store.release()
        if (
            damage_at is not None
        ):  # the damaged records stay damaged: they are misses; clear them for the recovery
            for p in Path(tmp).rglob("*.kvb"):
                if not p.is_file():
                    p.rmdir() if p.is_dir() else p.unlink()
        recovers(llm, seed)
        assert not list(Path(tmp).rglob(".tmp.*"))  # a failed put leaves no temp file
    finally:
        store.release()


def test_directories_and_fifos_where_records_go_fail_no_request(tmp_path):
    """The issue's first case: the write-back onto a directory raised IsADirectoryError and failed an
    unrelated 40-token prompt of the same batch."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 259, 150).tolist()
    prompts = [prefix + rng.integers(3, 259, 9).tolist(), rng.integers(3, 259, 40).tolist()]
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    store = FileKVStore(tmp_path, fsync=False)
    probe = LLM(kv_store=store, num_blocks=256, block_size=BS, max_num_seqs=4, **EXACT)
    for i, k in enumerate(probe.engine.prefix.link.keys(np.asarray(prompts[0], np.int64))):
        path = store.path(k)
        path.parent.mkdir(exist_ok=True)
        path.mkdir() if i % 2 == 0 else os.mkfifo(path)
    llm = LLM(kv_store=store, num_blocks=256, block_size=BS, max_num_seqs=4, **EXACT)
    outs = drive(llm, prompts, params)
    assert all(o.cached_tokens == 0 for o in outs.values())  # every record is a miss
    errs = llm.engine.prefix.stats.kv_store_errors
    assert errs.get("io", 0) >= 1  # the put onto the directory, counted
    assert store.stats.corrupt >= 1  # the FIFO / directory read as damage
    assert not list(tmp_path.rglob(".tmp.*"))
    check_free(llm)


def _worker(args: list[str], no_caps: bool = False) -> dict:
    """Run _fault_worker.py; ``no_caps``: as root without any capability (setpriv), so that files of
    another user are as closed to it as to anyone (root would write them all)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, str(Path(__file__).with_name("_fault_worker.py")), *args]
    if no_caps:
        cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", *cmd]
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_read_only_store_of_another_user(tmp_path):
    """A populated store and an empty one that this user may read but not write (touch is EPERM, put is
    EACCES): the hits are served, nothing is written, no request fails."""
    from . import _fault_worker as w

    populated, empty = tmp_path / "populated", tmp_path / "empty"
    LLM(kv_store=FileKVStore(populated, fsync=False), **w.ENGINE, **w.EXACT).generate(
        w.prompts(3), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    empty.mkdir()
    tree = [populated, *populated.rglob("*"), empty]
    if os.geteuid() == 0:  # root writes anywhere: the store belongs to nobody, the worker runs without caps
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv (util-linux): cannot make a store read-only to root")
        for f in tree:
            os.chown(f, 65534, 65534)
        out = _worker(["readonly", str(populated), str(empty)], no_caps=True)
    else:
        for d in tree:
            if d.is_dir():
                os.chmod(d, 0o555)
        try:
            out = _worker(["readonly", str(populated), str(empty)])
        finally:
            for d in tree:
                if d.is_dir():
                    os.chmod(d, 0o755)
    for name in ("populated", "empty"):
        r = out[name]
        assert r["errors"] == [] and r["equal"] and r["free"], r
        assert r["kv_store_errors"].get("permission", 0) >= 1, r  # refused writes, counted
        assert r["write_state"] != "closed", r  # and the write side paused
    assert out["populated"]["cached"][0] > 0  # reads still hit
    assert not list(empty.rglob("*"))  # nothing written


def test_full_disk_stops_writes_not_steps(tmp_path):
    """Every put fails with EFBIG (a 4 KiB RLIMIT_FSIZE, in a subprocess): the requests are served, the
    write side pauses, no temp file is left, and once the limit is lifted writes and hits come back."""
    out = _worker(["fsize", str(tmp_path)])
    r = out["full"]
    assert r["errors"] == [] and r["equal"] and r["free"], r
    assert r["kv_store_errors"].get("full", 0) >= 1 and r["tmp_left"] == 0 and r["blocks"] == 0, r
    rec = out["recovered"]
    assert rec["errors"] == [] and rec["equal"] and rec["written"] > 0 and rec["cached"][0] > 0, rec


def test_config_errors_are_found_at_construction(redis_server):
    agent_only = InMemoryKVStore(TTLPolicy({"chatbot": 60.0}))
    with pytest.raises(
        ValueError,
        match=r"EngineConfig\.kv_store_traffic_class: 'agent': the store's TTL policy "
        r"knows only \['chatbot'\]",
    ):
        EngineConfig(kv_store=agent_only, kv_store_traffic_class="agent")
    with pytest.raises(ValueError, match=r"capacity_bytes=12288: the store holds less than one block"):
        LLM(kv_store=InMemoryKVStore(capacity_bytes=12288), **EXACT)
    # Redis down at start: a warning, the engine serves without it and picks it up once it answers
    redis_server.kill()
    store = RedisKVStore(url=redis_server.url)
    prompts, params = workload(21, 2, 100, 110)
    llm = LLM(kv_store=store, kv_store_guard=FAST, num_blocks=256, block_size=BS, **EXACT)
    g = llm.engine.prefix.link.guard
    assert g.state("read") != "closed" and g.stats.errors.get("connection", 0) >= 1
    drive(llm, prompts, params)
    redis_server.restart()
    recovers(llm, 21)


def test_old_redis_or_wrong_password_is_a_clear_error(redis_server):
    import redis

    c = redis.Redis.from_url(redis_server.url)
    c.config_set("requirepass", "s3cret")
    try:
        with pytest.raises(ValueError, match="refused the credentials"):
            LLM(kv_store=RedisKVStore(url=redis_server.url), **EXACT)
    finally:
        c.execute_command("AUTH", "s3cret")
        c.config_set("requirepass", "")


@pytest.mark.parametrize("event", ["kill", "stop"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), at=st.integers(1, 12), spec=st.booleans())
def test_redis_killed_or_stopped_then_restarted(event, redis_server, seed, at, spec, caplog):
    """A real redis-server killed (refused connections) or SIGSTOPped (every call would wait) at a random
    step: no request fails; once the breaker is open a step makes no store call; after a restart on the
    same port (or SIGCONT) the engine hits the store again."""
    caplog.set_level(logging.ERROR)
    redis_server.restart()  # a fresh server for each example
    store = RedisKVStore(url=redis_server.url, namespace=b"k" + uuid.uuid4().bytes + b":")
    prompts, params = workload(seed, 3)
    llm = engine(store, tight=False, spec=spec, async_mode=False, prompts=prompts, params=params)
    g = llm.engine.prefix.link.guard

    happened: list[int] = []

    def on_step(step: int) -> None:
        if step == at and not happened:
            happened.append(step)
            redis_server.kill() if event == "kill" else redis_server.stop()

    try:
        drive(llm, prompts, params, on_step=on_step)
        on_step(at)  # (if the first wave ended before step ``at``: the fault comes between the waves)
        llm.engine.reset()
        drive(llm, prompts, params, tag="s")  # the store is down for the whole wave
        assert g.state("read") != "closed" and g.stats.total_errors >= 1
        kinds = set(g.stats.errors)
        assert kinds <= {"connection", "timeout"}, g.stats.errors
        # once the breaker is open a step makes no store call, so it waits for no store timeout: the
        # calls that reached the dead store are the threshold's few (and off-path probes), the rest skipped
        assert g.stats.skipped_reads + g.stats.skipped_writes > 0
        assert (
            g.stats.op_errors.get("get", 0) + g.stats.op_errors.get("exists", 0) <= 2 * FAST.failure_threshold
        )
        check_free(llm)
    finally:
        if event == "stop":
            redis_server.cont()
    if event == "kill":
        redis_server.restart()
    recovers(llm, seed)
