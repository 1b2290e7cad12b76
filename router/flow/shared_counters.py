"""Fair share across router replicas: a periodic, batched sync of each tenant's service through the Redis the routers share.

Every `interval` seconds, off the request path, one pipelined round trip adds this router's
service per tenant since the last sync to the fleet's totals (``flow:service``, HINCRBYFLOAT),
reads the totals of the tenants this router tracks (HMGET: bounded by its tenant table) and
publishes its queue depth (``flow:queued``, the autoscalers' demand). What the totals grew by,
less this router's own part, is what the other routers gave: it is added to the local
counters. A tenant's first read is its baseline. Approximate by design: a router sees the
others' service up to one interval late; Redis down only means local fair share meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvmesh.common import redis_layout as rl
from kvmesh.router.flow.fairness import VirtualCounters

log = logging.getLogger("kvmesh.router")


class SharedCounters:
    def __init__(
        self,
        redis,
        model: str,
        router_id: str,
        counters: VirtualCounters,
        depth: Callable[[], int],
        on_error: Callable[[], None] = lambda: None,
    ):
        self.redis = redis
        self.service_key = rl.flow_service_key(model)
        self.queued_key = rl.flow_queued_key(model)
        self.router_id = router_id
        self.counters = counters
        self.depth = depth
        self.on_error = on_error
        self._seen: dict[str, float] = {}  # tenant -> the fleet's total at the last sync
        self._warned = -1e9

    async def sync_once(self) -> None:
        local = self.counters.take_local()
        tenants = self.counters.tenants()
        pipe = self.redis.pipeline(transaction=False)
        for tenant, amount in local.items():
            pipe.hincrbyfloat(self.service_key, tenant, amount)
        pipe.expire(self.service_key, rl.FLOW_TTL_S)
        if tenants:
            pipe.hmget(self.service_key, tenants)
        pipe.hset(self.queued_key, self.router_id, rl.queued_entry(self.depth(), time.time()))
        pipe.expire(self.queued_key, rl.FLOW_TTL_S)
        try:
            replies = await pipe.execute()
        except Exception:
            self.counters.give_back_local(local)
            raise
        totals = replies[len(local) + 1] if tenants else []
        self._take_totals(tenants, totals, local)

    def _take_totals(self, tenants: list[str], totals: list, local: dict[str, float]) -> None:
        seen = {}
        for tenant, raw in zip(tenants, totals, strict=True):
            try:
                total = float(raw or 0)
            except ValueError:
                continue
            seen[tenant] = total
            before = self._seen.get(tenant)
            if before is not None:
                self.counters.add_remote(tenant, total - before - local.get(tenant, 0.0))
        self._seen = seen

    async def run(self, interval: float) -> None:
        while True:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - fair share stays local until Redis answers
                self.on_error()
                now = time.monotonic()
                if now - self._warned > 30:
                    self._warned = now
                    log.warning("flow control: could not sync fair share through Redis: %s", exc)
            await asyncio.sleep(interval)

    async def forget(self) -> None:
        """At shutdown: this router's queue depth no longer counts."""
        try:
            await self.redis.hdel(self.queued_key, self.router_id)
        except Exception:  # noqa: BLE001 - its entry goes stale on its own
            pass
