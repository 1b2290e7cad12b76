"""Seam: engine -> KV events -> sidecar -> Redis. The pod's block set in Redis, written by the real
sidecar from the real engine's events, is the engine's prefix cache: after eviction, preemption,
prefix hits, blocks filled by decoding and blocks computed twice; through the kvmesh format (the
engine's hashes are the keys) and the vLLM format (the sidecar recomputes every key from its
parent's key and the token ids, so every parent hash and every event's chain is checked too)."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.kv_events import BlockRemoved, BlockStored, KVEventPublisher
from kvmesh.common.ports import free_port
from kvmesh.engine.block_pool import BlockPool
from tests.conftest import RedisServer, wait_until
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
        from kvmesh.sidecar.service import Sidecar, SidecarConfig

        self.redis = redis_server.client()
        self.sidecars = {}
        for pod, fmt in (("pod-k", "kvmesh"), ("pod-v", "vllm")):
            cfg = SidecarConfig(
                pod_name=pod,
                pod_url=engine_url,
                model=MODEL,
                engine_url=engine_url,
                kv_events_endpoint=events,
                kv_events_replay_endpoint=replay,
                redis_url=redis_server.url,
                block_size=BS,
                heartbeat_interval=0.5,
                engine_format=fmt,
            )
            self.sidecars[pod] = Sidecar(cfg).start()

    def caught_up(self, next_seq: int) -> bool:
        """Both sidecars applied every batch published so far and wrote them to Redis."""
        return all(sc.indexed_seq == next_seq for sc in self.sidecars.values())

    def block_set(self, pod: str) -> set[str]:
        return self.redis.smembers(rl.blocks_key(MODEL, pod))

    def assert_mirror(self, cached_keys, next_seq: int) -> None:
        wait_until(
            lambda: self.caught_up(next_seq), 15, msg="sidecars caught up with the engine's events"
        )
        expected = {key_hex(k) for k in cached_keys}
        for pod in self.sidecars:
            got = self.block_set(pod)
            assert got == expected, (
                f"{pod}: {len(got - expected)} keys the engine does not hold, "
                f"{len(expected - got)} cached keys missing"
            )

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
    pool.cache_blocks(other, keys[:2], None, tokens[: 2 * BS], BS)
    pool.uncache(other[:1])  # ...whose first block then left the cache (a failed step, an eviction)
    pool.take_events()
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, keys, None, tokens, BS)
    events = pool.take_events()
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        ([keys[0]], None),
        ([keys[2], keys[3]], keys[1]),
    ]
    assert chain_errors(events, MODEL, BS) == []
    assert events[1].token_ids == tokens[2 * BS :]
    assert (
        pool.cached[keys[1]] is other[1] and blocks[1].key is None
    )  # the first copy stays the cached one
    # A leading and a trailing cached block: one event, chained from the last cached key before it.
    pool2 = BlockPool(8, enable_events=True)
    first = pool2.allocate(1)
    pool2.cache_blocks(first, keys[:1], None, tokens[:BS], BS)
    pool2.take_events()
    pool2.cache_blocks(pool2.allocate(3), keys[:3], None, tokens[: 3 * BS], BS)
    (ev,) = pool2.take_events()
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids) == (
        keys[1:3],
        keys[0],
        tokens[BS : 3 * BS],
    )


def test_a_block_whose_parent_left_the_cache_is_not_stored():
    """The request's copy of block 1 was a duplicate and the cached copy was evicted since: block 2
    (and what follows until a cached key) stays an ordinary block, so no BlockStored names a parent
    the cache no longer holds (a vLLM-format consumer could not key it)."""
    tokens = list(range(2000, 2000 + 5 * BS))
    keys = block_keys(tokens, MODEL, BS)
    pool = BlockPool(12, enable_events=True)
    first = pool.allocate(4)
    pool.cache_blocks(first, keys[:4], None, tokens[: 4 * BS], BS)
    pool.uncache(first[1:3])  # blocks 1 and 2 leave the cache, block 3 stays
    pool.take_events()
    blocks = pool.allocate(3)
    pool.cache_blocks(
        blocks, keys[2:5], keys[1], tokens[2 * BS :], BS
    )  # parent keys[1]: not cached
    (ev,) = pool.take_events()
    assert (ev.block_hashes, ev.parent_block_hash) == (
        [keys[4]],
        keys[3],
    )  # resumed after cached block 3
    assert (
        blocks[0].key is None and keys[2] not in pool.cached and pool.cached[keys[4]] is blocks[2]
    )
    assert chain_errors([ev], MODEL, BS) == []


# -- the engine core, stepped by hand --------------------------------------------------------------


class SteppedEngine:
    """A real EngineCore (tiny model) stepped by the test, publishing each step's KV events as the
    server's engine thread does (AsyncEngine._publish_events)."""

    def __init__(self, model_dir: str, **kw):
        from kvmesh.engine.config import EngineArgs
        from kvmesh.engine.engine_core import EngineCore

        self.core = EngineCore(
            EngineArgs(
                model=model_dir, served_model_name=MODEL, enable_kv_events=True, device="cpu", **kw
            )
        )
        self.events_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub = KVEventPublisher(self.events_endpoint, self.replay_endpoint)
        self.published: list = []
        self.outputs: dict[str, list[int]] = {}
        self.cached_tokens: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
        from kvmesh.engine.sampling_params import SamplingParams

        self.core.add_request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            salt,
        )
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


def test_a_block_computed_twice_then_a_middle_hit_keeps_every_pods_index_exact(
    model_dir, redis_server
):
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
        assert eng.outputs["r1"] == out, (
            "greedy output changed with the batch (the scenario needs it)"
        )
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
        pods.assert_mirror(
            eng.pool.cached, eng.pub.next_seq
        )  # pod-v: g's key recomputed from g's real parent
        stored = [e for e in eng.published[mark:] if isinstance(e, BlockStored)]
        assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [
            ([kc, kd, ke], kb),
            ([kg], kf),
        ]
        assert chain_errors(eng.published, MODEL, BS) == []
    finally:
        pods.stop()
        eng.close()


# -- the server under churn -------------------------------------------------------------------------


def _record_events(
    endpoint: str, replay: str, stop: threading.Event, into: list
) -> threading.Thread:
    """A third subscriber that keeps every event (replays from 0, so nothing is missed)."""
    from kvmesh.common.kv_events import KVEventSubscriber

    def run():
        sub = KVEventSubscriber(endpoint, replay)
        try:
            while not stop.is_set():
                for d in sub.poll(50):
                    assert d.reset is None, d.reset
                    into.extend(d.batch.events)
            for d in sub.poll(200):  # whatever was still in flight
                into.extend(d.batch.events)
        finally:
            sub.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_index_equals_the_prefix_cache_after_churn(model_dir, redis_server):
    """A small KV cache (40 blocks) under concurrent requests that share system prompts: prefix
    hits, eviction, preemption, decode-filled blocks, streams dropped midway. Once the engine is
    idle, both pods' Redis block sets are exactly the engine's prefix-cache keys."""
    from tests.engine.server.conftest import ThreadServer

    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    srv = ThreadServer(
        [
            "--model",
            model_dir,
            "--served-model-name",
            MODEL,
            "--num-kv-blocks",
            "40",
            "--engine-mode",
            "thread",  # the test reads the core's prefix cache in place
            "--max-model-len",
            "320",
            "--max-num-batched-tokens",
            "256",
            "--max-num-seqs",
            "8",
            "--kv-events-endpoint",
            events,
            "--kv-events-replay-endpoint",
            replay,
        ]
    ).start()
    pods = Pods(redis_server, events, replay, srv.url)
    recorded: list = []
    stop = threading.Event()
    recorder = _record_events(events, replay, stop, recorded)
    rng = random.Random(16)
    systems = [[rng.randrange(3, 40000) for _ in range(n)] for n in (2 * BS, 3 * BS + 5, 4 * BS)]
    prompts: list[list[int]] = []
    lock = threading.Lock()

    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            work(w)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def work(w: int) -> None:
        r = random.Random(w)
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            for i in range(6):
                prompt = r.choice(systems) + [
                    r.randrange(3, 40000) for _ in range(r.randrange(1, 90))
                ]
                if (
                    i == 0
                ):  # every worker starts with a long decode at once: the cache runs out (preemption)
                    resp = http.post(
                        "/v1/completions",
                        json={
                            "prompt": prompt,
                            "max_tokens": 140,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    assert resp.status_code == 200, resp.text
                    with lock:
                        prompts.append(prompt)
                    continue
                if r.random() < 0.3 and prompts:  # a repeat: a full prefix hit
                    with lock:
                        prompt = list(r.choice(prompts))
                with lock:
                    prompts.append(prompt)
                body = {
                    "prompt": prompt,
                    "max_tokens": r.choice([1, 8, 24, 40, 120]),
                    "temperature": 0,
                    "ignore_eos": True,
                }
                if r.random() < 0.25:  # a stream the client drops after a few tokens: an abort
                    with http.stream(
                        "POST",
                        "/v1/completions",
                        json={**body, "stream": True, "max_tokens": 320 - len(prompt)},
                    ) as resp:
                        assert resp.status_code == 200
                        for n, _ in enumerate(resp.iter_lines()):
                            if n >= 3:
                                break
                    continue
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        engine = srv.state.engine
        core = engine.engine.core
        # idle: nothing running or waiting, no block held (the last step's events are published)
        wait_until(
            lambda: (
                engine.stats.num_running == 0
                and engine.stats.num_waiting == 0
                and core.kv.pool.num_free_blocks == core.kv.num_blocks
            ),
            30,
            msg="engine idle",
        )
        pods.assert_mirror(list(core.kv.pool.cached), engine.kv_publisher.next_seq)
        stop.set()
        recorder.join(10)
        # The churn really happened.
        removed = sum(len(e.block_hashes) for e in recorded if isinstance(e, BlockRemoved))
        stored = [h for e in recorded if isinstance(e, BlockStored) for h in e.block_hashes]
        prompt_keys = {k for p in prompts for k in block_keys(p, MODEL, BS)}
        decoded = set(stored) - prompt_keys  # blocks filled by decoding
        print(
            f"churn: {len(prompts)} requests, {core.scheduler.num_preemptions} preemptions, "
            f"{core.kv.prefix_hits} prefix-hit tokens, {len(stored)} blocks stored, {removed} evicted, "
            f"{len(decoded)} decode-filled"
        )
        assert decoded
        assert core.scheduler.num_preemptions > 0
        assert core.kv.prefix_hits > 0
        assert removed >= 20  # half the cache evicted at least
        assert chain_errors(recorded, MODEL, BS) == []
        live = set()
        for e in recorded:
            if isinstance(e, BlockStored):
                live.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                live.difference_update(e.block_hashes)
        assert live == set(core.kv.pool.cached)
    finally:
        stop.set()
        pods.stop()
        srv.stop()


def test_a_decode_filled_block_after_its_parents_copy_was_evicted(model_dir, redis_server):
    """R1 decodes into blocks c, d, e that R2 computed first (R1's copies are duplicates); R2's copies
    are then evicted while R1 still runs; R1 fills f, whose parent e the cache no longer holds. The
    engine must not publish f chained from a removed block: both pods' sets equal the cache."""
    eng = SteppedEngine(model_dir, num_kv_blocks=64, max_model_len=512)
    pods = Pods(redis_server, eng.events_endpoint, eng.replay_endpoint, "http://127.0.0.1:9")
    try:
        prompt = [(3000 + 41 * i) % 40000 + 3 for i in range(2 * BS + 10)]
        eng.add("probe", prompt, 80)
        eng.run()
        out = eng.outputs["probe"]
        assert eng.core.reset_prefix_cache()
        eng.publish()
        eng.add("r1", prompt, 80)
        eng.step()
        eng.step()
        eng.add("r2", prompt + out[:40], 1)  # computes c, d, e before R1 fills them
        eng.step()
        while len(eng.outputs["r1"]) < 40:  # R1 has filled c, d, e (duplicates), not yet f (at 54)
            eng.step()
        keys = block_keys(prompt + out[:72], MODEL, BS)
        ka, kb, kc, kd, ke, kf, kg = keys
        order = [b.key for b in eng.free_order()]
        n = order.index(kc) + 1  # R2's e, d, c: evicted by one-block requests
        for i in range(n):
            eng.add(f"evict-{i}", [(21000 + 89 * i + j) % 40000 + 3 for j in range(BS - 1)], 1)
        eng.step()
        assert len(eng.outputs["r1"]) < 54 and not {kc, kd, ke} & set(eng.pool.cached)
        eng.run()
        assert eng.outputs["r1"] == out
        assert {ka, kb} <= set(eng.pool.cached)
        pods.assert_mirror(eng.pool.cached, eng.pub.next_seq)
        assert chain_errors(eng.published, MODEL, BS) == []
        live: set[int] = set()
        for (
            e
        ) in eng.published:  # every stored event's parent is a block the cache holds at that point
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in live, e
                live.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                live.difference_update(e.block_hashes)
            else:
                live.clear()
    finally:
        pods.stop()
        eng.close()
