"""The events loop's bookkeeping over faults, iteration by iteration: exact counts of gaps, replays,
resets, rewrites and loop errors for a sequence gap, an engine restart (seq starts again at 0)
and iterations that fail. The loop's iterations are called by hand (no thread, no sleep) through
the real ZeroMQ sockets, the real writer and a real Redis."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest

from kvmesh.common import kv_events as kv
from kvmesh.common.block_keys import key_hex
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.index_writer import IndexWriter, validate_kvmesh_batch
from kvmesh.sidecar.subscriber import EventsLoop

BS = 4


class DroppingSocket:
    """The publisher's PUB socket, with a switch that loses what is sent."""

    def __init__(self, sock):
        self._sock = sock
        self.drop = False

    def send_multipart(self, frames, *args, **kw):
        if not self.drop:
            return self._sock.send_multipart(frames, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Rig:
    """A publisher (the engine), and an events loop with its writer, iterated by hand."""

    def __init__(self, redis_url: str, model: str):
        self.pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.pub._pub = DroppingSocket(self.pub._pub)
        self.cfg = SidecarConfig(
            pod_name="pod-a",
            pod_url="http://127.0.0.1:1",
            model=model,
            redis_url=redis_url,
            block_size=BS,
            kv_events_endpoint=self.pub.endpoint,
            kv_events_replay_endpoint=self.pub.replay_endpoint,
        )
        self.stats: Counter = Counter()
        self.writer = IndexWriter(self.cfg, self.stats)
        self.loop = EventsLoop(self.cfg, self.writer, self.stats)
        self.sub = self.loop.subscriber = kv.KVEventSubscriber(
            self.pub.endpoint, self.pub.replay_endpoint, validate=validate_kvmesh_batch
        )
        self.truth: set[int] = set()
        self.next_key = 1

    def publish(self) -> int:
        key = self.next_key
        self.next_key += 1
        self.truth.add(key)
        self.pub.publish([kv.BlockStored([key], None, [key] * BS, BS)])
        return key

    def in_redis(self) -> set[str]:
        return {k.decode() for k in self.writer.redis.smembers(self.writer.blocks_key)}

    def iterate_until(self, cond, tries: int = 100) -> None:
        for _ in range(tries):
            self.loop.iteration()
            if cond():
                return
        raise AssertionError("condition never met")

    def go_live(self) -> None:
        """Publish until a batch arrives live (the SUB socket is connected) and all is indexed."""
        for _ in range(100):
            self.publish()
            self.loop.iteration()
            if self.sub._last_live_seq is not None:
                break
        self.iterate_until(self.indexed)

    def indexed(self) -> bool:
        return self.in_redis() == {key_hex(k) for k in self.truth}

    def restart_engine(self) -> None:
        """A new engine incarnation on the same sockets: empty cache, seq from 0 again."""
        with self.pub._lock:
            self.pub._seq = 0
            self.pub._buffer.clear()
            self.pub._block_set = kv.PublishedBlockSet()
        self.truth.clear()

    def close(self) -> None:
        self.sub.close()
        self.writer.close()
        self.pub.close()


@pytest.fixture
def rig(redis_server, model_name):
    made = Rig(redis_server.url, model_name)
    yield made
    made.close()


def test_a_live_gap_is_one_gap_one_replay_and_one_incremental_write(rig):
    rig.go_live()
    sub0, sc0 = dict(rig.sub.stats), Counter(rig.stats)
    rig.pub._pub.drop = True
    rig.publish()
    rig.publish()
    rig.pub._pub.drop = False
    rig.publish()
    rig.iterate_until(rig.indexed)
    sub = {k: v - sub0[k] for k, v in rig.sub.stats.items()}
    assert sub == {
        "batches": 3,
        "gaps": 1,
        "gap_batches": 2,
        "replays": 1,
        "snapshots": 0,
        "gap_resets": 0,
        "replay_failures": 0,
        "resets": 0,
        "decode_errors": 0,
        "lost_batches": 0,
    }
    assert rig.stats - sc0 == Counter({"incremental_writes": 1})
    assert rig.writer.indexed_seq == rig.pub.next_seq


def test_an_engine_restart_is_one_reset_one_replay_from_zero_and_one_full_rewrite(rig):
    rig.go_live()
    sub0, sc0 = dict(rig.sub.stats), Counter(rig.stats)
    rig.restart_engine()
    key = rig.publish()  # seq 0 of the new incarnation, after a higher one: seq went backwards
    rig.iterate_until(rig.indexed)
    assert rig.in_redis() == {key_hex(key)}
    sub = {k: v - sub0[k] for k, v in rig.sub.stats.items() if v != sub0[k]}
    assert sub == {"batches": 1, "replays": 1, "resets": 1}
    assert rig.stats - sc0 == Counter({"resets": 1, "full_rewrites": 1})
    assert rig.writer.indexed_seq == 1
    # The stream goes on: the next batch is an incremental write, nothing more.
    sub0, sc0 = dict(rig.sub.stats), Counter(rig.stats)
    rig.publish()
    rig.iterate_until(rig.indexed)
    assert rig.sub.stats["batches"] - sub0["batches"] == 1
    assert rig.sub.stats["replays"] == sub0["replays"] and rig.sub.stats["gaps"] == sub0["gaps"]
    assert rig.stats - sc0 == Counter({"incremental_writes": 1})


def test_a_requested_resync_is_one_reset_and_one_replay_from_zero(rig):
    rig.go_live()
    sub0, sc0 = dict(rig.sub.stats), Counter(rig.stats)
    n = rig.pub.next_seq
    rig.loop.request_resync("engine came back after being unreachable")
    rig.loop.iteration()
    sub = {k: v - sub0[k] for k, v in rig.sub.stats.items() if v != sub0[k]}
    assert sub == {"resets": 1, "replays": 1, "batches": n}
    assert rig.stats - sc0 == Counter({"resets": 1, "full_rewrites": 1})
    assert rig.indexed()


def _run_loop(loop: EventsLoop, outcomes: list[bool]) -> None:
    """The events thread's loop body for exactly ``len(outcomes)`` iterations: True succeeds,
    False raises."""
    todo = list(outcomes)

    def iteration():
        ok = todo.pop(0)
        if not todo:
            loop._stop.set()
        if not ok:
            raise RuntimeError("planted")

    loop.iteration = iteration
    loop._stop = threading.Event()
    loop.thread = threading.current_thread()
    loop._run()


class FeedStub:
    def __init__(self):
        self.resyncs: list[str] = []

    def request_resync(self, reason: str) -> None:
        self.resyncs.append(reason)


def test_each_failed_iteration_is_one_error_one_reset_and_one_resync(model_name, caplog):
    cfg = SidecarConfig(pod_name="pod-a", pod_url="http://x", model=model_name, max_backoff=0.001)
    stats: Counter = Counter()
    writer = IndexWriter(cfg, stats)
    loop = EventsLoop(cfg, writer, stats)
    loop.subscriber = feed = FeedStub()
    try:
        writer.index.refs.update([1, 2])
        writer.dirty = False
        with caplog.at_level(logging.ERROR, logger="kvmesh.sidecar"):
            _run_loop(loop, [True, False, False, False, False, False])
        assert stats["events_loop_errors"] == 5 and len(feed.resyncs) == 5
        assert feed.resyncs[0] == "events loop failed: RuntimeError: planted"
        assert writer.dirty and not writer.index.refs
        assert loop.error == "RuntimeError: planted"
        # The first three failures in a row are logged with their traceback, then only every 100th.
        assert [r.getMessage() for r in caplog.records] == [
            f"KV-event loop failed ({n} in a row); resyncing" for n in (1, 2, 3)
        ]
        last_ok = loop.last_ok
        assert last_ok is not None  # the first iteration completed
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvmesh.sidecar"):
            _run_loop(loop, [False, False, True, False])  # a success starts the count again
        assert stats["events_loop_errors"] == 8 and len(feed.resyncs) == 8
        assert [r.getMessage() for r in caplog.records] == [
            f"KV-event loop failed ({n} in a row); resyncing" for n in (1, 2, 1)
        ]
        assert loop.last_ok > last_ok
    finally:
        writer.close()
