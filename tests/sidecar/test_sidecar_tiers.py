"""The sidecar's index per KV tier: host-tier and shared-tier events -> their Redis sets.

A real redis-server, no engine: events built here (kvmesh/common/kv_events.py), the exact Redis
contents checked after each sequence (stored, removed, reset, resync, shutdown, orphan cleanup)."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex, root_key
from kvmesh.common.engine_load import engine_load
from kvmesh.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventBatch,
)
from kvmesh.sidecar import index_writer
from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.heartbeat import Heartbeat
from kvmesh.sidecar.index_writer import IndexWriter
from kvmesh.sidecar.service import Sidecar
from tests.sidecar.test_sidecar_adapters import NoEvents
from tests.sidecar.test_sidecar_index import BS, cfg

T0 = time.time() - 60  # the events' times (a minute ago)


def batch(*events, seq=0, ts=T0) -> Delivery:
    return Delivery(seq=seq, batch=EventBatch(ts=ts, events=list(events)))


def hexes(*keys: int) -> set[str]:
    return {key_hex(k) for k in keys}


@pytest.fixture
def writer(redis_server, model_name):
    w = IndexWriter(cfg(model_name, redis_url=redis_server.url))
    yield w
    w.close()


@pytest.fixture
def r(redis_server):
    return redis_server.client()


def test_each_medium_goes_to_its_own_set(writer, r, model_name):
    writer.write([batch(BlockStored([1, 2], None, [0] * 2 * BS, BS))], 1)
    writer.write(
        [
            batch(BlockStored([3, 4], 2, [0] * 2 * BS, BS, medium="CPU"), seq=1, ts=T0 + 1),
            batch(BlockStored([5], 4, [0] * BS, BS, medium="SHARED"), seq=2, ts=T0 + 2.5),
        ],
        3,
    )
    assert r.smembers(rl.blocks_key(model_name, "pod-a")) == hexes(1, 2)
    assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(3, 4)
    assert r.zrange(kt.shared_blocks_key(model_name), 0, -1, withscores=True) == [
        (key_hex(5), T0 + 2.5)
    ]
    assert writer.num_keys == 2  # the heartbeat's num_keys: the KV cache only

    writer.write(
        [
            batch(
                BlockRemoved([3], medium="CPU"),
                BlockRemoved([5], medium="SHARED"),
                BlockRemoved([1]),
                seq=3,
            )
        ],
        4,
    )
    assert r.smembers(rl.blocks_key(model_name, "pod-a")) == hexes(2)
    assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(4)
    assert r.zcard(kt.shared_blocks_key(model_name)) == 0


def test_a_shared_key_another_replica_wrote_is_removed_by_anyone(writer, r, model_name):
    r.zadd(kt.shared_blocks_key(model_name), {key_hex(41): 1.0, key_hex(42): 2.0})
    writer.write([batch(BlockRemoved([41], medium="SHARED"))], 1)
    assert r.zrange(kt.shared_blocks_key(model_name), 0, -1) == [key_hex(42)]


def test_a_block_in_two_tiers_is_counted_per_tier(writer, r, model_name):
    writer.write([batch(BlockStored([7], None, [0] * BS, BS))], 1)
    writer.write([batch(BlockStored([7], None, [0] * BS, BS, medium="cpu"), seq=1)], 2)
    writer.write([batch(BlockRemoved([7], medium="GPU"), seq=2)], 3)  # evicted, kept on the host
    assert r.scard(rl.blocks_key(model_name, "pod-a")) == 0
    assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(7)


def test_unknown_media_are_ignored_and_counted(writer, r, model_name):
    writer.write(
        [
            batch(
                BlockStored([1], None, [0] * BS, BS, medium="disk"),
                BlockStored([2], None, [0] * BS, BS, medium=""),
                BlockRemoved([1], medium="NVMe"),
            )
        ],
        1,
    )
    assert writer.stats["events_unknown_medium"] == 3
    assert not r.exists(kt.host_blocks_key(model_name, "pod-a"), kt.shared_blocks_key(model_name))
    assert writer.index.keys() == [] and writer.index.keys(kt.MEDIUM_CPU) == []


def test_vllm_format_chains_a_host_block_from_its_gpu_parent(redis_server, model_name, r):
    w = IndexWriter(cfg(model_name, redis_url=redis_server.url, fmt="vllm"))
    try:
        toks = list(range(3 * BS))
        keys = block_keys(toks, model_name, BS, parent=root_key(model_name))
        w.write([batch(BlockStored([b"h0"], None, toks[:BS], BS))], 1)
        # the engine offloads the next two blocks: their parent is the GPU block's hash
        w.write([batch(BlockStored([b"h1", b"h2"], b"h0", toks[BS:], BS, medium="CPU"), seq=1)], 2)
        # and writes the last one to the shared tier, its parent a host block
        w.write([batch(BlockStored([b"h3"], b"h2", [9] * BS, BS, medium="SHARED"), seq=2)], 3)
        last = block_keys([9] * BS, model_name, BS, parent=keys[2])[0]
        assert r.smembers(rl.blocks_key(model_name, "pod-a")) == hexes(keys[0])
        assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(keys[1], keys[2])
        assert set(r.zrange(kt.shared_blocks_key(model_name), 0, -1)) == hexes(last)
        w.write([batch(BlockRemoved([b"h1"], medium="CPU"), seq=3)], 4)  # removed by its hash
        assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(keys[2])
    finally:
        w.close()


def test_a_reset_rewrites_the_host_set_and_keeps_the_shared_set(writer, r, model_name):
    writer.write(
        [
            batch(
                BlockStored([1], None, [0] * BS, BS),
                BlockStored([2], 1, [0] * BS, BS, medium="CPU"),
                BlockStored([3], 2, [0] * BS, BS, medium="SHARED"),
            )
        ],
        1,
    )
    r.zadd(kt.shared_blocks_key(model_name), {key_hex(99): 5.0})  # another replica's
    writer.write(
        [
            Delivery(seq=None, reset="engine restarted"),
            batch(BlockStored([8], None, [0] * BS, BS, medium="CPU"), seq=0),
        ],
        1,
    )
    assert writer.stats["resets"] == 1 and not writer.dirty
    assert r.scard(rl.blocks_key(model_name, "pod-a")) == 0
    assert r.smembers(kt.host_blocks_key(model_name, "pod-a")) == hexes(8)
    assert set(r.zrange(kt.shared_blocks_key(model_name), 0, -1)) == hexes(3, 99)


def test_all_blocks_cleared_empties_the_host_set_too(writer, r, model_name):
    writer.write([batch(BlockStored([2], None, [0] * BS, BS, medium="CPU"))], 1)
    writer.write([batch(BlockStored([3], None, [0] * BS, BS, medium="SHARED"), seq=1)], 2)
    writer.write([batch(AllBlocksCleared(), seq=2)], 3)
    assert not r.exists(kt.host_blocks_key(model_name, "pod-a"))
    assert set(r.zrange(kt.shared_blocks_key(model_name), 0, -1)) == hexes(3)


def test_shared_removals_while_dirty_are_applied_by_the_rewrite(writer, r, model_name):
    writer.write([batch(BlockStored([3, 4], None, [0] * 2 * BS, BS, medium="SHARED"))], 1)
    writer.dirty = True
    writer.write([batch(BlockRemoved([3], medium="SHARED"), seq=1)], 2)
    assert not writer.dirty
    assert set(r.zrange(kt.shared_blocks_key(model_name), 0, -1)) == hexes(4)


def test_the_shared_set_is_capped_oldest_first(writer, r, model_name, monkeypatch):
    monkeypatch.setattr(kt, "SHARED_INDEX_MAX", 3)
    for i in range(5):
        writer.write(
            [batch(BlockStored([10 + i], None, [0] * BS, BS, medium="SHARED"), seq=i, ts=T0 + i)],
            i + 1,
        )
    assert r.zrange(kt.shared_blocks_key(model_name), 0, -1) == [key_hex(k) for k in (12, 13, 14)]


@pytest.mark.parametrize("ts", [0.0, 1e12, -5.0])
def test_a_junk_batch_time_is_stored_as_now(writer, r, model_name, ts):
    writer.write([batch(BlockStored([6], None, [0] * BS, BS, medium="SHARED"), ts=ts)], 1)
    score = r.zscore(kt.shared_blocks_key(model_name), key_hex(6))
    assert abs(score - time.time()) < 60


def test_withdraw_and_verify_cover_the_host_set(writer, r, model_name):
    host = kt.host_blocks_key(model_name, "pod-a")
    writer.write([batch(BlockStored([2, 3], None, [0] * 2 * BS, BS, medium="CPU"))], 1)
    r.srem(host, key_hex(2))  # Redis lost a member without telling anyone
    writer.verify(r)
    assert writer.dirty and writer.stats["block_set_repairs"] == 1
    writer.write([], 1)
    assert r.smembers(host) == hexes(2, 3)
    writer.withdraw("events loop stale", r)
    assert not r.exists(host)
    writer.write([], 1)  # the next iteration rewrites it
    assert r.smembers(host) == hexes(2, 3)


def test_shutdown_deletes_the_host_set_not_the_shared_set(writer, r, model_name):
    writer.write(
        [
            batch(
                BlockStored([1], None, [0] * BS, BS, medium="CPU"),
                BlockStored([2], None, [0] * BS, BS, medium="SHARED"),
            )
        ],
        1,
    )
    pipe = r.pipeline(transaction=True)
    writer.delete_pod_keys(pipe)
    pipe.execute()
    assert not r.exists(kt.host_blocks_key(model_name, "pod-a"))
    assert r.zcard(kt.shared_blocks_key(model_name)) == 1


def test_orphan_cleanup_deletes_the_host_set(r, model_name):
    hb, blocks = rl.heartbeat_key(model_name, "gone"), rl.blocks_key(model_name, "gone")
    host, pods = kt.host_blocks_key(model_name, "gone"), rl.pods_key(model_name)
    r.sadd(blocks, "00000000000000aa")
    r.sadd(host, "00000000000000bb")
    r.sadd(pods, "gone")
    r.zadd(kt.shared_blocks_key(model_name), {"00000000000000cc": 1.0})
    assert r.register_script(rl.ORPHAN_CLEANUP_LUA)(keys=[hb, blocks, pods, host], args=["gone"])
    assert not r.exists(blocks, host) and not r.sismember(pods, "gone")
    assert r.zcard(kt.shared_blocks_key(model_name)) == 1

    r.sadd(blocks, "00000000000000aa")
    r.sadd(host, "00000000000000bb")
    r.sadd(pods, "gone", "alive")
    r.hset(rl.heartbeat_key(model_name, "alive"), "url", "http://alive")
    r.sadd(kt.host_blocks_key(model_name, "alive"), "00000000000000dd")
    keys = [pods]
    for name in ("gone", "alive"):
        keys += (
            rl.heartbeat_key(model_name, name),
            rl.blocks_key(model_name, name),
            kt.host_blocks_key(model_name, name),
        )
    urls = r.register_script(rl.POD_PAGE_LUA)(keys=keys, args=["gone", "alive"])
    assert urls == [0, "http://alive"]
    assert not r.exists(blocks, host) and r.smembers(pods) == {"alive"}
    assert r.exists(kt.host_blocks_key(model_name, "alive"))


def test_engine_metrics_give_the_tier_fields():
    text = "\n".join(
        [
            'kvmesh:kv_tier_block_seconds{source="prefill"} 0.02',
            'kvmesh:kv_tier_block_seconds{source="CPU"} 0.001',
            'kvmesh:kv_tier_block_seconds{source="SHARED"} 0.004',
            'kvmesh:kv_tier_block_seconds{source="junk"} 7',
            'kvmesh:kv_tier_blocks{medium="CPU"} 12',
            'kvmesh:kv_tier_blocks{medium="SHARED"} 40',
            'vllm:cache_config_info{block_size="16",num_cpu_blocks="512",num_gpu_blocks="99"} 1',
        ]
    )
    load = engine_load(text)
    assert load.tier_costs == {
        kt.F_COST_PREFILL: 0.02,
        kt.F_COST_CPU: 0.001,
        kt.F_COST_SHARED: 0.004,
    }
    assert load.host_blocks == 512 and load.shared_tier
    plain = engine_load('vllm:cache_config_info{num_gpu_blocks="99"} 1\n')
    assert plain.tier_costs == {} and plain.host_blocks == 0 and not plain.shared_tier


def test_heartbeat_tier_fields_round_trip_and_stay_out_when_off():
    hb = rl.Heartbeat("p", "http://p", costs=kt.BlockCosts(0.02, 0.001, 0.004), host_blocks=512)
    hb.shared_tier = True
    m = hb.to_mapping()
    assert m[kt.F_HOST_BLOCKS] == "512" and m[kt.F_SHARED_TIER] == "on"
    back = rl.Heartbeat.from_mapping("p", m)
    assert back.costs == kt.BlockCosts(0.02, 0.001, 0.004)
    assert back.host_blocks == 512 and back.shared_tier
    off = rl.Heartbeat("p", "http://p").to_mapping()
    assert not set(off) & {kt.F_HOST_BLOCKS, kt.F_SHARED_TIER, *kt.COST_SOURCES.values()}
    back = rl.Heartbeat.from_mapping("p", off)
    assert back.costs is None and back.host_blocks == 0 and not back.shared_tier


@pytest.mark.parametrize(
    "junk",
    [
        {kt.F_COST_PREFILL: "fast", kt.F_HOST_BLOCKS: "many", kt.F_SHARED_TIER: "yes"},
        {kt.F_COST_PREFILL: "-1", kt.F_COST_CPU: "nan", kt.F_HOST_BLOCKS: "1e400"},
        {kt.F_COST_PREFILL: "inf", kt.F_COST_SHARED: "", kt.F_HOST_BLOCKS: "-5"},
    ],
)
def test_junk_tier_fields_read_as_defaults(junk):
    hb = rl.Heartbeat.from_mapping("p", {rl.F_URL: "http://p", **junk})
    assert hb.costs == kt.BlockCosts() and hb.host_blocks == 0 and not hb.shared_tier


def test_cap_uses_the_contract_bound():
    calls = []

    class Pipe:
        def zremrangebyrank(self, *args):
            calls.append(args)

    index_writer.cap_shared_set(Pipe(), "k")
    assert calls == [("k", 0, -(kt.SHARED_INDEX_MAX + 1))]


# -- the heartbeat of an engine with tiers ---------------------------------------------------

TIER_METRICS = "\n".join(
    [
        "vllm:num_requests_running 1",
        'kvmesh:kv_tier_block_seconds{source="prefill"} 0.02',
        'kvmesh:kv_tier_block_seconds{source="CPU"} 0.001',
        'kvmesh:kv_tier_block_seconds{source="SHARED"} 0.004',
        'kvmesh:kv_tier_blocks{medium="CPU"} 300',
        'kvmesh:kv_tier_blocks{medium="SHARED"} 40',
    ]
)


def test_the_heartbeat_carries_the_tiers_and_drops_them_after_a_restart_without(
    redis_server, model_name
):
    metrics = {"text": TIER_METRICS}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics["text"])
        return httpx.Response(200) if request.url.path == "/ready" else httpx.Response(404)

    config = SidecarConfig(
        pod_name="pod-a",
        pod_url="http://pod-a:8000",
        model=model_name,
        engine_url="http://engine",
        redis_url=redis_server.url,
        block_size=BS,
    )
    stats: Counter = Counter()
    hb = Heartbeat(config, IndexWriter(config, stats), NoEvents(), stats)
    client = httpx.Client(transport=httpx.MockTransport(handle))
    r = redis_server.client()
    key = rl.heartbeat_key(model_name, "pod-a")
    try:
        hb.beat(client)
        read = rl.Heartbeat.from_mapping("pod-a", r.hgetall(key))
        assert read.costs == kt.BlockCosts(0.02, 0.001, 0.004)
        assert read.host_blocks == 300 and read.shared_tier
        metrics["text"] = "vllm:num_requests_running 1\n"  # restarted without tiers
        hb.beat(client)
        fields = r.hgetall(key)
        assert not {kt.F_HOST_BLOCKS, kt.F_SHARED_TIER, *kt.COST_SOURCES.values()} & set(fields)
        assert fields[rl.F_RUNNING] == "1"
    finally:
        client.close()
        hb.close()


def test_a_clean_stop_deletes_the_host_set_and_keeps_the_shared_set(redis_server, model_name):
    r = redis_server.client()
    r.sadd(kt.host_blocks_key(model_name, "pod-a"), key_hex(1))
    r.sadd(rl.blocks_key(model_name, "pod-a"), key_hex(2))
    r.zadd(kt.shared_blocks_key(model_name), {key_hex(3): 1.0})
    Sidecar(cfg(model_name, redis_url=redis_server.url)).stop(
        clean=True
    )  # never started: no engine
    assert not r.exists(kt.host_blocks_key(model_name, "pod-a"), rl.blocks_key(model_name, "pod-a"))
    assert r.zcard(kt.shared_blocks_key(model_name)) == 1
