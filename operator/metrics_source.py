"""KV utilisation of ready replicas, from the sidecars' Redis heartbeats.

Key layout (contract 3, owned by kvmesh/common/redis_layout.py, which also holds the one
``Heartbeat`` type and ``read_heartbeats()`` used here):

* ``kvmesh:v1:{model}:pods``             set of pod names
* ``kvmesh:v1:{model}:pod:{pod_name}``   heartbeat hash (TTL ~10 s): url, model, kv_usage,
  running, waiting, total_blocks, state (ready|draining), ts (unix seconds)
* ``kvmesh:v1:{model}:blocks:{pod_name}`` block-key set (not read here; the heartbeat's
  optional ``num_keys`` is its size)
* ``kvmesh:v1:{model}:demand``           unix time a router last held a request for lack of
  a ready replica (TTL 60 s): the scale-from-zero signal
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.redis_layout import (HEARTBEAT_TTL_S, STATE_READY, Heartbeat, blocks_key,  # noqa: F401
                                       demand_key, heartbeat_key, pods_key, read_heartbeats, reconnecting_retry)

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


class RedisHeartbeats:
    """Reads the live heartbeats of one model's pods (optionally only pods whose
    names start with ``pod_prefix``, e.g. ``<md>-engine-``, when a Redis is shared)."""

    def __init__(self, url: str, *, stale_after: float = HEARTBEAT_STALE_SECONDS, clock=time.time) -> None:
        import redis.asyncio as aioredis  # the operator imports without Redis until it needs it

        self.url = url
        self.stale_after = stale_after
        self.clock = clock
        self._redis = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5,
                                              retry=reconnecting_retry())

    async def close(self) -> None:
        await self._redis.aclose()

    async def snapshot(self, model: str, pod_prefix: str = "") -> Snapshot:
        beats = await read_heartbeats(self._redis, model, prefix=pod_prefix)
        now = self.clock()
        ready, draining = [], []
        for hb in beats.values():
            if hb is None or not hb.fresh(now, self.stale_after):
                continue  # expired or stale: the pod is gone or hung
            (ready if hb.state == STATE_READY else draining).append(hb)
        return Snapshot(ready=ready, draining=draining)

    async def demand(self, model: str) -> float | None:
        """When a router last held a request for lack of a ready replica (unix time), if
        within the key's TTL; None otherwise."""
        raw = await self._redis.get(demand_key(model))
        if raw is None:
            return None
        try:
            return float(_s(raw))
        except ValueError:
            return 0.0   # present but unreadable: still a demand
