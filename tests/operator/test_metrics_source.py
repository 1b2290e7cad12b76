"""Reading KV utilisation from the sidecars' heartbeats in a real Redis."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from kvmesh.operator.metrics_source import (
    RedisHeartbeats,
    Snapshot,
    demand_key,
    heartbeat_key,
    pods_key,
)

MODEL = "m-test"


@pytest.fixture()
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.flushdb()
    await client.aclose()


async def beat(r, pod, kv, state="ready", ts=None):
    await r.sadd(pods_key(MODEL), pod)
    await r.hset(
        heartbeat_key(MODEL, pod),
        mapping={
            "url": f"http://{pod}:8000",
            "model": MODEL,
            "kv_usage": kv,
            "running": 3,
            "waiting": 1,
            "total_blocks": 512,
            "state": state,
            "ts": time.time() if ts is None else ts,
        },
    )
    await r.expire(heartbeat_key(MODEL, pod), 10)


async def test_layout_matches_contract():
    assert pods_key("m") == "kvmesh:v1:m:pods"
    assert heartbeat_key("m", "p-1") == "kvmesh:v1:m:pod:p-1"


async def test_mean_of_ready_pods_only(r, redis_url):
    await beat(r, "md-engine-a", 0.2)
    await beat(r, "md-engine-b", 0.6)
    await beat(r, "md-engine-c", 0.99, state="draining")  # excluded
    await beat(r, "md-engine-d", 0.9, ts=time.time() - 60)  # stale: excluded
    await r.sadd(pods_key(MODEL), "md-engine-gone")  # in the set, heartbeat expired: excluded
    await beat(r, "other-engine-x", 1.0)  # another deployment: filtered by prefix
    source = RedisHeartbeats(redis_url)
    try:
        snap = await source.snapshot(MODEL, "md-engine-")
        assert sorted(h.pod for h in snap.ready) == ["md-engine-a", "md-engine-b"]
        assert [h.pod for h in snap.draining] == ["md-engine-c"]
        assert snap.kv_utilization == pytest.approx(0.4)
        assert snap.ready[0].total_blocks == 512 and snap.ready[0].running == 3
        assert (await source.snapshot(MODEL)).kv_utilization == pytest.approx((0.2 + 0.6 + 1.0) / 3)
        assert (await source.snapshot("no-such-model")).kv_utilization is None
    finally:
        await source.close()


def test_empty_snapshot_has_no_utilisation():
    assert Snapshot().kv_utilization is None


async def test_unreachable_redis_raises():
    source = RedisHeartbeats("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(Exception):
            await source.snapshot(MODEL)
    finally:
        await source.close()


async def test_cached_blocks_and_demand(r, redis_url):
    await beat(r, "md-engine-a", 0.25)  # no num_keys: the used share of the cache
    await r.hset(
        heartbeat_key(MODEL, "md-engine-b"),
        mapping={
            "url": "http://b:8000",
            "kv_usage": 0.5,
            "total_blocks": 512,
            "state": "ready",
            "ts": time.time(),
            "num_keys": 300,
        },
    )
    await r.sadd(pods_key(MODEL), "md-engine-b")
    source = RedisHeartbeats(redis_url)
    try:
        snap = {h.pod: h for h in (await source.snapshot(MODEL, "md-engine-")).ready}
        assert snap["md-engine-a"].num_keys is None and snap["md-engine-a"].cached_blocks == 128
        assert snap["md-engine-b"].cached_blocks == 300
        assert await source.demand(MODEL) is None
        await r.set(demand_key(MODEL), "1700000000.5", ex=60)  # what a holding router writes
        assert await source.demand(MODEL) == 1700000000.5
        assert await source.demand("other-model") is None
    finally:
        await source.close()


async def test_a_restarted_redis_costs_no_failed_read(own_redis):
    """Redis restarted (or failed over) between two scaling ticks: the pooled connections are
    dead, and each is reconnected on first use, so the next tick reads (it would hold, logging a
    failure, without the retry)."""
    import asyncio

    source = RedisHeartbeats(own_redis.url)
    try:
        await asyncio.gather(
            *[source.snapshot(MODEL) for _ in range(4)]
        )  # several pooled connections
        own_redis.kill()
        own_redis.start()
        snaps = await asyncio.gather(*[source.snapshot(MODEL) for _ in range(4)])
        assert [s.kv_utilization for s in snaps] == [None] * 4  # read, and empty: a fresh Redis
        assert await source.demand(MODEL) is None
    finally:
        await source.close()


def commands_served(r) -> int:
    """Commands Redis has run (INFO commandstats), the INFO calls themselves left out."""
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


async def test_junk_in_redis_costs_a_snapshot_bounded_work(own_redis):
    """100k ghost names and 20k fake heartbeats (some under the deployment's prefix): a snapshot
    runs a bounded number of commands, the listed pods are read by name whatever the set holds,
    and an unlisted replica's heartbeat (busy, not yet listed) is found within a few snapshots."""
    from kvmesh.operator import metrics_source as ms

    r = own_redis.client()
    pipe = r.pipeline(transaction=False)
    for i in range(0, 100_000, 5000):
        prefix = "md-engine-ghost-" if i < 10_000 else "ghost-"
        pipe.sadd(pods_key(MODEL), *[f"{prefix}{j}" for j in range(i, i + 5000)])
    for i in range(20_000):
        name = f"md-engine-fake-{i}" if i < 5000 else f"fake-{i}"
        pipe.sadd(pods_key(MODEL), name)
        pipe.hset(
            heartbeat_key(MODEL, name),
            mapping={
                "url": f"http://{name}:8000",
                "state": "ready",
                "kv_usage": 1.0,
                "ts": time.time() + 3600,
            },
        )
    pipe.execute()
    client = aioredis.Redis.from_url(own_redis.url)
    for pod in ("md-engine-a", "md-engine-b", "md-engine-unlisted"):
        await beat(client, pod, 0.5)
    await client.aclose()
    source = RedisHeartbeats(own_redis.url)
    try:
        found_unlisted = None
        for n in range(1, 12):
            before = commands_served(r)
            snap = await source.snapshot(MODEL, "md-engine-", ["md-engine-a", "md-engine-b"])
            used = commands_served(r) - before
            # the sweep's pages and a bounded set of heartbeats (in READ_BATCH round trips), not 15k
            assert used <= ms.SWEEP_PAGES + ms.TRACKED_PODS + 2 + 5, (
                used
            )  # (+ a new connection's setup)
            assert {"md-engine-a", "md-engine-b"} <= {h.pod for h in snap.ready}
            assert not any(
                h.pod.startswith(("fake-", "ghost-")) for h in snap.ready
            )  # filtered by Redis
            if found_unlisted is None and "md-engine-unlisted" in {h.pod for h in snap.ready}:
                found_unlisted = n
        assert found_unlisted is not None and found_unlisted <= 10
    finally:
        await source.close()
