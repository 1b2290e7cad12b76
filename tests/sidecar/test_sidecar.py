import time

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.kv_events import KVEventPublisher
from kvmesh.sidecar.service import Sidecar, SidecarConfig
from tests.conftest import free_port, wait_until
from tests.router import vllm_structs as vs

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def _sidecar(stub, redis_server, model, pod="pod-a", **kw) -> Sidecar:
    cfg = SidecarConfig(
        pod_name=pod,
        pod_url=stub.url,
        model=model,
        engine_url=stub.url,
        kv_events_endpoint=stub.events_endpoint,
        kv_events_replay_endpoint=stub.replay_endpoint,
        redis_url=redis_server.url,
        heartbeat_interval=0.2,
        **kw,
    )
    return Sidecar(cfg).start()


def _keys_for(prompt: str, model: str) -> list[str]:
    from kvmesh.common.model_lookup import find_model_dir
    from kvmesh.common.tokenizer import KVMeshTokenizer

    tok = KVMeshTokenizer(find_model_dir("smollm2-135m-instruct"))
    return [key_hex(k) for k in block_keys(tok.encode(prompt), model)]


def test_sidecar_indexes_blocks_heartbeats_drains_and_cleans_up(
    redis_server, stub_factory, model_name
):
    (stub,) = stub_factory(model_name, 1, "--num-blocks", "64")
    r = redis_server.client()
    # The engine serves a request before the sidecar starts: the sidecar catches up by replay.
    httpx.post(stub.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
    sidecar = _sidecar(stub, redis_server, model_name)
    try:
        bkey = rl.blocks_key(model_name, "pod-a")
        expected = _keys_for(PROMPT, model_name)
        assert expected
        wait_until(lambda: r.smembers(bkey) == set(expected), 5, msg="block keys in redis")
        hb = wait_until(
            lambda: (lambda h: h if h and h.num_keys == len(expected) else None)(
                rl.Heartbeat.from_mapping("pod-a", r.hgetall(rl.heartbeat_key(model_name, "pod-a")))
            ),
            5,
            msg="heartbeat",
        )
        assert hb.url == stub.url and hb.state == "ready" and hb.total_blocks == 64
        assert 0 < hb.kv_usage <= 1 and hb.num_keys == len(expected)
        assert 0 < r.ttl(rl.heartbeat_key(model_name, "pod-a")) <= rl.HEARTBEAT_TTL_S
        assert "pod-a" in r.smembers(rl.pods_key(model_name))
        # A second prompt sharing the prefix adds only its new blocks; the cache clear empties the set.
        httpx.post(
            stub.url + "/v1/completions",
            json={"prompt": PROMPT + " And more words here. " * 4},
            timeout=10,
        )
        wait_until(lambda: len(r.smembers(bkey)) > len(expected), 5, msg="more keys")
        httpx.post(stub.url + "/stub/reset_cache", timeout=5)
        wait_until(lambda: r.scard(bkey) == 0, 5, msg="cleared")
        # Draining: /ready 503 -> state draining.
        stub.config(draining=True)
        wait_until(
            lambda: r.hget(rl.heartbeat_key(model_name, "pod-a"), "state") == "draining",
            5,
            msg="draining",
        )
    finally:
        sidecar.stop(clean=True)
    assert not r.exists(rl.heartbeat_key(model_name, "pod-a"), rl.blocks_key(model_name, "pod-a"))
    assert "pod-a" not in r.smembers(rl.pods_key(model_name))


def test_eviction_removes_keys(redis_server, stub_factory, model_name):
    """An 8-block LRU cache, 4 prompts with no common prefix: exactly the 8 most recently stored
    keys stay; the Redis set must be exactly those (a sidecar ignoring or misapplying
    BlockRemoved leaves other keys behind, or removes the wrong ones)."""
    (stub,) = stub_factory(model_name, 1, "--num-blocks", "8")
    r = redis_server.client()
    sidecar = _sidecar(stub, redis_server, model_name)
    try:
        bkey = rl.blocks_key(model_name, "pod-a")
        per_prompt = [_keys_for(f"Prompt {i}: " + PROMPT, model_name) for i in range(4)]
        stored_order = [k for keys in per_prompt for k in keys]
        assert (
            len(set(stored_order)) == len(stored_order) > 8 + len(per_prompt[-1])
        )  # eviction crosses prompts
        for i in range(4):
            httpx.post(
                stub.url + "/v1/completions", json={"prompt": f"Prompt {i}: " + PROMPT}, timeout=10
            )
        assert stub.stats()["cache_blocks"] == 8
        survivors = set(
            stored_order[-8:]
        )  # LRU: the last 8 stored (prompt 3's and the tail of prompt 2's)
        evicted = set(stored_order[:-8])
        wait_until(lambda: r.smembers(bkey) == survivors, 5, msg="exactly the surviving keys")
        assert not evicted & r.smembers(bkey)
        assert (
            set(per_prompt[3]) <= survivors
            and set(per_prompt[2][-(8 - len(per_prompt[3])) :]) <= survivors
        )
        assert (
            sidecar.writer.index.keys()
            and set(map(key_hex, sidecar.writer.index.keys())) == survivors
        )
    finally:
        sidecar.stop()


def test_resync_after_engine_restart(redis_server, stub_factory, model_name):
    (stub,) = stub_factory(model_name, 1)
    r = redis_server.client()
    sidecar = _sidecar(stub, redis_server, model_name)
    try:
        bkey = rl.blocks_key(model_name, "pod-a")
        httpx.post(stub.url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
        wait_until(lambda: r.scard(bkey) > 0, 5, msg="keys")
        stub.kill()
        stub.start()  # same ports, empty cache, seq restarts at 0
        other = "A completely different prompt about routers and caches. " * 6
        httpx.post(stub.url + "/v1/completions", json={"prompt": other}, timeout=10)
        wait_until(
            lambda: r.smembers(bkey) == set(_keys_for(other, model_name)), 10, msg="resynced set"
        )
        wait_until(
            lambda: r.hget(rl.heartbeat_key(model_name, "pod-a"), "state") == "ready",
            5,
            msg="hb back",
        )
        assert sidecar.stats["resets"] >= 1
    finally:
        sidecar.stop()


def test_redis_outage_keeps_state_and_resyncs(own_redis, stub_factory, model_name):
    (stub,) = stub_factory(model_name, 1)
    r = own_redis.client()
    sidecar = _sidecar(stub, own_redis, model_name)
    try:
        bkey = rl.blocks_key(model_name, "pod-a")
        httpx.post(stub.url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
        wait_until(lambda: r.scard(bkey) > 0, 5, msg="keys")
        own_redis.kill()
        other = "Events that arrive while Redis is down must not be lost. " * 5
        httpx.post(stub.url + "/v1/completions", json={"prompt": other}, timeout=10)
        wait_until(lambda: sidecar.stats["redis_errors"] > 0, 5, msg="redis errors noticed")
        own_redis.start()  # an empty Redis: everything must be rewritten
        r = own_redis.client()
        want = set(_keys_for(PROMPT, model_name)) | set(_keys_for(other, model_name))
        wait_until(lambda: r.smembers(bkey) == want, 15, msg="rewritten after outage")
        wait_until(lambda: r.exists(rl.heartbeat_key(model_name, "pod-a")), 5, msg="heartbeat back")
    finally:
        sidecar.stop()


def test_vllm_format_events_are_indexed_with_contract_keys(redis_server, model_name):
    """A real vLLM engine: sha256 bytes hashes, msgspec-encoded batches, GPU medium."""
    import hashlib

    ep, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(ep, rp)
    r = redis_server.client()
    cfg = SidecarConfig(
        pod_name="vllm-0",
        pod_url="http://127.0.0.1:1",
        model=model_name,
        engine_url="http://127.0.0.1:1",
        kv_events_endpoint=ep,
        kv_events_replay_endpoint=rp,
        redis_url=redis_server.url,
        engine_format="vllm",
        heartbeat_interval=5,
    )
    sidecar = Sidecar(cfg).start()
    bkey = rl.blocks_key(model_name, "vllm-0")
    tokens = list(range(1000, 1064))  # 4 blocks of 16
    keys = [key_hex(k) for k in block_keys(tokens, model_name)]
    vh = [hashlib.sha256(bytes([i])).digest() for i in range(4)]  # vLLM's opaque hashes

    def publish_vllm(*events):
        payload = vs.encode(vs.KVEventBatch(ts=time.time(), events=list(events)))
        with pub._lock:  # send exactly vLLM's bytes through the publisher's sockets
            seq = pub._seq
            pub._seq += 1
            pub._buffer.append((seq, payload))
            pub._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    try:
        time.sleep(0.3)
        publish_vllm(vs.BlockStored(vh[:2], None, tokens[:32], 16, None, "GPU"))
        publish_vllm(
            vs.BlockStored(vh[2:], vh[1], tokens[32:], 16, None, "GPU"),
            vs.BlockStored([b"cpu-copy"], vh[3], list(range(16)), 16, None, "CPU"),
        )  # not GPU: ignored
        wait_until(lambda: r.smembers(bkey) == set(keys), 5, msg="vllm keys")
        publish_vllm(vs.BlockRemoved([vh[3]], "GPU"))
        wait_until(lambda: r.smembers(bkey) == set(keys[:3]), 5, msg="removal mapped")
        publish_vllm(vs.AllBlocksCleared())
        wait_until(lambda: r.scard(bkey) == 0, 5, msg="cleared")
        assert not sidecar.writer.index.by_hash
    finally:
        sidecar.stop()
        pub.close()
