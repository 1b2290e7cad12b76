"""The shared KV tier: a content-addressed store of blocks on a volume every replica mounts.

Entries live under ``<root>/<fingerprint>/<key_hex[:2]>/<key_hex>``, one file per block key
(:mod:`shared_entry`'s header, then the payload). The fingerprint names the model, dtype, block
size and KV layout, so a store of anything else is never read. A file is written to a temp file
in its directory and renamed over the entry (two writers of one key: one wins, both whole); a
read verifies everything and treats any torn, truncated, corrupt or foreign file as a miss,
removing it. Writes go through one background thread from a bounded queue (full: dropped), so
the engine pays only for packing the block. The store is bounded by bytes with LRU over the
whole directory (access times kept in memory, the directory scanned at start). A directory that
cannot be written (read-only, full, not permitted) sets ``problem`` once and stops the writes;
reads go on where they can, and serving never fails because of the tier.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.common.block_keys import key_hex
from kvmesh.common.kv_events import BlockRemoved, BlockStored, KVEvent
from kvmesh.common.kv_tiers import MEDIUM_SHARED
from kvmesh.engine.kv_offload import shared_entry

log = logging.getLogger(__name__)

# Errors that say the directory cannot take writes at all (rather than one write failing).
_FATAL_WRITE_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EPERM, errno.EDQUOT}
_NOT_A_DIR_ERRNOS = {errno.ENOTDIR}
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 60.0  # a temp file this old is a killed writer's: removed by the start-up scan
_NEG_CACHE_MAX = 65536
_STATS = ("written", "write_errors", "read_hits", "read_misses", "corrupt", "evicted", "dropped")


def store_fingerprint(
    model_identity: str, dtype: str, block_size: int, kv_shape: tuple[int, ...]
) -> str:
    """32 hex digits naming what a payload means: the model, the cache dtype, the block size and
    the KV layout (anything that changes the bytes of a block changes the fingerprint)."""
    desc = {
        "format": shared_entry.VERSION,
        "model": model_identity,
        "dtype": str(dtype),
        "block_size": int(block_size),
        "kv_shape": [int(d) for d in kv_shape],
    }
    text = json.dumps(desc, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=16).hexdigest()


CAP_SYS_NICE = 23


def may_raise_priority(status: str = "/proc/self/status") -> bool:
    """Whether this process may move a thread out of SCHED_IDLE again: CAP_SYS_NICE in its
    effective capabilities, or a RLIMIT_NICE that allows nice 0 (a container without the
    capability, the usual pod, may not)."""
    try:
        import resource

        if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
            return True
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    try:
        for line in open(status):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _yield_cpu(tid: int, yielding: bool) -> bool:
    """Put a thread in Linux's SCHED_IDLE class (it runs on CPU time nothing else wants) or back
    in the normal one; False where that is not possible or not permitted."""
    try:
        if yielding:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def _write_entry(path: Path, parts, fsync: bool) -> None:
    """Write ``parts`` (bytes-like, in order) as ``path``, atomically: a temp file in the same
    directory, then rename."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _Write:
    __slots__ = ("key", "parent", "token_ids", "block_size", "lora_id", "lora_name", "payload")

    def __init__(self, key, parent, token_ids, block_size, lora_id, lora_name, payload):
        self.key, self.parent, self.token_ids = key, parent, list(token_ids)
        self.block_size, self.lora_id, self.lora_name = block_size, lora_id, lora_name
        self.payload = payload


class SharedKVStore:
    """One replica's view of the shared tier (see the module docstring).

    ``contains``, ``read`` and ``write_behind`` are called from the engine thread; the writer
    thread writes, evicts and sends the events (medium SHARED) to ``on_events``."""

    fsync = False  # a torn file is caught by the checksum: durability is not worth a sync
    negative_ttl_s = 1.0  # how long a missing entry is believed missing before another stat

    def __init__(
        self,
        root: str,
        fingerprint: str,
        block_bytes: int,
        max_bytes: int,
        *,
        queue_max: int = 512,
        on_events: Callable[[list[KVEvent]], None] | None = None,
    ):
        self.dir = Path(root) / fingerprint
        self.block_bytes = int(block_bytes)
        self.entry_bytes = shared_entry.HEADER.size + self.block_bytes
        self.max_bytes = int(max_bytes)
        self.on_events = on_events
        self.problem: str | None = None
        self.stats: collections.Counter = collections.Counter({s: 0 for s in _STATS})
        self._fp = bytes.fromhex(fingerprint)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._missing: dict[int, float] = {}  # key -> monotonic time a stat found no entry
        self._pending: set[int] = set()  # keys queued for writing
        self._removed: list[int] = []  # keys found corrupt or gone by reads: events to send
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_max))
        self._open()
        self._writer_tid: int | None = None  # set once the writer may change its priority
        self._yielding = False
        self._thread = threading.Thread(target=self._writer, name="kv-shared-writer", daemon=True)
        self._thread.start()

    # -- start-up -------------------------------------------------------------
    def _open(self) -> None:
        if self.entry_bytes > self.max_bytes:
            self._stop_writes(f"the size limit ({self.max_bytes} B) holds no block", None)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_writes(f"cannot create {self.dir}", exc)
            return
        self._scan()
        self._probe()

    def _probe(self) -> None:
        """Find an unwritable directory now rather than at the first write."""
        probe = self.dir / f"{_TMP_PREFIX}probe-{os.getpid()}-{id(self)}"
        try:
            probe.touch()
            _unlink(probe)
        except OSError as exc:
            self._stop_writes(f"cannot write in {self.dir}", exc)

    def _scan(self) -> None:
        """Index the entries already there, oldest first by modification time."""
        found: list[tuple[float, int]] = []
        now = time.time()
        for sub in self._subdirs():
            for entry in self._entries(sub):
                key = self._scan_one(entry, now)
                if key is not None:
                    found.append((entry.stat().st_mtime, key))
        for _, key in sorted(found):
            self._lru[key] = None
        self._removed.extend(self._evict_over(0))  # a smaller limit than the last run's

    def _subdirs(self):
        try:
            return [d for d in os.scandir(self.dir) if len(d.name) == 2 and d.is_dir()]
        except OSError:
            return []

    @staticmethod
    def _entries(sub):
        try:
            return list(os.scandir(sub.path))
        except OSError:
            return []

    def _scan_one(self, entry, now: float) -> int | None:
        """The key of an entry file of the right size; stale temp files and junk are removed."""
        try:
            st = entry.stat()
        except OSError:
            return None
        if entry.name.startswith(_TMP_PREFIX):
            if now - st.st_mtime > _STALE_TMP_S:
                _unlink(Path(entry.path))
            return None
        try:
            key = int(entry.name, 16)
        except ValueError:
            return None
        if len(entry.name) != 16 or st.st_size != self.entry_bytes:
            _unlink(Path(entry.path))
            return None
        return key

    # -- the engine's side ----------------------------------------------------
    def path_of(self, key: int) -> Path:
        h = key_hex(key)
        return self.dir / h[:2] / h

    def contains(self, key: int) -> bool:
        """Whether the store holds ``key``: this replica's index, else the directory (another
        replica may have written it), a miss there believed for ``negative_ttl_s``."""
        with self._lock:
            if key in self._lru:
                return True
            seen = self._missing.get(key)
            if seen is not None and time.monotonic() - seen < self.negative_ttl_s:
                return False
        try:
            present = os.stat(self.path_of(key)).st_size == self.entry_bytes
        except OSError:
            present = False
        with self._lock:
            if present:
                self._missing.pop(key, None)
                self._lru[key] = None
            else:
                if len(self._missing) >= _NEG_CACHE_MAX:
                    self._missing.clear()
                self._missing[key] = time.monotonic()
        return present

    def read(self, key: int) -> bytes | None:
        """The block's payload (``block_bytes``), verified; None on a miss or a bad entry."""
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.entry_bytes + 1)
                ino = os.fstat(f.fileno()).st_ino
        except OSError:
            self._forget(key, corrupt=False)
            return None
        payload = shared_entry.decode(data, self._fp, key, self.block_bytes)
        if payload is None:
            self._remove_if_same(path, ino)
            self._forget(key, corrupt=True)
            return None
        with self._lock:
            self.stats["read_hits"] += 1
            self._lru[key] = None
            self._lru.move_to_end(key)
        return payload

    @staticmethod
    def _remove_if_same(path: Path, ino: int) -> None:
        # Another replica may have renamed a good entry over the bad one since: keep that.
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass

    def _forget(self, key: int, corrupt: bool) -> None:
        with self._lock:
            self.stats["corrupt" if corrupt else "read_misses"] += 1
            self._missing[key] = time.monotonic()
            if self._lru.pop(key, 0) is None:  # it was indexed: its removal is an event
                self._removed.append(key)
        if corrupt:
            log.warning("shared KV tier: corrupt entry %s removed", key_hex(key))

    def write_behind(self, key, parent, token_ids, block_size, lora_id, lora_name, payload) -> bool:
        """Queue the block for writing; False if skipped (held already, writes stopped, a
        payload of the wrong size) or dropped (queue full). Never blocks."""
        if self.problem is not None or len(payload) != self.block_bytes:
            return False
        with self._lock:
            if key in self._lru or key in self._pending:
                return False
            self._pending.add(key)
        item = _Write(key, parent, token_ids, block_size, lora_id, lora_name, payload)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self.stats["dropped"] += 1
            return False
        return True

    def engine_busy(self, busy: bool) -> None:
        """The engine's steps run (True) or it has nothing left to do (False). While it runs,
        the writer yields the CPU to the forward (SCHED_IDLE): the write-through costs
        the steps little, and on a saturated engine the queue fills and drops what it cannot take
        (``stats["dropped"]``). When the engine idles, the writer drains at normal priority,
        however busy the node is. The writer holds the GIL only between its calls (crc32 and file
        writes release it). The cost either way: bench/kv_tiers.py overhead
        (docs/performance.md)."""
        tid = self._writer_tid
        if tid is None or busy == self._yielding:
            return
        if _yield_cpu(tid, busy):
            self._yielding = busy
        else:
            self._writer_tid = None  # the priority can no longer change: normal from here

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until what was queued before this call is written (at most ``timeout`` s)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=10.0)

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        return len(self._lru) * self.entry_bytes

    # -- the writer thread ----------------------------------------------------
    def _writer(self) -> None:
        tid = threading.get_native_id()
        # Leaving SCHED_IDLE needs CAP_SYS_NICE (or a RLIMIT_NICE of 20): the writer yields while
        # the engine is busy only where it may come back, else a busy node would starve it for
        # good (the shared tier never written). Checked before, never by trying: a failed return
        # would leave it there.
        if may_raise_priority():
            self._writer_tid = tid
        while True:
            item = self._queue.get()
            if item is None:
                self._emit(self._take_removed())
                return
            if isinstance(item, threading.Event):
                self._emit(self._take_removed())
                item.set()
                continue
            events = self._take_removed()
            events += self._write(item)
            self._emit(events)

    def _take_removed(self) -> list[KVEvent]:
        with self._lock:
            keys, self._removed = self._removed, []
        return [BlockRemoved(keys, MEDIUM_SHARED)] if keys else []

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self.on_events is not None:
            try:
                self.on_events(events)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the writer
                log.exception("shared KV tier: event consumer failed")

    def _write(self, item: _Write) -> list[KVEvent]:
        try:
            if self.problem is not None:
                return []
            with self._lock:
                if item.key in self._lru:
                    return []
                evicted = self._evict_over(self.entry_bytes)
            events: list[KVEvent] = [BlockRemoved(evicted, MEDIUM_SHARED)] if evicted else []
            if not self._write_file(item):
                return events
            with self._lock:
                self._lru[item.key] = None
                self._missing.pop(item.key, None)
                self.stats["written"] += 1
            stored = BlockStored(
                [item.key],
                item.parent,
                item.token_ids,
                item.block_size,
                item.lora_id,
                MEDIUM_SHARED,
                item.lora_name,
            )
            return [*events, stored]
        finally:
            with self._lock:
                self._pending.discard(item.key)

    def _write_file(self, item: _Write) -> bool:
        path = self.path_of(item.key)
        head = shared_entry.header(self._fp, item.key, item.payload)
        try:
            path.parent.mkdir(exist_ok=True)
            _write_entry(path, (head, item.payload), self.fsync)
            return True
        except OSError as exc:
            if exc.errno in _FATAL_WRITE_ERRNOS or exc.errno in _NOT_A_DIR_ERRNOS:
                self._stop_writes(f"cannot write in {self.dir}", exc)
            else:
                log.debug("shared KV tier: writing %s failed: %s", path, exc)
            with self._lock:
                self.stats["write_errors"] += 1
            return False

    def _evict_over(self, room: int) -> list[int]:
        """Evict least recently used entries until ``room`` more bytes fit (lock held)."""
        evicted = []
        while self._lru and self.num_bytes + room > self.max_bytes:
            key, _ = self._lru.popitem(last=False)
            _unlink(self.path_of(key))
            evicted.append(key)
        self.stats["evicted"] += len(evicted)
        return evicted

    def _stop_writes(self, why: str, exc: OSError | None) -> None:
        if self.problem is not None:
            return
        detail = "" if exc is None else f": {errno.errorcode.get(exc.errno, exc.errno)} {exc}"
        self.problem = f"{why}{detail}"
        log.warning("shared KV tier: writes stopped (%s); serving goes on", self.problem)
