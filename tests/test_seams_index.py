"""Seam: engine -> KV events -> sidecar -> Redis. The pod's block set in Redis, written by the real
sidecar from the real engine's events, is the engine's prefix cache: after eviction, preemption,
prefix hits, blocks filled by decoding and blocks computed twice; through the kvmesh format (the
engine's hashes are the keys) and the vLLM format (the sidecar recomputes every key from its
parent's key and the token ids, so every parent hash and every event's chain is checked too)."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.kv_events import BlockRemoved, BlockStored, KVEventPublisher, decode_batch
from kvmesh.common.ports import free_port
from kvmesh.engine.block_pool import BlockPool
from tests.router.conftest import RedisServer, wait_until
from tests.seams_support import build_seam_model, chain_errors

MODEL = "seams"
BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_seam_model(tmp_path_factory.mktemp("seams-model"))


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.close()


class Pods:
    """Two real sidecars on one engine's events: pod-k reads them as kvmesh events (hashes are
    contract keys), pod-v as vLLM events (keys recomputed from token ids and parents)."""

    def __init__(self, redis_server: RedisServer, events: str, replay: str, engine_url: str):
        from kvmesh.router.sidecar import Sidecar, SidecarConfig

        self.redis = redis_server.client()
        self.sidecars = {}
        for pod, fmt in (("pod-k", "kvmesh"), ("pod-v", "vllm")):
            cfg = SidecarConfig(pod_name=pod, pod_url=engine_url, model=MODEL, engine_url=engine_url,
                                kv_events_endpoint=events, kv_events_replay_endpoint=replay,
                                redis_url=redis_server.url, block_size=BS, heartbeat_interval=0.5,
                                engine_format=fmt)
            self.sidecars[pod] = Sidecar(cfg).start()

    def caught_up(self, next_seq: int) -> bool:
        """Both sidecars applied every batch published so far and wrote them to Redis."""
        return all(sc.subscriber is not None and sc.subscriber.next_seq == next_seq and not sc._redis_dirty
                   for sc in self.sidecars.values())

    def block_set(self, pod: str) -> set[str]:
        return self.redis.smembers(rl.blocks_key(MODEL, pod))

    def assert_mirror(self, cached_keys, next_seq: int) -> None:
        wait_until(lambda: self.caught_up(next_seq), 15, msg="sidecars caught up with the engine's events")
        expected = {key_hex(k) for k in cached_keys}
        for pod in self.sidecars:
            got = self.block_set(pod)
            assert got == expected, (f"{pod}: {len(got - expected)} keys the engine does not hold, "
                                     f"{len(expected - got)} cached keys missing")

    def stop(self) -> None:
        for sc in self.sidecars.values():
            sc.stop(clean=True)


# -- the block pool alone ------------------------------------------------------------------------

def test_a_block_already_cached_mid_run_splits_the_event_into_chains():
    """cache_blocks over [new, already cached, new, new]: the cached block is not stored again, and
    each BlockStored is one chain (a vLLM-format consumer recomputes keys from token ids)."""
    tokens = list(range(1000, 1000 + 4 * BS))
    keys = block_keys(tokens, MODEL, BS)
    pool = BlockPool(8, enable_events=True)
    other = pool.allocate(2)  # the same first two blocks computed by another request first...
    pool.cache_blocks(other, keys[:2], None, tokens[:2 * BS], BS)
    pool.uncache(other[:1])  # ...whose first block then left the cache (a failed step, an eviction)
    pool.take_events()
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, keys, None, tokens, BS)
    events = pool.take_events()
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [([keys[0]], None),
                                                                        ([keys[2], keys[3]], keys[1])]
    assert chain_errors(events, MODEL, BS) == []
    assert events[1].token_ids == tokens[2 * BS:]
    assert pool.cached[keys[1]] is other[1] and blocks[1].key is None  # the first copy stays the cached one
    # A leading and a trailing cached block: one event, chained from the last cached key before it.
    pool2 = BlockPool(8, enable_events=True)
    first = pool2.allocate(1)
    pool2.cache_blocks(first, keys[:1], None, tokens[:BS], BS)
    pool2.take_events()
    pool2.cache_blocks(pool2.allocate(3), keys[:3], None, tokens[:3 * BS], BS)
    (ev,) = pool2.take_events()
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids) == (keys[1:3], keys[0], tokens[BS:3 * BS])


# -- the engine core, stepped by hand --------------------------------------------------------------

class SteppedEngine:
    """A real EngineCore (tiny model) stepped by the test, publishing each step's KV events as the
    server's engine thread does (AsyncEngine._publish_events)."""

    def __init__(self, model_dir: str, **kw):
        from kvmesh.engine.config import EngineArgs
        from kvmesh.engine.engine_core import EngineCore

        self.core = EngineCore(EngineArgs(model=model_dir, served_model_name=MODEL, enable_kv_events=True,
                                          device="cpu", **kw))
        self.events_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub = KVEventPublisher(self.events_endpoint, self.replay_endpoint)
        self.published: list = []
        self.outputs: dict[str, list[int]] = {}
        self.cached_tokens: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
        from kvmesh.engine.sampling_params import SamplingParams

        self.core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              salt)
        self.outputs[rid] = []

    def step(self) -> set[str]:
        finished = set()
        for out in self.core.step():
            self.outputs[out.request_id].extend(out.new_token_ids)
            self.cached_tokens[out.request_id] = out.num_cached_tokens
            if out.finished:
                finished.add(out.request_id)
        self.publish()
        return finished

    def publish(self) -> None:
        events = self.core.take_kv_events()
        self.published.extend(events)
        self.pub.publish(events)

    def run(self) -> None:
        while self.core.has_unfinished_requests():
            self.step()

    @property
    def pool(self):
        return self.core.kv.pool

    def free_order(self) -> list:
        return list(self.pool.free_queue)

    def close(self) -> None:
        self.pub.close()


def test_a_block_computed_twice_then_a_middle_hit_keeps_every_pods_index_exact(model_dir, redis_server):
    """The engine's own path to a block cached in the middle of a run:

    1. R1 (2 blocks + 10 tokens) decodes; R2, its prompt plus R1's future output (known from a probe),
       arrives after two decode steps and computes blocks c, d, e before R1 fills them, so R1's
       copies are duplicates; R1 then stores f and g (decode-filled) chained from R2's e.
    2. Freed, e, d, c (R2's) sit before g and f in the LRU order: short requests evict e..g, f stays.
    3. R4 asks for all seven blocks: a, b hit; c, d, e are stored, f is cached already, g is stored.
    The engine must publish that as two chains, and both sidecars' block sets must equal the cache."""
    eng = SteppedEngine(model_dir, num_kv_blocks=64, max_model_len=512)
    pods = Pods(redis_server, eng.events_endpoint, eng.replay_endpoint, "http://127.0.0.1:9")
    try:
        prompt = [(1000 + 37 * i) % 40000 + 3 for i in range(2 * BS + 10)]
        eng.add("probe", prompt, 80)  # R1's greedy output; then the cache is emptied again
        eng.run()
        out = eng.outputs["probe"]
        assert eng.core.reset_prefix_cache()
        eng.publish()
        eng.add("r1", prompt, 80)
        eng.step()
        eng.step()
        assert len(eng.outputs["r1"]) == 2  # block c (16 tokens from 32) is not full yet
        eng.add("r2", prompt + out[:40], 1)  # blocks a..e full, plus 2 tokens
        eng.step()
        assert eng.cached_tokens["r2"] == 2 * BS  # a and b hit; c, d, e computed by R2
        eng.run()
        assert eng.outputs["r1"] == out, "greedy output changed with the batch (the scenario needs it)"
        full = prompt + out[:72]  # 114 tokens: seven full blocks
        keys = block_keys(full, MODEL, BS)
        assert all(k in eng.pool.cached for k in keys)
        order = [b.key for b in eng.free_order()]
        ka, kb, kc, kd, ke, kf, kg = keys
        assert order.index(ke) < order.index(kg) < order.index(kf)  # R2's copies were freed first
        # 2. evict up to and including g with one-block requests (15 tokens: no full block of their own)
        n = order.index(kg) + 1
        for i in range(n):
            eng.add(f"evict-{i}", [(20000 + 97 * i + j) % 40000 + 3 for j in range(BS - 1)], 1)
        eng.run()
        assert kf in eng.pool.cached and not {kc, kd, ke, kg} & set(eng.pool.cached)
        pods.assert_mirror(eng.pool.cached, eng.pub.next_seq)
        # 3. the middle hit
        mark = len(eng.published)
        eng.add("r4", full, 1)
        eng.run()
        assert eng.cached_tokens["r4"] == 2 * BS
        assert set(keys) <= set(eng.pool.cached)
        pods.assert_mirror(eng.pool.cached, eng.pub.next_seq)  # pod-v: g's key recomputed from g's real parent
        stored = [e for e in eng.published[mark:] if isinstance(e, BlockStored)]
        assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [([kc, kd, ke], kb), ([kg], kf)]
        assert chain_errors(eng.published, MODEL, BS) == []
    finally:
        pods.stop()
        eng.close()
