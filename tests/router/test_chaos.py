"""Chaos on loopback: two stub engines (separate processes, each with its own
sidecar process) behind a router process, a real redis-server; streams in flight while (a) one
engine is SIGKILLed (its container then restarts), (b) Redis is SIGKILLed and restarted empty
(at once, and after an outage the router notices), (c) the router restarts (SIGTERM, then a new
process on the same port). The scenario is tests/support/chaos/faults.py (bench/chaos.py runs it
larger); each figure it reports is asserted here."""

from __future__ import annotations

import asyncio
import signal

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh_testing.chaos import ChaosConfig, MeshConfig, run_chaos
from tests.conftest import wait_until


def test_chaos_loses_no_request_and_recovers_keys_and_routing():
    cfg = ChaosConfig(
        workers=6,
        families=6,
        requests_after_fault=6,
        deadline=20.0,
        mesh=MeshConfig(engines=2, response_tokens=16, token_delay=0.04),
    )
    rep = asyncio.run(run_chaos(cfg))
    print("\n".join(rep.lines()))
    assert rep.sent > 0 and rep.completed > 0

    # Never a hang, never a stream cut short silently (every "ok" answer has all its tokens).
    assert [r.short() for r in rep.hangs] == []
    assert [r.short() for r in rep.truncated] == []

    # (a) Nothing lost: the streams in flight on the killed engine go on with the other one
    # (router/resume.py), each with all its tokens once (an "ok" stream has exactly its count).
    assert rep.killed == "pod-0"
    assert any(r.stream for r in rep.in_flight_on_killed), (
        "no stream was in flight on the killed engine"
    )
    assert all(r.ok for r in rep.in_flight_on_killed), [r.short() for r in rep.in_flight_on_killed]
    assert [r.short() for r in rep.lost] == []
    # After the fault nothing fails: a request the router sends to the dead engine before it
    # drops it fails to connect and is retried on the other.
    assert [r.short() for r in rep.failed_after_fault] == []
    assert [r.short() for r in rep.failed_after_seen] == []
    assert rep.seen_after_s < 10

    # (b) Redis restarted empty, twice: every request served, every block key written again by
    # the sidecars (exactly the engines' caches, at least what Redis held when it died).
    assert [f.name for f in rep.redis] == ["restarted at once", "down, then restarted"]
    for f in rep.redis:
        assert [r.short() for r in f.failed] == [], f.name
        assert f.keys_before > 0
        assert f.keys_restored == f.keys_expected, f.name
        assert f.keys_restored >= f.keys_before, f.name
        assert f.restored_after_s < 10, f.name
    assert rep.redis[1].served_while_down >= cfg.requests_after_fault

    # (c) Router restart: it drains (every request in flight completes) and exits on its own; a
    # client meanwhile finds nothing listening (never an accepted request dropped); the new
    # router serves every request.
    assert rep.router_exit_code in (0, -signal.SIGTERM), rep.router_log_tail
    assert rep.router_in_flight >= 1
    assert rep.router_in_flight_ok == rep.router_in_flight
    assert [r.short() for r in rep.router_failed] == []

    # Prefix routing resumes after each fault: each family's follow-up goes to the pod holding it.
    assert [c.when for c in rep.routing] == [
        "before the Redis restarts",
        "after the Redis restarts",
        "after the router restart",
    ]
    for c in rep.routing:
        assert c.ok == c.probes == cfg.families, c.line()
        assert c.same_pod == c.probes, c.line()
        assert c.prefix_match == c.probes, (c.line(), c.reasons, c.redis_errors)

    # Nothing raised out of the ASGI app, in either router process.
    assert rep.internal_errors == 0
    assert rep.asgi_tracebacks == 0
    assert rep.problems() == []


def test_a_block_set_redis_lost_without_an_error_is_rewritten(own_redis, mesh, model_name):
    """Regression: redis-py reconnects transparently, so a Redis restarted empty between two
    writes (or flushed) raised nothing in the sidecar, which never rewrote its block set: prefix
    routing was lost for good. The heartbeat now compares the set with the index."""
    stubs, sidecars = mesh(1, redis=own_redis)
    r = own_redis.client()
    key = rl.blocks_key(model_name, "pod-0")
    for i in range(4):
        resp = httpx.post(
            stubs[0].url + "/v1/completions",
            json={"prompt": f"request {i} " * 60, "max_tokens": 1},
            timeout=10,
        )
        assert resp.status_code == 200
    cached = stubs[0].stats()["cache_blocks"]
    assert cached > 0
    wait_until(lambda: r.scard(key) == cached, 10, msg="the block set in Redis")

    r.flushall()  # the set is gone; no write of the sidecar fails
    wait_until(lambda: r.scard(key) == cached, 10, msg="the block set rewritten after a flush")
    assert sidecars[0].stats["block_set_repairs"] >= 1

    own_redis.kill()
    own_redis.start()  # empty, on the same port, before the next heartbeat
    r = own_redis.client()
    wait_until(lambda: r.scard(key) == cached, 10, msg="the block set rewritten after a restart")
    wait_until(
        lambda: r.exists(rl.heartbeat_key(model_name, "pod-0")), 10, msg="the heartbeat back"
    )
