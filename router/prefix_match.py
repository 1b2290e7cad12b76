"""How long a prefix of a prompt's block keys each pod holds: one Redis round trip, paused after a Redis error."""

from __future__ import annotations

import logging
import time

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import key_hex
from kvmesh.router.discovery import Pod
from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router")


class PrefixMatch:
    def __init__(self, model: str, metrics: RouterMetrics, retry_after: float):
        self.model = model
        self.metrics = metrics
        self.retry_after = retry_after
        self.discovery = None
        self.redis = None  # None: no Redis (routing goes by load)
        self._script = None
        self._use_lua = True
        self._down_until = 0.0

    def attach(self, discovery, redis) -> None:
        """At the router's startup: the pods' discovery and the Redis client (or None)."""
        self.discovery = discovery
        self.redis = redis
        self._script = redis.register_script(rl.PREFIX_MATCH_LUA) if redis is not None else None

    def state(self) -> str:
        """Whether routing may read the pods' block sets now: "usable"; "off" (no Redis);
        "no current Redis view" (discovery's view expired); "paused after a Redis error" (for
        redis_retry_after, so that a Redis that is down costs each request one failed call at most)."""
        if self.redis is None:
            return "off"
        if not self.discovery.redis_fresh:
            return "no current Redis view"
        if time.monotonic() < self._down_until:
            return "paused after a Redis error"
        return "usable"

    async def match(self, pods: list[Pod], keys: list[int]) -> dict[str, int] | None:
        """Matched leading blocks per pod, in one Redis round trip; None if Redis is unavailable."""
        if self.state() != "usable":
            return None
        named = [p.name for p in pods if p.has_blocks]
        if not named:
            return {}
        bkeys = [rl.blocks_key(self.model, n) for n in named]
        hexes = [key_hex(k) for k in keys]
        try:
            counts = await self._counts(bkeys, hexes)
        except Exception as exc:  # noqa: BLE001 - never fail a request because of Redis
            self.metrics.redis_errors.labels("match").inc()
            self.metrics.redis_up.set(0)
            self._down_until = time.monotonic() + self.retry_after
            log.debug("prefix match failed: %s", exc)
            return None
        return dict(zip(named, (int(c) for c in counts)))

    async def _counts(self, bkeys: list[str], hexes: list[str]) -> list:
        if self._use_lua:
            try:
                return await self._script(keys=bkeys, args=["".join(hexes)])
            except Exception as exc:  # noqa: BLE001
                if "unknown command" in str(exc).lower() or "noscript" in str(exc).lower():
                    self._use_lua = False  # EVAL disabled on this Redis: use SMISMEMBER
                raise
        pipe = self.redis.pipeline(transaction=False)
        for b in bkeys:
            pipe.smismember(b, hexes)
        return [rl.leading_run(flags) for flags in await pipe.execute()]
