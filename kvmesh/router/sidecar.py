"""The KV-event sidecar: one engine's KV-cache events and load -> Redis (contract 3).

Two threads:

* events: subscribes to the engine's KV events (`KVEventSubscriber`: replay on a
  sequence gap, reset + replay from 0 when the engine restarts), keeps the pod's block
  keys in memory and mirrors every change to the Redis set ``blocks:{pod}``. With
  ``engine_format="vllm"`` the engine's block hashes are not contract keys: keys are
  recomputed from the token ids in BlockStored (chained from the parent's key) and the
  engine-hash -> key map is kept for removals.
* heartbeat: every ``heartbeat_interval`` reads the engine's ``/ready`` and ``/metrics``
  and writes the heartbeat hash (TTL 10 s). ``/ready`` 503 after being ready -> state
  ``draining``. An unreachable engine -> the heartbeat is deleted (not routable); a
  changed ``process_start_time_seconds`` or a comeback -> full resync.

Redis failures never lose the engine's state: the in-memory index keeps being updated,
and after Redis comes back (retried with exponential backoff) the whole set is rewritten
atomically (temp key + RENAME). A clean stop deletes the pod's keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Hashable

import httpx
import redis

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex, root_key
from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Delivery, KVEventSubscriber
from kvmesh.router.engine_metrics import engine_load

log = logging.getLogger("kvmesh.sidecar")

GPU_MEDIA = (None, "GPU", "gpu", "cuda", "CUDA")


@dataclass
class SidecarConfig:
    pod_name: str
    pod_url: str
    model: str = "smollm2-135m-instruct"
    engine_url: str = "http://127.0.0.1:8000"
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    redis_url: str = "redis://127.0.0.1:6379/0"
    block_size: int = 16
    heartbeat_interval: float = 1.0
    engine_format: str = "kvmesh"  # or "vllm"
    engine_down_after: int = 2  # failed polls before the heartbeat is withdrawn
    max_backoff: float = 5.0


class BlockIndex:
    """Engine block hashes -> contract keys, with reference counts per key."""

    def __init__(self, cfg: SidecarConfig):
        self.cfg = cfg
        self.by_hash: dict[Hashable, int] = {}
        self.refs: Counter[int] = Counter()
        self._root = root_key(cfg.model)
        self._warned_block_size = False

    def clear(self) -> None:
        self.by_hash.clear()
        self.refs.clear()

    def keys(self) -> list[int]:
        return list(self.refs)

    def stored(self, ev: BlockStored, added: set[int], removed: set[int]) -> None:
        if ev.medium not in GPU_MEDIA:
            return
        hashes = [_hashable(h) for h in ev.block_hashes]
        if self.cfg.engine_format == "vllm":
            if ev.block_size != self.cfg.block_size and not self._warned_block_size:
                self._warned_block_size = True
                log.warning("engine block size %d != --block-size %d: keys will not match the router's",
                            ev.block_size, self.cfg.block_size)
            if ev.parent_block_hash is None:
                parent = self._root
            else:
                parent = self.by_hash.get(_hashable(ev.parent_block_hash))
                if parent is None:
                    log.debug("BlockStored with unknown parent; %d blocks not indexed", len(hashes))
                    return
            keys = block_keys(ev.token_ids, self.cfg.model, ev.block_size, parent=parent)
        else:
            keys = []
            for h in hashes:
                if not isinstance(h, int):
                    log.warning("engine published non-integer block hashes; use --engine-format vllm")
                    return
                keys.append(h)
        for h, k in zip(hashes, keys):
            if h in self.by_hash:
                continue
            self.by_hash[h] = k
            self.refs[k] += 1
            if self.refs[k] == 1:
                added.add(k)
                removed.discard(k)

    def removed(self, ev: BlockRemoved, added: set[int], removed: set[int]) -> None:
        if ev.medium not in GPU_MEDIA:
            return
        for h in ev.block_hashes:
            k = self.by_hash.pop(_hashable(h), None)
            if k is None:
                continue
            self.refs[k] -= 1
            if self.refs[k] <= 0:
                del self.refs[k]
                removed.add(k)
                added.discard(k)


def _hashable(h: Any) -> Hashable:
    return bytes(h) if isinstance(h, (bytearray, memoryview, list)) else h


class Sidecar:
    def __init__(self, cfg: SidecarConfig):
        self.cfg = cfg
        self.index = BlockIndex(cfg)
        self.redis = redis.Redis.from_url(cfg.redis_url, socket_timeout=2, socket_connect_timeout=1)
        self.hb_redis = redis.Redis.from_url(cfg.redis_url, socket_timeout=2, socket_connect_timeout=1)
        self.blocks_key = rl.blocks_key(cfg.model, cfg.pod_name)
        self.hb_key = rl.heartbeat_key(cfg.model, cfg.pod_name)
        self.pods_key = rl.pods_key(cfg.model)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._redis_dirty = True  # first write is a full rewrite (drops a previous incarnation's set)
        self._redis_retry_at = 0.0
        self._redis_backoff = 0.1
        self._threads: list[threading.Thread] = []
        self.subscriber: KVEventSubscriber | None = None
        self.state: str | None = None  # None until the engine is first ready
        self.engine_start: float | None = None
        self.engine_failures = 0
        self.stats = Counter()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Sidecar":
        self.subscriber = KVEventSubscriber(self.cfg.kv_events_endpoint, self.cfg.kv_events_replay_endpoint)
        for target, name in ((self._events_loop, "sidecar-events"), (self._heartbeat_loop, "sidecar-heartbeat")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, clean: bool = True) -> None:
        """Stop; with `clean`, mark draining then delete this pod's keys from Redis."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if clean:
            try:
                pipe = self.redis.pipeline(transaction=True)
                pipe.delete(self.blocks_key, self.hb_key)
                pipe.srem(self.pods_key, self.cfg.pod_name)
                pipe.execute()
                log.info("removed %s from Redis", self.cfg.pod_name)
            except redis.RedisError as exc:
                log.warning("could not remove this pod's keys from Redis: %s", exc)
        if self.subscriber is not None:
            self.subscriber.close()
        self.redis.close()
        self.hb_redis.close()

    def mark_draining(self) -> None:
        self.state = rl.STATE_DRAINING
        try:
            self.hb_redis.hset(self.hb_key, rl.F_STATE, rl.STATE_DRAINING)
        except redis.RedisError:
            pass

    # -- events -> Redis ------------------------------------------------------------------
    def apply(self, deliveries: list[Delivery]) -> tuple[set[int], set[int], bool]:
        """Apply deliveries to the in-memory index; returns (added, removed, full_rewrite)."""
        added: set[int] = set()
        removed: set[int] = set()
        full = False
        for d in deliveries:
            if d.reset is not None:
                self.index.clear()
                added.clear()
                removed.clear()
                full = True
                self.stats["resets"] += 1
                continue
            for ev in d.batch.events:
                if isinstance(ev, BlockStored):
                    self.index.stored(ev, added, removed)
                elif isinstance(ev, BlockRemoved):
                    self.index.removed(ev, added, removed)
                elif isinstance(ev, AllBlocksCleared):
                    self.index.clear()
                    added.clear()
                    removed.clear()
                    full = True
                    self.stats["clears"] += 1
        return added, removed, full

    def _events_loop(self) -> None:
        assert self.subscriber is not None
        while not self._stop.is_set():
            try:
                deliveries = self.subscriber.poll(100)
            except Exception:  # noqa: BLE001 - keep the sidecar alive
                log.exception("KV-event subscriber failed")
                time.sleep(0.5)
                continue
            with self._lock:
                added, removed, full = self.apply(deliveries)
                if full:
                    self._redis_dirty = True
                if self._redis_dirty:
                    if time.monotonic() >= self._redis_retry_at:
                        self._full_rewrite()
                elif added or removed:
                    self._incremental(added, removed)

    def _redis_failed(self, exc: Exception) -> None:
        self.stats["redis_errors"] += 1
        if not self._redis_dirty:
            log.warning("Redis write failed (%s); keeping state in memory, will resync", exc)
        self._redis_dirty = True
        self._redis_retry_at = time.monotonic() + self._redis_backoff
        self._redis_backoff = min(self._redis_backoff * 2, self.cfg.max_backoff)

    def _incremental(self, added: set[int], removed: set[int]) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            if removed:
                pipe.srem(self.blocks_key, *[key_hex(k) for k in removed])
            if added:
                pipe.sadd(self.blocks_key, *[key_hex(k) for k in added])
            pipe.execute()
            self.stats["incremental_writes"] += 1
        except redis.RedisError as exc:
            self._redis_failed(exc)

    def _full_rewrite(self) -> None:
        keys = [key_hex(k) for k in self.index.keys()]
        tmp = self.blocks_key + ":tmp"
        try:
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(tmp)
            for i in range(0, len(keys), 10_000):
                pipe.sadd(tmp, *keys[i:i + 10_000])
            if keys:
                pipe.rename(tmp, self.blocks_key)
            else:
                pipe.delete(self.blocks_key)
            pipe.execute()
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return
        if self.stats["full_rewrites"] or self.stats["redis_errors"]:
            log.info("rewrote %d block keys to Redis", len(keys))
        self.stats["full_rewrites"] += 1
        self._redis_dirty = False
        self._redis_backoff = 0.1

    # -- heartbeat --------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        client = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))
        backoff = 0.0
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    self.heartbeat_once(client)
                    backoff = 0.0
                except redis.RedisError as exc:
                    with self._lock:
                        self._redis_failed(exc)
                    backoff = min(max(backoff * 2, 0.2), self.cfg.max_backoff)
                except Exception:  # noqa: BLE001
                    log.exception("heartbeat failed")
                wait = max(self.cfg.heartbeat_interval - (time.monotonic() - t0), 0.05) + backoff
                self._stop.wait(wait)
        finally:
            client.close()

    def heartbeat_once(self, client: httpx.Client) -> None:
        try:
            ready = client.get(self.cfg.engine_url + "/ready")
            metrics = client.get(self.cfg.engine_url + "/metrics")
        except httpx.HTTPError as exc:
            self.engine_failures += 1
            if self.engine_failures == self.cfg.engine_down_after:
                log.warning("engine unreachable (%s); withdrawing the heartbeat", exc)
            if self.engine_failures >= self.cfg.engine_down_after:
                self.hb_redis.delete(self.hb_key)
            return
        load = engine_load(metrics.text) if metrics.status_code == 200 else None
        if self.engine_failures >= self.cfg.engine_down_after:
            self._engine_restarted("engine came back after being unreachable")
        elif load and load.process_start_time and self.engine_start and load.process_start_time != self.engine_start:
            self._engine_restarted("engine process start time changed")
        self.engine_failures = 0
        if load and load.process_start_time:
            self.engine_start = load.process_start_time
        if ready.status_code == 200:
            if self.state != rl.STATE_DRAINING:
                self.state = rl.STATE_READY
        elif self.state is not None:
            self.state = rl.STATE_DRAINING
        if self.state is None:
            return  # not ready yet: not routable
        hb = rl.Heartbeat(pod=self.cfg.pod_name, url=self.cfg.pod_url, model=self.cfg.model, state=self.state,
                          num_keys=len(self.index.refs))
        if load:
            hb.kv_usage, hb.running, hb.waiting = load.kv_usage, load.running, load.waiting
            hb.total_blocks = load.total_blocks
            hb.prefix_cache_queries, hb.prefix_cache_hits = load.prefix_cache_queries, load.prefix_cache_hits
        mapping = hb.to_mapping()
        mapping[rl.F_BLOCK_SIZE] = str(self.cfg.block_size)
        pipe = self.hb_redis.pipeline(transaction=True)
        pipe.hset(self.hb_key, mapping=mapping)
        pipe.expire(self.hb_key, rl.HEARTBEAT_TTL_S)
        pipe.sadd(self.pods_key, self.cfg.pod_name)
        pipe.execute()
        self.stats["heartbeats"] += 1

    def _engine_restarted(self, reason: str) -> None:
        log.info("%s: resyncing the block index", reason)
        if self.subscriber is not None:
            self.subscriber.request_resync(reason)
        if self.state == rl.STATE_DRAINING:
            self.state = None  # a restarted engine must become ready again


def default_pod_url() -> str:
    import os
    import socket

    ip = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"http://{ip}:8000"
