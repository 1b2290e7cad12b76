"""The shared KV store: round trips across replicas, every bad file a miss, LRU, a failing disk."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

from kvmesh.common.kv_events import BlockRemoved, BlockStored
from kvmesh.engine.kv_offload import shared_entry, shared_store
from kvmesh.engine.kv_offload.shared_store import SharedKVStore, store_fingerprint

BLOCK = 256
ENTRY = shared_entry.HEADER.size + BLOCK
FP = store_fingerprint("tiny-llama", "float32", 4, (2, 8, 4, 8))


def payload(key: int) -> bytes:
    return bytes((key * 7 + i) % 251 for i in range(BLOCK))


class Events(list):
    def __call__(self, events):
        self.extend(events)


@pytest.fixture
def stores(tmp_path):
    opened = []

    def make(root=tmp_path, fingerprint=FP, max_bytes=100 * ENTRY, **kw):
        store = SharedKVStore(str(root), fingerprint, BLOCK, max_bytes, **kw)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def put(store, key, parent=None, data=None):
    tokens = [key, key + 1, key + 2, key + 3]
    return store.write_behind(key, parent, tokens, 4, None, None, data or payload(key))


def test_round_trip_and_events(stores):
    events = Events()
    store = stores(on_events=events)
    assert not store.contains(1)
    assert put(store, 1) and put(store, 2, parent=1)
    assert not put(store, 1)  # queued already: skipped
    store.flush()
    assert store.contains(1) and store.read(1) == payload(1) and store.read(2) == payload(2)
    assert store.path_of(1).parent.name == "00" and store.path_of(1).parent.parent.name == FP
    assert events == [
        BlockStored([1], None, [1, 2, 3, 4], 4, None, "SHARED", None),
        BlockStored([2], 1, [2, 3, 4, 5], 4, None, "SHARED", None),
    ]
    assert store.stats["written"] == 2 and store.stats["read_hits"] == 2
    assert not put(store, 1)  # held: skipped
    assert store.read(3) is None and store.stats["read_misses"] == 1


def test_fingerprint_names_every_layout_detail():
    base = ("m", "float32", 16, (2, 4, 16, 8))
    variants = [
        ("n", "float32", 16, (2, 4, 16, 8)),
        ("m", "bfloat16", 16, (2, 4, 16, 8)),
        ("m", "float32", 8, (2, 4, 16, 8)),
        ("m", "float32", 16, (2, 4, 16, 16)),
    ]
    fps = {store_fingerprint(*v) for v in [base, *variants]}
    assert len(fps) == 5 and store_fingerprint(*base) == store_fingerprint(*base)


def test_another_replica_reads_what_one_wrote(stores):
    a, b = stores(), stores()
    b.negative_ttl_s = 0.0
    assert not b.contains(5)
    put(a, 5)
    a.flush()
    assert b.contains(5) and b.read(5) == payload(5)
    c = stores()  # started after the write: found by the scan
    assert c.num_blocks == 1 and c.read(5) == payload(5)


def test_a_miss_is_believed_for_a_short_time(stores):
    a, b = stores(), stores()
    b.negative_ttl_s = 3600.0
    assert not b.contains(5)
    put(a, 5)
    a.flush()
    assert not b.contains(5)  # cached negatively: no stat per lookup
    assert b.read(5) == payload(5)  # a read still looks


def _corrupt_payload(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[30] ^= 0x80  # inside the key
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: ENTRY - 1])


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_corrupt_payload, _corrupt_header, _truncate, _empty])
def test_a_damaged_entry_is_a_miss_and_removed(stores, damage):
    events = Events()
    store = stores(on_events=events)
    put(store, 7)
    store.flush()
    path = store.path_of(7)
    damage(path)
    assert store.read(7) is None
    assert not path.exists()
    assert store.stats["corrupt"] + store.stats["read_misses"] == 1
    assert not store.contains(7)
    store.flush()
    assert events[-1] == BlockRemoved([7], "SHARED")
    assert put(store, 7)  # written again
    store.flush()
    assert store.read(7) == payload(7)


def test_a_wrong_sized_entry_is_not_listed(stores):
    store = stores()
    store.negative_ttl_s = 0.0
    path = store.path_of(9)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * (ENTRY + 1))
    assert not store.contains(9) and store.read(9) is None and not path.exists()


def test_another_fingerprints_entry_is_never_read(stores, tmp_path):
    other = store_fingerprint("tiny-llama", "float32", 8, (2, 8, 8, 8))
    a = stores(fingerprint=other)
    put(a, 11)
    a.flush()
    b = stores()
    b.negative_ttl_s = 0.0
    assert not b.contains(11) and b.read(11) is None
    # the same file copied under this fingerprint's directory: its header says otherwise
    path = b.path_of(11)
    path.parent.mkdir(parents=True)
    path.write_bytes(a.path_of(11).read_bytes())
    assert b.contains(11)  # the right size; the read checks the header
    assert b.read(11) is None and b.stats["corrupt"] == 1 and not path.exists()
    assert a.read(11) == payload(11)


def test_a_killed_writers_temp_file_is_never_read(stores):
    store = stores()
    store.negative_ttl_s = 0.0
    path = store.path_of(13)
    path.parent.mkdir(parents=True)
    tmp = path.with_name(f".tmp-{path.name}-1-2")
    tmp.write_bytes(shared_entry.encode(bytes.fromhex(FP), 13, payload(13))[:100])
    assert not store.contains(13) and store.read(13) is None
    os.utime(tmp, (0, 0))  # old: the next start-up scan removes it
    again = stores()
    assert again.num_blocks == 0 and not tmp.exists() and again.read(13) is None


def test_two_writers_of_one_key_leave_a_whole_entry(stores):
    a, b, reader = stores(), stores(), stores()
    reader.negative_ttl_s = 0.0
    stop = threading.Event()
    bad = []

    def read_loop():
        while not stop.is_set():
            for key in range(8):
                got = reader.read(key)
                if got is not None and got != payload(key):
                    bad.append(key)

    def write_loop(store):
        for _ in range(40):
            for key in range(8):
                store._write_file(shared_store._Write(key, None, [], 4, None, None, payload(key)))

    threads = [threading.Thread(target=read_loop)]
    threads += [threading.Thread(target=write_loop, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad and reader.stats["corrupt"] == 0
    assert all(reader.read(k) == payload(k) for k in range(8))
    assert not [p for p in reader.dir.rglob(".tmp-*")]


def test_lru_bound_and_events(stores):
    events = Events()
    store = stores(max_bytes=3 * ENTRY, on_events=events)
    for key in (1, 2, 3):
        put(store, key)
    store.flush()
    assert store.read(1) == payload(1)  # 1 is now the most recently used: 2 goes first
    put(store, 4)
    put(store, 5)
    store.flush()
    assert store.num_bytes <= 3 * ENTRY
    on_disk = sorted(int(p.name, 16) for p in store.dir.rglob("*") if p.is_file())
    assert on_disk == [1, 4, 5]
    assert events[3:] == [
        BlockRemoved([2], "SHARED"),
        BlockStored([4], None, [4, 5, 6, 7], 4, None, "SHARED", None),
        BlockRemoved([3], "SHARED"),
        BlockStored([5], None, [5, 6, 7, 8], 4, None, "SHARED", None),
    ]
    assert store.stats["evicted"] == 2
    smaller = stores(max_bytes=2 * ENTRY)  # a smaller limit at start: the oldest go
    assert smaller.num_blocks == 2 and smaller.num_bytes <= 2 * ENTRY


def test_queue_full_drops_and_counts(stores, monkeypatch):
    gate = threading.Event()
    real = shared_store._write_entry
    monkeypatch.setattr(shared_store, "_write_entry", lambda *a: (gate.wait(10), real(*a))[1])
    store = stores(queue_max=2)
    results = [put(store, key) for key in range(6)]
    assert results.count(False) >= 3 and store.stats["dropped"] == results.count(False)
    gate.set()
    store.flush()
    assert store.stats["written"] == results.count(True)


def _unwritable_root(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root: permissions do not bind
        locked.chmod(0o700)
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "kv"
    return locked


def test_an_unwritable_directory_turns_writes_off(stores, tmp_path, caplog):
    root = _unwritable_root(tmp_path)
    with caplog.at_level(logging.WARNING, logger=shared_store.__name__):
        store = stores(root=root)
    assert store.problem and "writes stopped" in caplog.text
    assert not put(store, 1)
    store.flush()
    assert store.read(1) is None and not store.contains(1)
    (tmp_path / "locked").chmod(0o700)


def test_a_read_only_store_is_still_read(stores, tmp_path):
    writer = stores()
    put(writer, 3)
    writer.flush()
    dirs = [writer.dir, *writer.dir.iterdir()]
    for d in dirs:
        d.chmod(0o500)
    try:
        if os.access(writer.dir, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        reader = stores()
        assert reader.problem and reader.read(3) == payload(3)
        assert not put(reader, 4)
    finally:
        for d in dirs:
            d.chmod(0o700)


def test_a_full_disk_turns_writes_off_once(stores, monkeypatch, caplog):
    store = stores()
    put(store, 1)
    store.flush()

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_store, "_write_entry", full)
    with caplog.at_level(logging.WARNING, logger=shared_store.__name__):
        put(store, 2)
        store.flush()
        assert not put(store, 3)
    assert store.problem and "ENOSPC" in store.problem and str(store.dir) in store.problem
    assert caplog.text.count("writes stopped") == 1
    assert store.read(1) == payload(1) and store.read(2) is None
    assert store.stats["write_errors"] == 1


def test_the_writer_yields_while_the_engine_is_busy_and_drains_at_normal_priority(stores):
    store = stores()
    store.flush()  # the writer has started (and found whether it may change its priority)
    tid = store._writer_tid
    if tid is None:
        pytest.skip("this process may not raise a thread's priority back (no CAP_SYS_NICE)")
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    store.engine_busy(True)
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    store.engine_busy(True)  # no change, no call
    store.engine_busy(False)
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    # writes still go through at either priority
    store.engine_busy(True)
    assert put(store, 5)
    store.flush()
    assert store.read(5) == payload(5)


@pytest.mark.parametrize(
    "caps,allowed",
    [("0000003fffffffff", True), ("0000000000000000", False), ("0000000000800000", True)],
)
def test_the_writer_yields_only_where_it_may_come_back(tmp_path, monkeypatch, caps, allowed):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (0, 0))
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapEff:\t{caps}\n")
    assert shared_store.may_raise_priority(str(status)) is allowed
