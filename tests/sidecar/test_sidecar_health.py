"""The sidecar's probes and metrics (sidecar/health.py) pinned exactly over a stand-in sidecar: which
problem fails liveness and readiness, the probes' JSON body field by field, every metric's name,
help and value, and the HTTP server's paths, statuses and headers."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest

from kvmesh.sidecar import health
from kvmesh.sidecar.health import (
    SERVICE_COUNTERS,
    SUBSCRIBER_COUNTERS,
    HealthServer,
    detail,
    liveness,
    metrics_registry,
    readiness,
)


def sidecar(
    events_problem=None,
    heartbeat_problem=None,
    caught_up=True,
    subscriber=True,
    last=None,
    engine_problem=None,
    replay_problem=None,
):
    sub = (
        SimpleNamespace(
            stats={"batches": 3, "gaps": 1},
            last_decode_error="bad msgpack",
            replay_problem=replay_problem,
        )
        if subscriber
        else None
    )
    events = SimpleNamespace(
        subscriber=sub,
        problem=lambda: events_problem,
        last_ok=last,
        caught_up=caught_up,
        error="replay timed out",
    )
    return SimpleNamespace(
        events=events,
        heartbeat=SimpleNamespace(
            problem=lambda: heartbeat_problem, state="ready", engine_problem=engine_problem
        ),
        writer=SimpleNamespace(
            index=SimpleNamespace(refs={1: 1, 2: 2}), withdrawn=False, dirty=True, indexed_seq=41
        ),
        stats=Counter(heartbeats=7, redis_errors=2),
        cfg=SimpleNamespace(pod_name="pod-a"),
    )


def test_liveness_fails_on_either_loops_problem_the_events_loops_first():
    assert liveness(sidecar())[0] is True
    for sc, problem in [
        (sidecar(events_problem="events loop stale"), "events loop stale"),
        (sidecar(heartbeat_problem="heartbeat loop dead"), "heartbeat loop dead"),
        (sidecar("events loop dead", "heartbeat loop dead"), "events loop dead"),
    ]:
        ok, body = liveness(sc)
        assert ok is False and body["problem"] == problem and body["status"] == "unhealthy"


def test_readiness_also_waits_for_the_first_catch_up():
    assert readiness(sidecar())[0] is True
    ok, body = readiness(sidecar(caught_up=False))
    assert ok is False and body["problem"] == "catching up with the engine's KV events"
    assert body["status"] == "ok"  # alive: only not ready yet
    ok, body = readiness(sidecar(events_problem="events loop stale", caught_up=False))
    assert ok is False and body["problem"] == "events loop stale"  # the liveness problem first


def test_the_probes_body_field_by_field():
    body = detail(sidecar(last=time.monotonic() - 5), None)
    age = body.pop("events_loop_age_s")
    assert 5 <= age < 6 and round(age, 3) == age
    assert body == {
        "status": "ok",
        "problem": None,
        "pod": "pod-a",
        "block_keys": 2,
        "index_withdrawn": False,
        "redis_dirty": True,
        "indexed_seq": 41,
        "engine_state": "ready",
        "engine_problem": None,
        "events_problem": None,
        "last_decode_error": "bad msgpack",
        "last_events_error": "replay timed out",
        "stats": {"batches": 3, "gaps": 1, "heartbeats": 7, "redis_errors": 2},
    }
    # why the engine or its events cannot be read: said, without failing the sidecar's own probes
    said = sidecar(engine_problem="GET /ready: 404", replay_problem="the replay socket is silent")
    ok, body = readiness(said)
    assert ok is True and body["problem"] is None
    assert body["engine_problem"] == "GET /ready: 404"
    assert body["events_problem"] == "the replay socket is silent"
    bare = detail(sidecar(subscriber=False), "events loop dead")
    assert bare["events_loop_age_s"] is None and bare["last_decode_error"] is None
    assert bare["events_problem"] is None
    assert bare["stats"] == {"heartbeats": 7, "redis_errors": 2}
    assert (bare["status"], bare["problem"]) == ("unhealthy", "events loop dead")


def samples(sc) -> dict[str, tuple[str, float]]:
    """Each metric family: (its help, its one sample's value)."""
    return {m.name: (m.documentation, m.samples[0].value) for m in metrics_registry(sc).collect()}


def test_every_metric_its_name_help_and_value():
    got = samples(sidecar(events_problem="stale", last=time.monotonic() - 2))
    age = got.pop("kvmesh_sidecar_events_loop_age_seconds")
    assert age[0] == "seconds since the last completed events iteration" and 2 <= age[1] < 3
    sub = {"batches": 3, "gaps": 1}
    service = {"heartbeats": 7, "redis_errors": 2}
    want = {f"kvmesh_sidecar_kv_event_{k}": (h, sub.get(k, 0)) for k, h in SUBSCRIBER_COUNTERS}
    want |= {f"kvmesh_sidecar_{k}": (h, service.get(k, 0)) for k, h in SERVICE_COUNTERS}
    want["kvmesh_sidecar_block_keys"] = ("block keys in the index", 2)
    want["kvmesh_sidecar_events_ok"] = ("1 if the events loop is alive and current", 0)
    assert got == want
    fine = samples(sidecar(subscriber=False))
    assert fine["kvmesh_sidecar_events_ok"][1] == 1
    assert fine["kvmesh_sidecar_events_loop_age_seconds"][1] == -1  # never completed
    assert fine["kvmesh_sidecar_kv_event_batches"][1] == 0  # no subscriber yet


STATES = {  # name: (the sidecar, alive, ready)
    "fine": (sidecar(), True, True),
    "catching up": (sidecar(caught_up=False), True, False),
    "stale": (sidecar(events_problem="events loop stale"), False, False),
}


@pytest.fixture
def urls():
    """One server per state, for one test (a server's stop waits out its half-second poll)."""
    servers = {name: HealthServer(sc, "127.0.0.1", 0).start() for name, (sc, *_) in STATES.items()}
    yield {name: f"http://127.0.0.1:{srv.port}" for name, srv in servers.items()}
    for srv in servers.values():
        srv.stop()


PATHS = ["/health", "/healthz", "/livez?verbose=1", "/ready", "/readyz?a=1?b=2"]


def test_every_probe_path_in_every_state_metrics_and_an_unknown_path(urls):
    for state, (sc, alive, ready) in STATES.items():
        for path in PATHS:
            resp = httpx.get(urls[state] + path, timeout=5)
            ok = ready if path.startswith("/ready") else alive
            assert resp.status_code == (200 if ok else 503), (state, path)
            assert resp.headers["content-type"] == "application/json"
            assert int(resp.headers["content-length"]) == len(resp.content)
            want = (readiness if path.startswith("/ready") else liveness)(sc)[1]
            assert json.loads(resp.content) == {**want, "events_loop_age_s": None}
    resp = httpx.get(urls["fine"] + "/metrics", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "kvmesh_sidecar_heartbeats_total 7.0" in resp.text.splitlines()
    resp = httpx.get(urls["fine"] + "/health/x", timeout=5)
    assert (resp.status_code, resp.json()) == (404, {"error": "not found"})
    assert resp.headers["content-type"] == "application/json"


def test_the_server_never_holds_the_process_up():
    srv = HealthServer(sidecar(), "127.0.0.1", 0)
    assert srv.server.daemon_threads is True  # request threads
    before = set(threading.enumerate())
    srv.start()
    try:
        [thread] = set(threading.enumerate()) - before
        assert thread.name == "sidecar-health" and thread.daemon
    finally:
        srv.stop()


def test_ages_are_rounded_to_the_millisecond(monkeypatch):
    monkeypatch.setattr(health.time, "monotonic", lambda: 1000.1234567)
    sc = sidecar(last=990.0)
    assert detail(sc, None)["events_loop_age_s"] == 10.123
    assert samples(sc)["kvmesh_sidecar_events_loop_age_seconds"][1] == 10.123
