"""KV utilisation of ready replicas, from the sidecars' Redis heartbeats.

Key layout (contract 3, owned by kvmesh/common/redis_layout.py, which also holds the one
``Heartbeat`` type, ``read_heartbeats()`` and ``PodsSetCursor`` used here):

* ``kvmesh:v1:{model}:pods``             set of pod names
* ``kvmesh:v1:{model}:pod:{pod_name}``   heartbeat hash (TTL ~10 s): url, model, kv_usage,
  running, waiting, total_blocks, state (ready|draining), ts (unix seconds)
* ``kvmesh:v1:{model}:blocks:{pod_name}`` block-key set (not read here; the heartbeat's
  optional ``num_keys`` is its size)
* ``kvmesh:v1:{model}:demand``           unix time a router last held a request for lack of
  a ready replica (TTL 60 s): the scale-from-zero signal
* ``kvmesh:v1:{model}:flow:queued``      requests waiting at each router (flow control): demand
  as the engines' waiting count is
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.redis_layout import (  # noqa: F401
    HEARTBEAT_TTL_S,
    STATE_READY,
    Heartbeat,
    PodsSetCursor,
    blocks_key,
    demand_key,
    heartbeat_key,
    pods_key,
    read_heartbeats,
    read_queued_at_routers,
    reconnecting_retry,
)

HEARTBEAT_STALE_SECONDS = float(HEARTBEAT_TTL_S)


@dataclass(frozen=True)
class Snapshot:
    ready: list[Heartbeat] = field(default_factory=list)
    draining: list[Heartbeat] = field(default_factory=list)

    @property
    def kv_utilization(self) -> float | None:
        """Mean KV utilisation of the ready replicas; None when there is none."""
        if not self.ready:
            return None
        return sum(h.kv_usage for h in self.ready) / len(self.ready)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# Per snapshot, at most SWEEP_PAGES pages of SWEEP_PAGE names of the pods set are examined (Redis
# filters them by the deployment's prefix: only its names come back), and the heartbeats of at
# most TRACKED_PODS names found so (beyond the listed pods) are read.
SWEEP_PAGE = 1024
SWEEP_PAGES = 16
TRACKED_PODS = 2048


class RedisHeartbeats:
    """Reads the live heartbeats of one model's pods (optionally only pods whose
    names start with ``pod_prefix``, e.g. ``<md>-engine-``, when a Redis is shared).

    Bounded work per snapshot, whatever a Redis writer adds: the pods the caller lists (from
    the API) are read by name, and the pods set is walked ``SWEEP_PAGES`` pages at a time
    (Redis filters by prefix), resuming at the next snapshot; the names it finds are read by
    name too (the ``TRACKED_PODS`` most recently found; a name is dropped once its heartbeat is
    gone), so a replica the API does not list (yet) still counts as busy. With no junk, a
    snapshot is a whole pass; with more live names under the prefix than ``TRACKED_PODS``, an
    unlisted replica counts in the snapshots after the sweep found it."""

    def __init__(
        self,
        url: str,
        *,
        stale_after: float = HEARTBEAT_STALE_SECONDS,
        clock=time.time,
        sweep_pages: int = SWEEP_PAGES,
        tracked_pods: int = TRACKED_PODS,
    ) -> None:
        import redis.asyncio as aioredis  # the operator imports without Redis until it needs it

        self.url = url
        self.stale_after = stale_after
        self.clock = clock
        self.sweep_pages = sweep_pages
        self.tracked_pods = tracked_pods
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5, retry=reconnecting_retry()
        )
        self._sweeps: dict[tuple[str, str], tuple[PodsSetCursor, dict[str, None]]] = {}

    async def close(self) -> None:
        await self._redis.aclose()

    async def snapshot(
        self, model: str, pod_prefix: str = "", pods: Iterable[str] = ()
    ) -> Snapshot:
        """`pods`: names to read whatever the pods set holds (the engine pods the API lists)."""
        cursor, tracked = self._sweeps.setdefault(
            (model, pod_prefix), (PodsSetCursor(model, pod_prefix, SWEEP_PAGE), {})
        )
        for _ in range(self.sweep_pages):
            for name in await cursor.next_page(self._redis):
                tracked.pop(name, None)
                tracked[name] = None  # the most recently found last: the oldest go first when full
            while len(tracked) > self.tracked_pods:
                del tracked[next(iter(tracked))]
            if cursor.pass_done:
                break
        listed = [p for p in pods if p.startswith(pod_prefix)]
        beats = await read_heartbeats(self._redis, model, sorted(set(tracked).union(listed)))
        for name, hb in beats.items():
            if hb is None:
                tracked.pop(name, None)
        now = self.clock()
        ready, draining = [], []
        for hb in beats.values():
            if hb is None or not hb.fresh(now, self.stale_after):
                continue  # expired or stale: the pod is gone or hung
            (ready if hb.state == STATE_READY else draining).append(hb)
        return Snapshot(ready=ready, draining=draining)

    async def queued_at_routers(self, model: str) -> int:
        """Requests waiting at the routers (flow control), from their fresh entries."""
        return await read_queued_at_routers(self._redis, model, self.clock())

    async def demand(self, model: str) -> float | None:
        """When a router last held a request for lack of a ready replica (unix time), if
        within the key's TTL; None otherwise."""
        raw = await self._redis.get(demand_key(model))
        if raw is None:
            return None
        try:
            return float(_s(raw))
        except ValueError:
            return 0.0  # present but unreadable: still a demand
