"""Contract 3: the one heartbeat reader (kvmesh.common.redis_layout.read_heartbeats), used by
the router's discovery, the operator's metrics source, `kvmesh status` and `kvmesh up
--autoscale`, on a real Redis, with a sync and an asyncio client."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis

from kvmesh.common import redis_layout as rl


def beat(r, model, pod, **fields):
    hb = rl.Heartbeat(pod=pod, url=f"http://{pod}:8000", model=model, **fields)
    r.sadd(rl.pods_key(model), pod)
    r.hset(rl.heartbeat_key(model, pod), mapping=hb.to_mapping())
    return hb


def read_async(url, *args, **kw):
    async def go():
        client = aioredis.Redis.from_url(url)
        try:
            return await rl.read_heartbeats(client, *args, **kw)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_sync_and_asyncio_clients_read_the_same_heartbeats(redis_server, model_name):
    r = redis_server.client()
    a = beat(
        r,
        model_name,
        "md-engine-b",
        kv_usage=0.5,
        running=2,
        waiting=1,
        total_blocks=64,
        ts=1000.0,
        num_keys=7,
    )
    b = beat(r, model_name, "md-engine-a", state=rl.STATE_DRAINING, ts=1000.0)
    r.sadd(rl.pods_key(model_name), "md-engine-gone")  # registered, hash expired: dead
    beat(r, model_name, "other-x", ts=1000.0)
    want = {
        "md-engine-a": b,
        "md-engine-b": a,
        "md-engine-gone": None,
        "other-x": rl.Heartbeat(
            pod="other-x", url="http://other-x:8000", model=model_name, ts=1000.0
        ),
    }
    for client in (r, redis.Redis.from_url(redis_server.url)):  # str and bytes answers
        got = rl.read_heartbeats(client, model_name)
        assert got == want and list(got) == sorted(want)  # sorted by pod name
    assert read_async(redis_server.url, model_name) == want
    assert list(read_async(redis_server.url, model_name, prefix="md-engine-")) == [
        "md-engine-a",
        "md-engine-b",
        "md-engine-gone",
    ]
    # given names: in the given order, the pods set not consulted
    assert list(rl.read_heartbeats(r, model_name, ["md-engine-b", "not-registered"]).items()) == [
        ("md-engine-b", a),
        ("not-registered", None),
    ]
    assert (
        rl.read_heartbeats(r, "no-such-model")
        == {}
        == read_async(redis_server.url, "no-such-model")
    )
    assert rl.read_heartbeats(r, model_name, []) == {}


def test_optional_num_keys_and_freshness():
    hb = rl.Heartbeat.from_mapping(
        "p", {"url": "u", "kv_usage": "0.25", "total_blocks": "512", "ts": "100"}
    )
    assert hb.num_keys is None and hb.cached_blocks == 128  # estimated from the KV usage
    assert "num_keys" not in rl.Heartbeat(pod="p", url="u").to_mapping()
    hb.num_keys = 300
    assert (
        hb.cached_blocks == 300 and rl.Heartbeat.from_mapping("p", hb.to_mapping()).num_keys == 300
    )
    assert hb.fresh(100 + rl.HEARTBEAT_TTL_S) and not hb.fresh(100.001 + rl.HEARTBEAT_TTL_S)
    assert hb.fresh(104, max_age=4) and not hb.fresh(104.5, max_age=4)
    assert rl.Heartbeat(pod="p", url="u").fresh(time.time())  # written now


def test_the_pods_set_is_walked_in_bounded_pages(redis_server, model_name):
    """PodsSetCursor: one SSCAN page per call, resuming where the last stopped; a whole pass
    visits every name once; a prefix is a literal (glob characters in it match only themselves)."""
    r = redis_server.client()
    names = [f"md-engine-{i:04d}" for i in range(1000)] + ["md*engine-x", "other-1"]
    r.sadd(rl.pods_key(model_name), *names)
    cursor, seen, sizes = rl.PodsSetCursor(model_name, page=100), [], []
    while True:
        page = cursor.next_page(r)
        seen += page
        sizes.append(len(page))
        if cursor.pass_done:
            break
    assert sorted(seen) == sorted(names) and cursor.passes == 1
    assert (
        len(sizes) >= 8 and max(sizes) <= 200
    )  # about `page` names per round trip, never the whole set
    stars = rl.PodsSetCursor(model_name, prefix="md*", page=5000)
    assert stars.next_page(r) == ["md*engine-x"] and stars.pass_done
    with_prefix = read_async(redis_server.url, model_name, prefix="md-engine-00")
    assert list(with_prefix) == [f"md-engine-{i:04d}" for i in range(100)]
    some = list(rl.read_heartbeats(r, model_name, limit=10))  # stops after the page that reached 10
    assert len(some) == 10 and some == sorted(some) and set(some) <= set(names)


def test_many_names_are_read_in_batches_not_one_reply(redis_server, model_name):
    r = redis_server.client()
    for i in range(3):
        beat(r, model_name, f"p-{i}", ts=1000.0)
    names = [f"p-{i}" for i in range(rl.READ_BATCH * 2 + 7)]
    calls = []
    real = r.pipeline

    def counting_pipeline(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    r.pipeline = counting_pipeline
    got = rl.read_heartbeats(r, model_name, names)
    assert list(got) == names and sum(hb is not None for hb in got.values()) == 3
    assert len(calls) == 3  # READ_BATCH names per pipelined round trip
