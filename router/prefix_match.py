"""How long a prefix of a prompt's block keys each pod holds, per KV tier: one Redis round trip, paused after a Redis error."""

from __future__ import annotations

import logging
import time

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import key_hex
from kvmesh.router.discovery import Pod
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.scoring import Candidate

log = logging.getLogger("kvmesh.router")

Tiers = tuple[int, int, int]  # a pod's matched leading blocks: (g, c, s), GPU then CPU or SHARED


def tier_flags(pod: Pod) -> str:
    """PREFIX_MATCH_TIERS_LUA's digit for a pod: 1 for a host tier, plus 2 for the shared tier."""
    return str((1 if pod.host_tier else 0) + (2 if pod.shared_tier else 0))


def tier_run(gpu: list, host: list | None, shared: list | None) -> Tiers:
    """(g, c, s) from per-key membership flags (SMISMEMBER, ZMSCORE): the leading run in the
    KV cache, then block by block in the host tier, else the shared tier, up to a miss."""
    g = rl.leading_run(gpu)
    c = s = 0
    for j in range(g, len(gpu)):
        if host is not None and host[j]:
            c += 1
        elif shared is not None and shared[j] is not None:
            s += 1
        else:
            break
    return g, c, s


def predicted_by_medium(cand: Candidate, max_blocks: int, block_size: int) -> dict[str, int]:
    """The prompt tokens a pod should serve from each tier: its matched blocks, at most
    ``max_blocks`` (the last prompt token is always computed), taken GPU, then CPU, then SHARED."""
    out, left = {}, max(max_blocks, 0)
    for medium, n in (
        (kt.MEDIUM_GPU, cand.matched_blocks),
        (kt.MEDIUM_CPU, cand.cpu_blocks),
        (kt.MEDIUM_SHARED, cand.shared_blocks),
    ):
        take = min(n, left)
        out[medium] = take * block_size
        left -= take
    return out


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
        self._script = (
            redis.register_script(rl.PREFIX_MATCH_TIERS_LUA) if redis is not None else None
        )

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

    async def match(self, pods: list[Pod], keys: list[int]) -> dict[str, Tiers] | None:
        """Matched leading blocks per pod and tier (g, c, s), in one Redis round trip; None if
        Redis is unavailable."""
        if self.state() != "usable":
            return None
        named = [p for p in pods if p.has_blocks]
        if not named:
            return {}
        hexes = [key_hex(k) for k in keys]
        try:
            counts = await self._counts(named, hexes)
        except Exception as exc:  # noqa: BLE001 - never fail a request because of Redis
            self.metrics.redis_errors.labels("match").inc()
            self.metrics.redis_up.set(0)
            self._down_until = time.monotonic() + self.retry_after
            log.debug("prefix match failed: %s", exc)
            return None
        return {p.name: c for p, c in zip(named, counts)}

    async def _counts(self, pods: list[Pod], hexes: list[str]) -> list[Tiers]:
        if self._use_lua:
            keys = [kt.shared_blocks_key(self.model)]
            for p in pods:
                keys += (rl.blocks_key(self.model, p.name), kt.host_blocks_key(self.model, p.name))
            args = ["".join(hexes), "".join(tier_flags(p) for p in pods)]
            try:
                flat = [int(v) for v in await self._script(keys=keys, args=args)]
            except Exception as exc:  # noqa: BLE001
                if "unknown command" in str(exc).lower() or "noscript" in str(exc).lower():
                    self._use_lua = False  # EVAL disabled on this Redis: use SMISMEMBER
                raise
            return [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
        return await self._counts_pipelined(pods, hexes)

    async def _counts_pipelined(self, pods: list[Pod], hexes: list[str]) -> list[Tiers]:
        """Without scripts: one pipeline of SMISMEMBER per set (and one ZMSCORE of the shared
        set); a tier set of the wrong type counts as empty."""
        pipe = self.redis.pipeline(transaction=False)
        for p in pods:
            pipe.smismember(rl.blocks_key(self.model, p.name), hexes)
            if p.host_tier:
                pipe.smismember(kt.host_blocks_key(self.model, p.name), hexes)
        any_shared = any(p.shared_tier for p in pods)
        if any_shared:
            pipe.zmscore(kt.shared_blocks_key(self.model), hexes)
        replies = iter(await pipe.execute(raise_on_error=False))
        out = []
        for p in pods:
            gpu = next(replies)
            if isinstance(gpu, Exception):
                raise gpu
            host = _flags(next(replies)) if p.host_tier else None
            out.append((gpu, host))
        shared = _flags(next(replies)) if any_shared else None
        return [
            tier_run(gpu, host, shared if p.shared_tier else None)
            for p, (gpu, host) in zip(pods, out)
        ]


def _flags(reply) -> list | None:
    """A tier set's reply: None (as if empty) when it was an error (a key of the wrong type)."""
    return None if isinstance(reply, Exception) else reply
