"""The sidecar under bad KV events and a broken events loop: counted decode errors, resyncs,
an events thread that never dies silently, and health endpoints that say so."""

from __future__ import annotations

import threading

import httpx
import msgpack
import pytest

from kvmesh.common import kv_events as kv
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.engine_load import parse_prometheus
from kvmesh.sidecar.index_writer import F_INDEX
from kvmesh.sidecar.service import Sidecar, SidecarConfig
from tests.conftest import wait_until

BS = 4


@pytest.fixture
def rig(redis_server, stub_factory, model_name):
    """A stub engine for /ready and /metrics, an in-process publisher for the KV events (so a test
    can send any bytes), and a sidecar with a health server between them."""
    (stub,) = stub_factory(model_name, 1, events=False)
    pub = kv.KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    made: list[Sidecar] = []

    def start(**kw) -> Sidecar:
        cfg = SidecarConfig(
            pod_name="pod-a",
            pod_url=stub.url,
            model=model_name,
            engine_url=stub.url,
            kv_events_endpoint=pub.endpoint,
            kv_events_replay_endpoint=pub.replay_endpoint,
            redis_url=redis_server.url,
            heartbeat_interval=0.1,
            block_size=BS,
            health_port=0,
            health_host="127.0.0.1",
            **kw,
        )
        sc = Sidecar(cfg).start()
        made.append(sc)
        return sc

    yield start, pub, redis_server.client()
    for sc in made:
        sc.stop()
    pub.close()


def _chain(model: str, first_token: int, n_blocks: int) -> tuple[list[int], list[int]]:
    tokens = list(range(first_token, first_token + n_blocks * BS))
    return tokens, block_keys(tokens, model, BS)


def _stored(model: str, first_token: int, n_blocks: int) -> tuple[kv.BlockStored, set[str]]:
    tokens, keys = _chain(model, first_token, n_blocks)
    return kv.BlockStored(keys, None, tokens, BS, None, "GPU"), {key_hex(k) for k in keys}


def _raw(pub: kv.KVEventPublisher, payload: bytes) -> int:
    with pub._lock:
        seq = pub._seq
        pub._seq += 1
        pub._buffer.append((seq, payload))
        pub._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
    return seq


def _health(sc: Sidecar, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{sc.health_port}{path}", timeout=5)


def _metric(sc: Sidecar, name: str) -> float:
    return sum(v for n, _, v in parse_prometheus(_health(sc, "/metrics").text) if n == name)


def _hb(r, model) -> dict:
    return r.hgetall(rl.heartbeat_key(model, "pod-a"))


def test_bad_batches_are_counted_and_resynced_never_stopping_the_index(rig, model_name):
    start, pub, r = rig
    sc = start()
    bkey = rl.blocks_key(model_name, "pod-a")
    wait_until(lambda: _health(sc, "/ready").status_code == 200, 10, msg="sidecar ready")
    ev_a, keys_a = _stored(model_name, 1000, 3)
    pub.publish([ev_a])
    wait_until(lambda: r.smembers(bkey) == keys_a, 5, msg="first blocks indexed")
    bad = [
        msgpack.packb([1.0, [["BlockStored", [[1, 2]], None, [1, 2, 3, 4], 4]]]),  # unhashable hash
        msgpack.packb([1.0, [["BlockTeleported", [1]]]]),  # unknown kind
        kv.encode_batch([kv.BlockStored([5], None, [1, 2, 3, 4], 4)])[:-3],  # truncated
        kv.encode_batch(
            [kv.BlockRemoved([-3])]
        ),  # decodes, but no uint64 contract key: format check
    ]
    expect_keys = keys_a
    for i, payload in enumerate(bad):
        _raw(pub, payload)
        ev, keys = _stored(model_name, 2000 + 100 * i, 2)
        pub.publish([ev])
        # Each lost batch resets the index: what is left is what came after it (a subset of the
        # engine's cache, never a block the bad batch may have removed).
        expect_keys = keys
        wait_until(lambda: r.smembers(bkey) == expect_keys, 5, msg=f"index after bad batch {i}")
        assert sc.events.subscriber.stats["lost_batches"] == i + 1
    assert sc.events.thread.is_alive()
    assert sc.events.subscriber.stats["decode_errors"] == 2 * len(
        bad
    )  # each seen live, then in the replay buffer
    assert _metric(sc, "kvmesh_sidecar_kv_event_decode_errors_total") == 2 * len(bad)
    assert _metric(sc, "kvmesh_sidecar_kv_event_lost_batches_total") == len(bad)
    assert _metric(sc, "kvmesh_sidecar_events_ok") == 1
    ready = _health(sc, "/ready")
    assert ready.status_code == 200 and "uint64" in ready.json()["last_decode_error"]
    wait_until(lambda: _hb(r, model_name).get(F_INDEX) == "ok", 5, msg="heartbeat index ok")


def test_a_failing_iteration_is_counted_and_followed_by_a_full_resync(rig, model_name, monkeypatch):
    start, pub, r = rig
    sc = start()
    bkey = rl.blocks_key(model_name, "pod-a")
    ev_a, keys_a = _stored(model_name, 1000, 3)
    pub.publish([ev_a])
    wait_until(lambda: r.smembers(bkey) == keys_a, 5, msg="first blocks indexed")
    real = sc.writer.index.stored
    calls = {"n": 0}

    def flaky(ev, added, removed):
        calls["n"] += 1
        if calls["n"] == 1:
            real(ev, added, removed)  # half applied, then a bug
            raise RuntimeError("planted index bug")
        return real(ev, added, removed)

    monkeypatch.setattr(sc.writer.index, "stored", flaky)
    ev_b, keys_b = _stored(model_name, 5000, 2)
    pub.publish([ev_b])
    # The loop survives, counts it, and rebuilds everything from a replay from 0.
    wait_until(lambda: sc.stats["events_loop_errors"] == 1, 5, msg="loop error counted")
    wait_until(lambda: r.smembers(bkey) == keys_a | keys_b, 10, msg="full resync")
    # One failure: one reset (the subscriber's, delivered to the writer) and one full rewrite more
    # (counted once the rewrite is done, a moment after Redis shows its result).
    wait_until(lambda: sc.stats["full_rewrites"] >= 2, 5, msg="the rewrite counted")
    assert sc.events.thread.is_alive() and sc.events.subscriber.stats["resets"] == 1
    assert sc.stats["resets"] == 1 and sc.stats["full_rewrites"] == 2
    assert "planted index bug" in sc.events.error
    assert _health(sc, "/health").status_code == 200
    assert _metric(sc, "kvmesh_sidecar_events_loop_errors_total") == 1


def test_dead_events_loop_fails_both_probes_and_withdraws_the_block_set(
    rig, model_name, monkeypatch
):
    start, pub, r = rig
    sc = start()
    bkey = rl.blocks_key(model_name, "pod-a")
    ev_a, keys_a = _stored(model_name, 1000, 3)
    pub.publish([ev_a])
    wait_until(lambda: r.smembers(bkey) == keys_a, 5, msg="blocks indexed")
    wait_until(lambda: _hb(r, model_name).get("num_keys") == "3", 5, msg="heartbeat with keys")
    assert _health(sc, "/health").status_code == 200 and _health(sc, "/ready").status_code == 200

    def die():
        raise SystemExit("planted: the events thread ends")

    monkeypatch.setattr(sc.events, "iteration", die)
    wait_until(lambda: not sc.events.thread.is_alive(), 5, msg="events thread gone")
    for path in ("/health", "/ready"):
        resp = _health(sc, path)
        assert resp.status_code == 503 and "events loop dead" in resp.json()["problem"], resp.text
    # The heartbeat no longer vouches for a frozen index: block set withdrawn, index=stale, no keys;
    # the engine itself stays routable by load.
    wait_until(lambda: _hb(r, model_name).get(F_INDEX) == "stale", 5, msg="heartbeat says stale")
    hb = _hb(r, model_name)
    assert not r.exists(bkey) and hb["num_keys"] == "0" and hb["state"] == "ready"
    assert _metric(sc, "kvmesh_sidecar_events_ok") == 0
    assert _metric(sc, "kvmesh_sidecar_index_withdrawals_total") == 1


def test_stale_events_loop_fails_probes_then_recovers(rig, model_name, monkeypatch):
    start, pub, r = rig
    sc = start(events_stale_after=0.5)
    bkey = rl.blocks_key(model_name, "pod-a")
    ev_a, keys_a = _stored(model_name, 1000, 2)
    pub.publish([ev_a])
    wait_until(lambda: r.smembers(bkey) == keys_a, 5, msg="blocks indexed")
    release = threading.Event()
    real = sc.events.iteration
    monkeypatch.setattr(sc.events, "iteration", lambda: release.wait(30) and real())
    resp = wait_until(
        lambda: (lambda x: x if x.status_code == 503 else None)(_health(sc, "/health")),
        5,
        msg="liveness fails while stuck",
    )
    assert "stale" in resp.json()["problem"] and sc.events.thread.is_alive()
    wait_until(
        lambda: not r.exists(bkey) and _hb(r, model_name).get(F_INDEX) == "stale",
        5,
        msg="withdrawn",
    )
    ev_b, keys_b = _stored(model_name, 3000, 2)
    pub.publish([ev_b])  # arrives while stuck: not lost
    release.set()
    wait_until(lambda: _health(sc, "/health").status_code == 200, 5, msg="live again")
    wait_until(lambda: r.smembers(bkey) == keys_a | keys_b, 5, msg="block set rewritten")
    wait_until(lambda: _hb(r, model_name).get(F_INDEX) == "ok", 5, msg="index ok again")


def test_readiness_waits_for_the_first_catch_up(redis_server, model_name):
    cfg = SidecarConfig(
        pod_name="pod-a",
        pod_url="http://127.0.0.1:1",
        model=model_name,
        engine_url="http://127.0.0.1:1",
        kv_events_endpoint="tcp://127.0.0.1:1",
        kv_events_replay_endpoint=None,
        redis_url=redis_server.url,
        health_port=0,
        health_host="127.0.0.1",
    )
    sc = Sidecar(cfg)
    sc.cfg.health_port = 0
    try:
        sc.start()
        wait_until(lambda: sc.events.subscriber.caught_up, 5, msg="first poll")
        assert _health(sc, "/ready").status_code == 200
        assert _health(sc, "/nope").status_code == 404
    finally:
        sc.stop()
