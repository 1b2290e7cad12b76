"""The KV-event sidecar: one engine's KV-cache events and load -> Redis (contract 3).

Two threads:

* events: subscribes to the engine's KV events (`KVEventSubscriber`: every sequence gap
  counted and healed by a replay, or from the engine's block-set snapshot when the replay
  buffer no longer has it; reset + replay from 0 when the engine restarts), keeps the pod's block
  keys in memory and mirrors every change to the Redis set ``blocks:{pod}``. With
  ``engine_format="vllm"`` the engine's block hashes are not contract keys: keys are
  recomputed from the token ids in BlockStored (chained from the parent's key) and the
  engine-hash -> key map is kept for removals.
* heartbeat: every ``heartbeat_interval`` reads the engine's ``/ready`` and ``/metrics``
  and writes the heartbeat hash (TTL 10 s). Its state is the engine's readiness at that
  poll: ``ready`` on 200, ``draining`` on 503 (no heartbeat before the engine is first
  ready). An unreachable engine -> the heartbeat is deleted (not routable); a new engine
  incarnation (a changed ``process_start_time_seconds``, or a comeback after being
  unreachable) -> full resync of the block set.

Redis failures never lose the engine's state: the in-memory index keeps being updated,
and after Redis comes back (retried with exponential backoff, ended early by the first
heartbeat that Redis accepts) the whole set is rewritten atomically (temp key + RENAME).
A Redis that lost the set without an error (restarted empty between two writes, flushed,
evicted) is caught by the heartbeat, which compares the set's size with the index and
schedules the same rewrite. A clean stop deletes the pod's keys.

Nothing in an event can stop the events thread: a batch that does not decode (or that is
not valid for ``--engine-format``) is counted and resynced by the subscriber, and any other
failure of an iteration is counted, logged and followed by a full resync. If the events
loop is dead or has not completed an iteration for ``events_stale_after`` seconds, the
index is not trusted: the heartbeat says ``index=stale`` and the pod's block set is
withdrawn from Redis (the router then routes to the pod by load only), and the health
server's ``/health`` and ``/ready`` answer 503.
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
from prometheus_client import generate_latest

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE, block_keys, key_hex, root_key
from kvmesh.common.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, Delivery, EventBatch,
                                     KVEventSubscriber)
from kvmesh.common.models import DEFAULT_MODEL
from kvmesh.common.engine_load import engine_load
from kvmesh.sidecar.health import HealthServer, metrics_registry

log = logging.getLogger("kvmesh.sidecar")

GPU_MEDIA = (None, "GPU", "gpu", "cuda", "CUDA")


@dataclass
class SidecarConfig:
    pod_name: str
    pod_url: str
    model: str = DEFAULT_MODEL
    engine_url: str = "http://127.0.0.1:8000"
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    redis_url: str = "redis://127.0.0.1:6379/0"
    block_size: int = DEFAULT_BLOCK_SIZE
    heartbeat_interval: float = 1.0
    engine_format: str = "kvmesh"  # or "vllm"
    engine_down_after: int = 2  # failed polls before the heartbeat is withdrawn
    max_backoff: float = 5.0
    health_host: str = "0.0.0.0"
    health_port: int | None = None  # /health, /ready, /metrics; None: no health server (0: any free port)
    events_stale_after: float = 20.0  # an events loop without a completed iteration this long is stale


# The heartbeat's extra field saying whether the pod's block set can be trusted.
F_INDEX = "index"
MAX_U64 = 2**64 - 1


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
            keys = hashes  # contract keys already (checked by Sidecar.validate_batch)
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
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def validate_kvmesh_batch(batch: EventBatch) -> None:
    """``--engine-format kvmesh``: every hash is a contract key, a uint64 int."""
    for ev in batch.events:
        hashes = ev.block_hashes if isinstance(ev, (BlockStored, BlockRemoved)) else []
        parent = [ev.parent_block_hash] if isinstance(ev, BlockStored) and ev.parent_block_hash is not None else []
        for h in (*hashes, *parent):
            if type(h) is not int or not 0 <= h <= MAX_U64:
                raise DecodeError(f"block hash {h!r:.40} is not a uint64 contract key "
                                  "(an engine with its own hashes needs --engine-format vllm)")


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
        self._events_thread: threading.Thread | None = None
        self._hb_thread: threading.Thread | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.state: str | None = None  # None until the engine is first ready
        self._engine_was_ready = False
        self._shutting_down = False
        self.engine_start: float | None = None
        self.engine_failures = 0
        self.stats = Counter()
        self.started_at = time.monotonic()
        self.events_last_ok: float | None = None  # monotonic time of the last completed events iteration
        self.hb_last_iteration: float | None = None
        self.events_error: str | None = None  # the last events-loop failure
        self.index_withdrawn = False  # the block set was removed from Redis because the index is not trusted
        # The subscriber's next_seq after the last write (see indexed_seq).
        self._indexed_seq: int | None = None
        self.health_server: HealthServer | None = None
        self.health_port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Sidecar":
        validate = validate_kvmesh_batch if self.cfg.engine_format == "kvmesh" else None
        self.subscriber = KVEventSubscriber(self.cfg.kv_events_endpoint, self.cfg.kv_events_replay_endpoint,
                                            validate=validate)
        self._events_thread = threading.Thread(target=self._events_loop, name="sidecar-events", daemon=True)
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="sidecar-heartbeat", daemon=True)
        for t in (self._events_thread, self._hb_thread):
            t.start()
            self._threads.append(t)
        if self.cfg.health_port is not None:
            self._start_health_server()
        return self

    def stop(self, clean: bool = True) -> None:
        """Stop; with `clean`, mark draining then delete this pod's keys from Redis."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.health_server is not None:
            self.health_server.stop()
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

    @property
    def indexed_seq(self) -> int | None:
        """Every event before this sequence number is in Redis; None while the block set is dirty.
        The subscriber's own next_seq runs ahead of it by one poll: it moves before the write."""
        return None if self._redis_dirty else self._indexed_seq

    def mark_draining(self) -> None:
        """This sidecar is shutting down: every heartbeat from now on says `draining`."""
        self._shutting_down = True
        self.state = rl.STATE_DRAINING
        try:
            self.hb_redis.hset(self.hb_key, rl.F_STATE, rl.STATE_DRAINING)
        except redis.RedisError:
            pass

    # -- health ---------------------------------------------------------------------------
    def events_problem(self) -> str | None:
        """Why the block index cannot be trusted now (None: the events loop is alive and current)."""
        t = self._events_thread
        if t is None:
            return "not started"
        if not t.is_alive():
            return "events loop dead" + (f" ({self.events_error})" if self.events_error else "")
        last = self.events_last_ok if self.events_last_ok is not None else self.started_at
        age = time.monotonic() - last
        if age > self.cfg.events_stale_after:
            why = f" (last error: {self.events_error})" if self.events_error else ""
            return f"events loop stale: no completed iteration for {age:.1f}s{why}"
        return None

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        problem = self.events_problem()
        hb = self._hb_thread
        if problem is None and hb is not None and not hb.is_alive() and not self._stop.is_set():
            problem = "heartbeat loop dead"
        return problem is None, self.health_detail(problem)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ok, detail = self.liveness()
        if ok and not (self.subscriber is not None and self.subscriber.caught_up):
            ok, detail["problem"] = False, "catching up with the engine's KV events"
        return ok, detail

    def health_detail(self, problem: str | None) -> dict[str, Any]:
        sub = self.subscriber
        last = self.events_last_ok
        return {
            "status": "ok" if problem is None else "unhealthy", "problem": problem, "pod": self.cfg.pod_name,
            "events_loop_age_s": None if last is None else round(time.monotonic() - last, 3),
            "block_keys": len(self.index.refs), "index_withdrawn": self.index_withdrawn,
            "redis_dirty": self._redis_dirty, "indexed_seq": self.indexed_seq, "engine_state": self.state,
            "last_decode_error": sub.last_decode_error if sub else None, "last_events_error": self.events_error,
            "stats": {**(sub.stats if sub else {}), **self.stats},
        }

    def metrics_text(self) -> str:
        """The /metrics exposition (Prometheus text), also without a health server."""
        return generate_latest(metrics_registry(self)).decode()

    def _start_health_server(self) -> None:
        self.health_server = HealthServer(self, self.cfg.health_host, self.cfg.health_port).start()
        self.health_port = self.health_server.port
        log.info("health on %s:%d (/health, /ready, /metrics)", self.cfg.health_host, self.health_port)

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
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    self._events_iteration()
                except Exception as exc:  # noqa: BLE001 - nothing may end this thread
                    failures += 1
                    self.stats["events_loop_errors"] += 1
                    self.events_error = f"{type(exc).__name__}: {exc}"[:300]
                    if failures <= 3 or failures % 100 == 0:
                        log.exception("KV-event loop failed (%d in a row); resyncing", failures)
                    # Whatever the failure left half-applied is dropped: reset and replay from 0.
                    with self._lock:
                        self.index.clear()
                        self._redis_dirty = True
                    self.subscriber.request_resync(f"events loop failed: {self.events_error}")
                    self._stop.wait(min(0.1 * 2 ** min(failures, 6), self.cfg.max_backoff))
                    continue
                failures = 0
                self.events_last_ok = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit from a library: say why the loop is gone
            self.events_error = f"{type(exc).__name__}: {exc}"[:300]
            log.critical("KV-event loop ended: %s; /health and /ready now fail, the block set is withdrawn",
                         self.events_error)

    def _events_iteration(self) -> None:
        deliveries = self.subscriber.poll(100)
        with self._lock:
            added, removed, full = self.apply(deliveries)
            if full or self.index_withdrawn:
                self._redis_dirty = True
            if self._redis_dirty:
                if time.monotonic() >= self._redis_retry_at:
                    self._full_rewrite()
            elif added or removed:
                self._incremental(added, removed)
            self._indexed_seq = self.subscriber.next_seq

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
        self.index_withdrawn = False

    def _withdraw_index(self, problem: str) -> None:
        """The events loop is dead or stale: its block set may be frozen. Remove it from Redis
        (the router then scores this pod by load only) until the loop rewrites it."""
        if self.index_withdrawn:
            return
        log.error("%s: withdrawing this pod's block set from Redis", problem)
        locked = self._lock.acquire(timeout=1.0)
        try:
            self.hb_redis.delete(self.blocks_key)
            self.index_withdrawn = True
            self.stats["index_withdrawals"] += 1
            if locked:
                self._redis_dirty = True
        finally:
            if locked:
                self._lock.release()

    # -- heartbeat --------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        client = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))
        backoff = 0.0
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self.hb_last_iteration = t0
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
        self._check_incarnation(load)
        self.engine_failures = 0
        self.state = self._state_now(ready.status_code == 200)
        if self.state is None:
            return  # never ready yet: no heartbeat, not routable
        problem = self.events_problem()
        if problem is not None:
            self._withdraw_index(problem)
        hb = rl.Heartbeat(pod=self.cfg.pod_name, url=self.cfg.pod_url, model=self.cfg.model, state=self.state,
                          num_keys=0 if self.index_withdrawn else len(self.index.refs))
        if load:
            hb.kv_usage, hb.running, hb.waiting = load.kv_usage, load.running, load.waiting
            hb.total_blocks = load.total_blocks
            hb.prefix_cache_queries, hb.prefix_cache_hits = load.prefix_cache_queries, load.prefix_cache_hits
            hb.spec_draft_tokens, hb.spec_accepted_tokens = load.spec_draft_tokens, load.spec_accepted_tokens
        mapping = hb.to_mapping()
        mapping[rl.F_BLOCK_SIZE] = str(self.cfg.block_size)
        mapping[F_INDEX] = "stale" if self.index_withdrawn else "ok"
        pipe = self.hb_redis.pipeline(transaction=True)
        pipe.hset(self.hb_key, mapping=mapping)
        pipe.expire(self.hb_key, rl.HEARTBEAT_TTL_S)
        pipe.sadd(self.pods_key, self.cfg.pod_name)
        pipe.execute()
        self.stats["heartbeats"] += 1
        self._verify_block_set()

    def _verify_block_set(self) -> None:
        """Redis can lose the block set without any error reaching this sidecar: a Redis restarted
        (empty) between two writes is reconnected to transparently, and a flush or an eviction
        says nothing. So every heartbeat compares the set's size with the index, under the lock
        the events loop writes under (so the two agree whenever the set is not dirty), and any
        difference schedules a full rewrite. Redis answering again also ends the rewrite's backoff."""
        if not self._lock.acquire(timeout=1.0):
            return  # the events loop is busy writing: next heartbeat
        try:
            if self.index_withdrawn:
                return
            if self._redis_dirty:
                self._redis_retry_at = 0.0  # Redis answers this heartbeat: rewrite at the next iteration
                return
            in_redis = self.hb_redis.scard(self.blocks_key)
            if in_redis != len(self.index.refs):
                log.warning("the block set in Redis has %d keys, the index %d (Redis restarted or lost data); "
                            "rewriting it", in_redis, len(self.index.refs))
                self.stats["block_set_repairs"] += 1
                self._redis_dirty = True
                self._redis_retry_at = 0.0
        finally:
            self._lock.release()

    def _state_now(self, engine_ready: bool) -> str | None:
        """The state this heartbeat publishes: the engine's readiness now, never an earlier one
        (a restarted engine is `draining` while it loads, `ready` again as soon as it is).
        None (no heartbeat) until the engine is first ready; `draining` for good once this
        sidecar is shutting down."""
        if self._shutting_down:
            return rl.STATE_DRAINING
        if engine_ready:
            self._engine_was_ready = True
            return rl.STATE_READY
        return rl.STATE_DRAINING if self._engine_was_ready else None

    def _check_incarnation(self, load) -> None:
        """A restarted engine is a new incarnation: its cache is empty and its KV-event stream
        starts again at seq 0. Seen here as a changed `process_start_time_seconds`, or as an
        engine that answers again after being unreachable (the subscriber also sees the live
        seq going backwards and the socket reconnecting)."""
        start = load.process_start_time if load else None
        if self.engine_failures >= self.cfg.engine_down_after:
            self._engine_restarted("engine came back after being unreachable")
        elif start and self.engine_start and start != self.engine_start:
            self._engine_restarted(f"engine process start time changed ({self.engine_start} -> {start})")
        if start:
            self.engine_start = start

    def _engine_restarted(self, reason: str) -> None:
        """Drop the old incarnation's blocks and rebuild from the new one's stream: a reset (the
        events loop rewrites the pod's block set, empty) then a replay from 0 (or a snapshot)."""
        log.info("%s: resyncing the block index", reason)
        self.stats["engine_restarts"] += 1
        if self.subscriber is not None:
            self.subscriber.request_resync(reason)


def default_pod_url() -> str:
    import os
    import socket

    ip = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"http://{ip}:8000"
