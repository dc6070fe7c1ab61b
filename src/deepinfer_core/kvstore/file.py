"""KV block store over any POSIX directory: local disk, NFS, or (in production) a 3FS FUSE mount.

One file per block, ``root/<2 hex>/<key hex>.kvb``. Crash safety comes from the filesystem's atomic
rename: a writer writes a private temp file (unique per process, thread and call), fsyncs it, sets its
mtime and renames it over the final name. Readers therefore see an old whole block, a new whole block
or nothing; a writer killed mid-write leaves only a temp file that no reader opens (``sweep`` removes
it). Concurrent writers of one key each rename a complete file; the last rename wins.

Expiry: the file's mtime *is* the expiry instant (put / touch time + the class TTL), so ``touch`` is a
single ``utime`` and never rewrites the block, and expiry is exact to the filesystem's timestamp
resolution (ns on ext4, xfs, tmpfs). Expired files are misses at once and removed by ``sweep``.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import uuid
from pathlib import Path

from deepinfer_core.kvstore import record
from deepinfer_core.kvstore.record import Clock, StoreStats, TTLPolicy, as_payload, check_key, wall_clock_ns

log = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_TMP = ".tmp."


class FileKVStore(record.RecordReads):
    """``KVBlockStore`` over the directory ``root`` (created if missing).

    ``fsync=True`` (default) makes a put durable before it becomes visible (power loss included);
    tests may turn it off, since atomicity against process crashes comes from the rename alone.
    """

    chunk_bytes = 1 << 22  # one os.write at most (tests shrink it to crash writers between chunks)
    call_timeout_s = None  # a hung mount blocks a call for ever: a StoreGuard gives each call a deadline

    def __init__(
        self,
        root: str | os.PathLike,
        ttl: TTLPolicy | None = None,
        *,
        fsync: bool = True,
        clock: Clock = wall_clock_ns,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise ValueError(f"root={str(root)!r}: must be a directory")
        self.ttl = ttl if ttl is not None else TTLPolicy()
        self.fsync = bool(fsync)
        self.clock = clock
        self.stats = StoreStats()  # per process; counters are best effort under threads

    def check(self) -> None:
        """At start (``StoreGuard.check_store``): the root is still a directory we can list."""
        if not self.root.is_dir():
            raise ValueError(f"root={str(self.root)!r}: must be a directory")
        os.listdir(self.root)

    def path(self, key: bytes) -> Path:
        h = check_key(key).hex()
        return self.root / h[:2] / (h + _SUFFIX)

    # ---- writes
    def put(self, key: bytes, data, *, traffic_class: str = "chatbot", _after_chunk=None) -> None:
        key = check_key(key)
        ttl = self.ttl.ttl_ns(traffic_class)
        pieces = record.encode(key, traffic_class, as_payload(data))
        final = self.path(key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f"{_TMP}{final.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                for piece in pieces:
                    mv = memoryview(piece)
                    while len(mv):
                        n = os.write(fd, mv[: self.chunk_bytes])
                        mv = mv[n:]
                        if _after_chunk is not None:  # test hook: lets a test crash a writer mid-block
                            _after_chunk()
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            exp = self.clock() + ttl
            os.utime(tmp, ns=(exp, exp))
            os.replace(tmp, final)  # the commit point: atomic on POSIX filesystems
        except BaseException:
            # a full disk, a directory or a file nobody may replace at ``final``: nothing was committed,
            # and no temp file is left behind for ``sweep`` (or a full disk) to deal with
            tmp.unlink(missing_ok=True)
            raise
        self.stats.puts += 1

    # ---- reads
    def _read(self, key: bytes) -> tuple[str, bytes] | None:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not block the read
        except FileNotFoundError:
            return None
        try:
            # The open fd pins this inode: a concurrent rename replaces the name, not our bytes, so the
            # mtime and the content we check below belong to one file.
            st = os.fstat(fd)
            if not stat.S_ISREG(
                st.st_mode
            ):  # a directory, a FIFO, a device where a block goes: damage, a miss
                self.stats.corrupt += 1
                log.warning("kvstore: %s is not a regular file (treated as a miss)", path)
                return None
            if self.clock() >= st.st_mtime_ns:
                self.stats.expired += 1
                return None
            chunks = []
            while True:
                b = os.read(fd, 1 << 22)
                if not b:
                    break
                chunks.append(b)
        finally:
            os.close(fd)
        return self._decode(key, b"".join(chunks), path.name)

    def touch(self, key: bytes, *, traffic_class: str | None = None) -> bool:
        key = check_key(key)
        exp = self._touch_expiry_ns(key, traffic_class)
        if exp is None:
            return False
        try:
            os.utime(self.path(key), ns=(exp, exp))
        except FileNotFoundError:
            return False
        return True

    def delete(self, key: bytes) -> bool:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def sweep(self, *, tmp_grace_s: float = 3600.0) -> tuple[int, int]:
        """Remove expired blocks and temp files older than ``tmp_grace_s`` (writers that died).
        Returns (blocks removed, temp files removed). Safe beside live readers and writers: at worst a
        block re-put between the stat and the unlink is lost (a later miss), never corrupted."""
        now = self.clock()
        expired = stale = 0
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if f.name.startswith(_TMP):
                    # a live writer's temp file has mtime ~ now (it only gets the expiry at commit)
                    if now - st.st_mtime_ns > tmp_grace_s * 1e9:
                        f.unlink(missing_ok=True)
                        stale += 1
                elif f.name.endswith(_SUFFIX) and now >= st.st_mtime_ns:
                    f.unlink(missing_ok=True)
                    expired += 1
        return expired, stale
