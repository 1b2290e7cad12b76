"""KV utilisation of ready replicas, from the sidecars' Redis heartbeats.

Key layout (contract 3, owned by kvmesh/common/redis_layout.py):

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

from kvmesh.common.redis_layout import (HEARTBEAT_TTL_S, blocks_key, demand_key, heartbeat_key,  # noqa: F401
                                       pods_key)

HEARTBEAT_STALE_SECONDS = float(HEARTBEAT_TTL_S)


@dataclass(frozen=True)
class Heartbeat:
    pod: str
    url: str
    kv_usage: float
    running: int
    waiting: int
    total_blocks: int
    state: str
    ts: float
    num_keys: int | None = None     # cached blocks (optional field of the kvmesh sidecar)

    @classmethod
    def parse(cls, pod: str, h: dict[str, str]) -> "Heartbeat":
        return cls(pod=pod, url=h.get("url", ""), kv_usage=min(1.0, max(0.0, float(h.get("kv_usage", 0.0)))),
                   running=int(float(h.get("running", 0))), waiting=int(float(h.get("waiting", 0))),
                   total_blocks=int(float(h.get("total_blocks", 0))), state=h.get("state", ""),
                   ts=float(h.get("ts", 0.0)),
                   num_keys=int(float(h["num_keys"])) if h.get("num_keys") not in (None, "") else None)

    @property
    def cached_blocks(self) -> int:
        """Blocks this replica holds: the sidecar's block-key count, else the used share of its KV cache."""
        return self.num_keys if self.num_keys is not None else round(self.kv_usage * self.total_blocks)


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
        self._redis = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    async def close(self) -> None:
        await self._redis.aclose()

    async def snapshot(self, model: str, pod_prefix: str = "") -> Snapshot:
        pods = sorted(_s(p) for p in await self._redis.smembers(pods_key(model)))
        pods = [p for p in pods if p.startswith(pod_prefix)]
        if not pods:
            return Snapshot()
        async with self._redis.pipeline(transaction=False) as pipe:
            for pod in pods:
                pipe.hgetall(heartbeat_key(model, pod))
            hashes = await pipe.execute()
        now = self.clock()
        ready, draining = [], []
        for pod, raw in zip(pods, hashes):
            if not raw:
                continue  # expired: the pod is gone or hung
            try:
                hb = Heartbeat.parse(pod, {_s(k): _s(v) for k, v in raw.items()})
            except ValueError:
                continue
            if now - hb.ts > self.stale_after:
                continue
            (ready if hb.state == "ready" else draining).append(hb)
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
