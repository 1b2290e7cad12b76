"""The index writer: KV-event deliveries -> the in-memory block index -> the pod's Redis block set.

The index maps the engine's block hashes to contract keys (reference-counted: two engine blocks
may share a key). With ``engine_format="vllm"`` the engine's hashes are not contract keys: keys are
recomputed from the token ids in BlockStored, chained from the parent's key (a first block
from the root of its adapter, ``lora_name``, when it has one), and the engine-hash -> key map
serves the removals.

Every change is mirrored to the Redis set ``blocks:{pod}``, or, for a block in the engine's host
tier or the shared tier (its event's ``medium``), to ``host-blocks:{pod}`` or the deployment's
``shared-blocks`` (kvmesh/common/kv_tiers.py). A Redis failure never loses state:
the index keeps being updated, the set is marked dirty, and once Redis answers again (retried with
exponential backoff, ended early by the heartbeat) the whole set is rewritten atomically (temporary
key + RENAME). A set Redis lost without an error (restarted empty, flushed, evicted) is caught by
``verify``, which the heartbeat calls. An index that cannot be trusted (a dead or stale events loop)
is ``withdraw``n from Redis until the next rewrite; the heartbeat's ``index`` field says which.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable
from typing import Any

import redis

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex, root_key
from kvmesh.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Delivery,
    EventBatch,
)
from kvmesh.common.lora import vllm_adapter_identity
from kvmesh.sidecar.config import SidecarConfig

log = logging.getLogger("kvmesh.sidecar")

GPU_MEDIA = (None, "GPU", "gpu", "cuda", "CUDA")
TIER_MEDIA = (kt.MEDIUM_CPU, kt.MEDIUM_SHARED)  # the tiers beside the KV cache
MAX_U64 = 2**64 - 1
# The heartbeat's field saying whether the pod's block set can be trusted ("ok" or "stale").
F_INDEX = "index"


class TierChanges:
    """One tier's pending changes for Redis: keys added (with their event's time) and removed."""

    def __init__(self):
        self.added: dict[int, float] = {}
        self.removed: set[int] = set()

    def add(self, key: int, ts: float) -> None:
        self.added[key] = ts
        self.removed.discard(key)

    def remove(self, key: int) -> None:
        self.removed.add(key)
        self.added.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class BlockIndex:
    """Engine block hashes -> contract keys, per tier, with reference counts per key and tier.

    The GPU tier is ``by_hash``/``refs`` (the pod's block set); the host (CPU) and shared tiers
    have their own maps, and their changes wait in ``pending`` until the writer mirrors them. A
    parent's key is looked up in every tier: a host block's parent may be a GPU block."""

    def __init__(self, cfg: SidecarConfig, stats: Counter | None = None):
        self.cfg = cfg
        self.stats = stats if stats is not None else Counter()
        self.held: dict[str, dict[Hashable, int]] = {m: {} for m in kt.MEDIA}
        self.counts: dict[str, Counter[int]] = {m: Counter() for m in kt.MEDIA}
        self.pending: dict[str, TierChanges] = {m: TierChanges() for m in TIER_MEDIA}
        self._root = root_key(cfg.model)
        self._adapter_roots: dict[str, int] = {}
        self._warned_block_size = False
        self.batch_ts: float | None = None  # the time of the batch being applied (its events')
        self.stored_at: dict[int, float] = {}  # shared-tier key -> the time its event gives

    @property
    def by_hash(self) -> dict[Hashable, int]:
        return self.held[kt.MEDIUM_GPU]

    @property
    def refs(self) -> Counter[int]:
        return self.counts[kt.MEDIUM_GPU]

    def clear(self) -> None:
        """Forget the engine's own tiers (GPU and host); the shared tier outlives an engine."""
        for m in (kt.MEDIUM_GPU, kt.MEDIUM_CPU):
            self.held[m].clear()
            self.counts[m].clear()
        self.pending[kt.MEDIUM_CPU] = TierChanges()

    def keys(self, medium: str = kt.MEDIUM_GPU) -> list[int]:
        return list(self.counts[medium])

    def _tier(self, medium: Any) -> str | None:
        tier = kt.tier_of(medium)
        if tier is None:
            self.stats["events_unknown_medium"] += 1
        return tier

    def stored(self, ev: BlockStored, added: set[int], removed: set[int]) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        hashes = [_hashable(h) for h in ev.block_hashes]
        keys = self._keys(ev, hashes)
        if keys is None:
            return
        held, counts = self.held[tier], self.counts[tier]
        when = _event_time(self.batch_ts)
        for h, k in zip(hashes, keys):
            if h in held:
                continue
            held[h] = k
            counts[k] += 1
            if counts[k] > 1:
                continue
            if tier == kt.MEDIUM_GPU:
                added.add(k)
                removed.discard(k)
            else:
                self.pending[tier].add(k, when)
                if tier == kt.MEDIUM_SHARED:
                    self.stored_at[k] = when

    def _keys(self, ev: BlockStored, hashes: list[Hashable]) -> list[int] | None:
        """The contract keys of a BlockStored's blocks (None: its parent is unknown)."""
        if self.cfg.engine_format != "vllm":
            return hashes  # contract keys already (checked by validate_kvmesh_batch)
        if ev.block_size != self.cfg.block_size and not self._warned_block_size:
            self._warned_block_size = True
            log.warning(
                "engine block size %d != --block-size %d: keys will not match the router's",
                ev.block_size,
                self.cfg.block_size,
            )
        if ev.parent_block_hash is None:
            parent = self._root if ev.lora_name is None else self._adapter_root(ev.lora_name)
        else:
            parent = self.key_of(_hashable(ev.parent_block_hash))
            if parent is None:
                log.debug("BlockStored with unknown parent; %d blocks not indexed", len(hashes))
                return None
        return block_keys(ev.token_ids, self.cfg.model, ev.block_size, parent=parent)

    def key_of(self, h: Hashable) -> int | None:
        """The key of an engine hash held in any tier (an engine's hash names one block)."""
        for held in self.held.values():
            k = held.get(h)
            if k is not None:
                return k
        return None

    def _adapter_root(self, lora_name: str) -> int:
        """An adapter's blocks chain from the root of its name: the keys a request that names the
        adapter as its model gets, never the base model's."""
        root = self._adapter_roots.get(lora_name)
        if root is None:
            root = self._adapter_roots[lora_name] = root_key(vllm_adapter_identity(lora_name))
        return root

    def removed(self, ev: BlockRemoved, added: set[int], removed: set[int]) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        held, counts = self.held[tier], self.counts[tier]
        for h in ev.block_hashes:
            k = held.pop(_hashable(h), None)
            if k is None:
                if tier == kt.MEDIUM_SHARED and self.cfg.engine_format != "vllm":
                    # a key this pod never stored (another replica wrote it): the store says
                    # it is gone, and the shared set is everyone's
                    self.pending[tier].remove(h)
                continue
            counts[k] -= 1
            if counts[k] > 0:
                continue
            del counts[k]
            if tier == kt.MEDIUM_GPU:
                removed.add(k)
                added.discard(k)
            else:
                self.pending[tier].remove(k)
                self.stored_at.pop(k, None)

    def take_pending(self) -> dict[str, TierChanges]:
        """The host and shared tiers' changes since the last call (the writer mirrors them)."""
        out = self.pending
        self.pending = {m: TierChanges() for m in TIER_MEDIA}
        return out


def _event_time(ts: float | None) -> float:
    """A batch's time as the shared set's score: a clock a day or more off (junk) reads as now,
    so it can neither pin a key against the cap nor push it out first."""
    now = time.time()
    return ts if ts is not None and abs(ts - now) < 86_400 else now


def _hashable(h: Any) -> Hashable:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def validate_kvmesh_batch(batch: EventBatch) -> None:
    """``--engine-format kvmesh``: every hash is a contract key, a uint64 int."""
    for ev in batch.events:
        hashes = ev.block_hashes if isinstance(ev, (BlockStored, BlockRemoved)) else []
        parent = (
            [ev.parent_block_hash]
            if isinstance(ev, BlockStored) and ev.parent_block_hash is not None
            else []
        )
        for h in (*hashes, *parent):
            if type(h) is not int or not 0 <= h <= MAX_U64:
                raise DecodeError(
                    f"block hash {h!r:.40} is not a uint64 contract key "
                    "(an engine with its own hashes needs --engine-format vllm)"
                )


class IndexWriter:
    """The pod's block index and its Redis block set, kept equal. ``write`` runs on the events
    thread; ``withdraw``, ``verify`` and ``redis_error`` on the heartbeat's, under the same lock."""

    def __init__(self, cfg: SidecarConfig, stats: Counter | None = None):
        self.cfg = cfg
        self.stats = stats if stats is not None else Counter()
        self.index = BlockIndex(cfg, self.stats)
        self.redis = redis.Redis.from_url(cfg.redis_url, socket_timeout=2, socket_connect_timeout=1)
        self.blocks_key = rl.blocks_key(cfg.model, cfg.pod_name)
        self.host_key = kt.host_blocks_key(cfg.model, cfg.pod_name)
        self.shared_key = kt.shared_blocks_key(cfg.model)
        self.lock = threading.Lock()
        self.dirty = True  # the first write is a full rewrite (drops a previous incarnation's set)
        self.retry_at = 0.0
        self.backoff = 0.1
        self.withdrawn = (
            False  # the block set was removed from Redis because the index is not trusted
        )
        self._indexed_seq: int | None = None  # the subscriber's next_seq after the last write

    def close(self) -> None:
        self.redis.close()

    # -- what the heartbeat publishes ------------------------------------------------------
    @property
    def indexed_seq(self) -> int | None:
        """Every event before this sequence number is in Redis; None while the block set is dirty.
        The subscriber's own next_seq runs ahead of it by one poll: it moves before the write."""
        return None if self.dirty else self._indexed_seq

    @property
    def num_keys(self) -> int:
        """The block keys the heartbeat vouches for: none while the set is withdrawn."""
        return 0 if self.withdrawn else len(self.index.refs)

    @property
    def index_state(self) -> str:
        """The heartbeat's ``index`` field."""
        return "stale" if self.withdrawn else "ok"

    # -- events -> index -> Redis ----------------------------------------------------------
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
            self.index.batch_ts = d.batch.ts
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

    def write(self, deliveries: list[Delivery], next_seq: int | None) -> None:
        """Apply one poll's deliveries and mirror them to Redis (incrementally, or by a full
        rewrite when the set is dirty); ``next_seq`` is the subscriber's after that poll."""
        with self.lock:
            added, removed, full = self.apply(deliveries)
            if full or self.withdrawn:
                self.dirty = True
            tiers = self.index.take_pending()
            if self.dirty:
                gone = tiers[kt.MEDIUM_SHARED].removed  # a rewrite cannot tell what went
                if time.monotonic() >= self.retry_at:
                    self.full_rewrite(gone)
                if self.dirty:
                    self.index.pending[kt.MEDIUM_SHARED].removed |= gone
            elif added or removed or any(tiers.values()):
                self.incremental(added, removed, tiers)
            self._indexed_seq = next_seq

    def reset(self) -> None:
        """Drop whatever a failed iteration left half-applied; the replay that follows rebuilds it."""
        with self.lock:
            self.index.clear()
            self.dirty = True

    def incremental(
        self, added: set[int], removed: set[int], tiers: dict[str, TierChanges] | None = None
    ) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            if removed:
                pipe.srem(self.blocks_key, *[key_hex(k) for k in removed])
            if added:
                pipe.sadd(self.blocks_key, *[key_hex(k) for k in added])
            if tiers:
                self._tier_changes(pipe, tiers)
            pipe.execute()
            self.stats["incremental_writes"] += 1
        except redis.RedisError as exc:
            self._failed(exc)

    def _tier_changes(self, pipe: Any, tiers: dict[str, TierChanges]) -> None:
        """The host set's and the shared set's changes, queued on ``pipe``."""
        host, shared = tiers[kt.MEDIUM_CPU], tiers[kt.MEDIUM_SHARED]
        if host.removed:
            pipe.srem(self.host_key, *[key_hex(k) for k in host.removed])
        if host.added:
            pipe.sadd(self.host_key, *[key_hex(k) for k in host.added])
        if shared.removed:
            pipe.zrem(self.shared_key, *[key_hex(k) for k in shared.removed])
        if shared.added:
            pipe.zadd(self.shared_key, {key_hex(k): ts for k, ts in shared.added.items()})
            cap_shared_set(pipe, self.shared_key)

    def full_rewrite(self, shared_removed: set[int] | frozenset = frozenset()) -> None:
        """Rewrite the block set and the host set from the index; re-add this pod's shared
        keys (and remove ``shared_removed`` from the shared set)."""
        keys = [key_hex(k) for k in self.index.keys()]
        host = [key_hex(k) for k in self.index.keys(kt.MEDIUM_CPU)]
        shared = [
            (key_hex(k), self.index.stored_at.get(k, 0.0))
            for k in self.index.keys(kt.MEDIUM_SHARED)
        ]
        try:
            pipe = self.redis.pipeline(transaction=True)
            _replace_set(pipe, self.blocks_key, keys)
            _replace_set(pipe, self.host_key, host)
            # The shared set is the deployment's: only re-added (NX keeps the times it has).
            for i in range(0, len(shared), 10_000):
                pipe.zadd(self.shared_key, dict(shared[i : i + 10_000]), nx=True)
            if shared:
                cap_shared_set(pipe, self.shared_key)
            if shared_removed:
                pipe.zrem(self.shared_key, *[key_hex(k) for k in shared_removed])
            pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc)
            return
        if self.stats["full_rewrites"] or self.stats["redis_errors"]:
            log.info("rewrote %d block keys to Redis", len(keys))
        self.stats["full_rewrites"] += 1
        self.dirty = False
        self.backoff = 0.1
        self.withdrawn = False

    def delete_pod_keys(self, pipe: Any) -> None:
        """Queue the deletion of this pod's own sets (its block set and host set)."""
        pipe.delete(self.blocks_key, self.host_key)

    def _failed(self, exc: Exception) -> None:
        """A Redis operation failed (the lock held): rewrite the whole set once Redis is back."""
        self.stats["redis_errors"] += 1
        if not self.dirty:
            log.warning("Redis write failed (%s); keeping state in memory, will resync", exc)
        self.dirty = True
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, self.cfg.max_backoff)

    # -- from the heartbeat thread ---------------------------------------------------------
    def redis_error(self, exc: Exception) -> None:
        """Redis failed the heartbeat: it may have lost the set too."""
        with self.lock:
            self._failed(exc)

    def withdraw(self, problem: str, client: redis.Redis) -> None:
        """The events loop is dead or stale: its block set may be frozen. Remove it from Redis
        (the router then scores this pod by load only) until the loop rewrites it. ``client``
        is the heartbeat's: the events thread may be stuck holding its own."""
        if self.withdrawn:
            return
        log.error("%s: withdrawing this pod's block set from Redis", problem)
        locked = self.lock.acquire(timeout=1.0)
        try:
            client.delete(self.blocks_key, self.host_key)
            self.withdrawn = True
            self.stats["index_withdrawals"] += 1
            if locked:
                self.dirty = True
        finally:
            if locked:
                self.lock.release()

    def verify(self, client: redis.Redis) -> None:
        """Redis can lose the block set without any error reaching this sidecar: a Redis restarted
        (empty) between two writes is reconnected to transparently, and a flush or an eviction
        says nothing. So every heartbeat compares the set's size with the index, under the lock
        the events loop writes under (so the two agree whenever the set is not dirty), and any
        difference schedules a full rewrite. Redis answering again also ends the rewrite's backoff."""
        if not self.lock.acquire(timeout=1.0):
            return  # the events loop is busy writing: next heartbeat
        try:
            if self.withdrawn:
                return
            if self.dirty:
                self.retry_at = 0.0  # Redis answers this heartbeat: rewrite at the next iteration
                return
            pipe = client.pipeline(transaction=False)
            pipe.scard(self.blocks_key)
            pipe.scard(self.host_key)
            in_redis, host_in_redis = pipe.execute()
            host_held = len(self.index.counts[kt.MEDIUM_CPU])
            if in_redis != len(self.index.refs) or host_in_redis != host_held:
                log.warning(
                    "the block sets in Redis have %d + %d keys (GPU + host), the index %d + %d "
                    "(Redis restarted or lost data); rewriting them",
                    in_redis,
                    host_in_redis,
                    len(self.index.refs),
                    host_held,
                )
                self.stats["block_set_repairs"] += 1
                self.dirty = True
                self.retry_at = 0.0
        finally:
            self.lock.release()


def _replace_set(pipe: Any, key: str, members: list[str]) -> None:
    """Queue replacing the set ``key`` by ``members`` at once (a temporary key, then RENAME)."""
    tmp = key + ":tmp"
    pipe.delete(tmp)
    for i in range(0, len(members), 10_000):
        pipe.sadd(tmp, *members[i : i + 10_000])
    if members:
        pipe.rename(tmp, key)
    else:
        pipe.delete(key)


def cap_shared_set(pipe: Any, key: str) -> None:
    """Queue dropping the shared set's oldest members beyond ``SHARED_INDEX_MAX``."""
    pipe.zremrangebyrank(key, 0, -(kt.SHARED_INDEX_MAX + 1))
