"""The Discovery loop: each refresh reads the sources and Redis, joins them, and publishes pods, gauges and logs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from kvmesh.common import kv_tiers as kt
from kvmesh.common import redis_layout as rl
from kvmesh.router.discovery.join import (
    FallbackEnded,
    FallbackStarted,
    JoinState,
    Note,
    Pod,
    RedisView,
    join,
    state_counts,
)
from kvmesh.router.discovery.metrics import IGNORE_REASONS, SweptIgnored, discovery_metrics
from kvmesh.router.discovery.slice_watch import EndpointSlices
from kvmesh.router.discovery.sources import Endpoint, FileEndpoints, StaticEndpoints, normalize_url
from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router.discovery")

SWEEP_PAGE = rl.SCAN_PAGE  # names of the pods set examined per refresh


class Discovery:
    def __init__(
        self,
        model: str,
        redis_client: aioredis.Redis | None,
        metrics: RouterMetrics,
        static_backends: list[str] | None = None,
        refresh_interval: float = 0.5,
        endpoint_slices: EndpointSlices | None = None,
        backends_file: str | None = None,
        redis_stale_after: float = float(rl.HEARTBEAT_TTL_S),
        sweep_page: int = SWEEP_PAGE,
    ):
        self.model = model
        self.redis = redis_client
        self.metrics = metrics
        self.dm = discovery_metrics(metrics)
        self.refresh_interval = refresh_interval
        self.endpoint_slices = endpoint_slices
        self.redis_stale_after = redis_stale_after
        self.sources: list[Any] = []
        if static_backends:
            self.sources.append(StaticEndpoints(static_backends))
        if backends_file:
            self.sources.append(FileEndpoints(backends_file))
        if endpoint_slices is not None:
            self.sources.append(endpoint_slices)
        self.static = [
            e.url for src in self.sources if isinstance(src, StaticEndpoints) for e in src.items
        ]
        self.pods: dict[str, Pod] = {}
        self.redis_ok = False
        self.last_refresh = 0.0
        self.known: list[Endpoint] = []
        self.sweep = rl.PodsSetCursor(model, page=sweep_page)
        self._claims: dict[
            Endpoint, str
        ] = {}  # unnamed static backend -> the pod whose heartbeat names its URL
        self._swept = SweptIgnored(self.dm)
        self._state = JoinState()  # the fallback, and known pods whose heartbeat names another URL
        self._heartbeats: Mapping[str, rl.Heartbeat] | None = (
            None  # the last good Redis view (known pods only)
        )
        self._redis_read_at: float | None = None
        self._pods_key = rl.pods_key(model)
        self._page_script = (
            redis_client.register_script(rl.POD_PAGE_LUA) if redis_client is not None else None
        )
        self._task: asyncio.Task | None = None
        self._compose(*self._known_endpoints())

    # -- the view the router routes on ------------------------------------------------------------
    def routable(self) -> list[Pod]:
        pods = [p for p in self.pods.values() if p.state == rl.STATE_READY]
        if self.endpoint_slices is not None and self.endpoint_slices.ready_hosts is not None:
            hosts = self.endpoint_slices.ready_hosts  # defence in depth: only ready addresses
            pods = [p for p in pods if urlsplit(p.url).hostname in hosts]
        return pods

    @property
    def fallback(self) -> str | None:
        """Why every known pod is routed to by load only (FALLBACK_REDIS), or None."""
        return self._state.fallback

    @property
    def redis_fresh(self) -> bool:
        """True while the heartbeats held are a current Redis view (block sets may be used)."""
        return self.redis is not None and self.fallback is None and self._heartbeats is not None

    @property
    def ignored(self) -> dict[tuple[str, str], str]:
        """(pod, reason) -> the URL its heartbeat named, for the heartbeats ignored now."""
        known = {e.name for e in self.known if e.name} | set(self._claims.values())
        swept = {k: v for k, v in self._swept.items.items() if k[0] not in known}
        return {**swept, **self._state.ignored}

    def detail(self) -> dict[str, Any]:
        """For the router's /ready: where pods come from and how fresh the Redis view is."""
        age = (
            None
            if self._redis_read_at is None
            else round(time.monotonic() - self._redis_read_at, 3)
        )
        return {
            "sources": [s.describe() for s in self.sources],
            "known_pods": len(self.known),
            "routable_pods": len(self.routable()),
            "redis": "off" if self.redis is None else ("ok" if self.redis_ok else "unreachable"),
            "redis_view_age_s": age,
            "redis_stale_after_s": self.redis_stale_after,
            "fallback": self.fallback,
            "ignored_heartbeats": sum(self._swept.current().values()) + len(self._state.ignored),
        }

    def _known_endpoints(self) -> tuple[list[Endpoint], bool]:
        """Every source's endpoints, and whether every source has answered at least once."""
        seen: dict[tuple[str | None, str], Endpoint] = {}
        synced = True
        for src in self.sources:
            eps = src.endpoints()
            if eps is None:
                synced = False
            for e in eps or []:
                seen.setdefault((e.name, e.url), e)
        return list(seen.values()), synced

    def _sources_kind(self) -> str:
        return "/".join(s.describe()["kind"] for s in self.sources) or "any endpoint source"

    def _compose(self, known: list[Endpoint], synced: bool) -> None:
        """Join the endpoints with the Redis view (router/discovery/join.py), then publish the
        pods, the gauges and what the join says to count and log."""
        now = time.monotonic()
        if self.redis is not None and self._redis_read_at is not None:
            self.dm.view_age.set(round(now - self._redis_read_at, 3))
        view = (
            None
            if self.redis is None
            else RedisView(self._heartbeats, self._redis_read_at, self.redis_stale_after)
        )
        joined = join(known, synced, view, self._claims, self._state, now)
        self._heartbeats, self._state = joined.heartbeats, joined.state
        for note in joined.notes:
            self._publish_note(note)
        self.dm.fallback.set(1 if self.fallback else 0)
        for reason in IGNORE_REASONS:
            n = self._swept.current()[reason] + sum(
                1 for k in self._state.ignored if k[1] == reason
            )
            self.dm.ignored_now.labels(reason).set(n)
        self.known = known
        self.pods = joined.pods
        self.dm.known.set(len(known))
        for s, n in state_counts(joined.pods).items():
            self.metrics.pods.labels(s).set(n)

    def _publish_note(self, note: Note) -> None:
        if isinstance(note, FallbackStarted):
            log.warning(
                "no Redis view for %.1fs: routing to the %d known pods by load only",
                note.view_age_s,
                note.known,
            )
        elif isinstance(note, FallbackEnded):
            log.info("Redis view restored: routing on heartbeats and block sets again")
        else:
            self.dm.ignored.labels(note.reason).inc()
            log.warning(
                "ignoring the heartbeat of pod %r (%s): it names %r, which is not a pod this router "
                "knows from %s",
                note.pod[:100],
                note.reason,
                note.url[:200],
                self._sources_kind(),
            )

    async def refresh(self) -> None:
        known, synced = self._known_endpoints()
        if self.redis is not None:
            await self._read_redis(known, synced)
        self._compose(known, synced)
        self.last_refresh = time.monotonic()

    async def _read_redis(self, known: list[Endpoint], synced: bool) -> None:
        """One page of the pods set, then the known pods' heartbeats by name: a bounded number of
        commands, whatever the set holds. Only these say whether Redis answers."""
        named = {e.name for e in known if e.name}
        unnamed = {normalize_url(e.url): e for e in known if not e.name}
        still_known = set(unnamed.values())
        self._claims = {ep: n for ep, n in self._claims.items() if ep in still_known}
        try:
            page = await self.sweep.next_page(self.redis)
            self._classify(page, await self._page_urls(page), named, unnamed, synced)
            names = sorted(named | set(self._claims.values()))
            beats = await rl.read_heartbeats(self.redis, self.model, names) if names else {}
        except Exception as exc:  # noqa: BLE001 - any Redis/network error: keep the last view until it expires
            self.redis_ok = False
            self.metrics.redis_errors.labels("discovery").inc()
            self.metrics.redis_up.set(0)
            log.debug("discovery refresh failed: %s", exc)
            return
        self.redis_ok = True
        self.metrics.redis_up.set(1)
        found = {name: hb for name, hb in beats.items() if hb is not None}
        for ep, name in list(self._claims.items()):
            hb = found.get(name)
            if hb is None or normalize_url(hb.url) != normalize_url(ep.url):
                del self._claims[
                    ep
                ]  # gone, or it names another URL now: the sweep finds the next claim
        if self.sweep.pass_done:
            self._swept.end_pass()
            self.dm.sweep_passes.inc()
        self._heartbeats = found
        self._redis_read_at = time.monotonic()

    async def _page_urls(self, names: list[str]) -> list[Any]:
        """Per name, the URL its heartbeat names, or 0 when the heartbeat is gone (and the name is
        then removed as an orphan): one command for the page (POD_PAGE_LUA). Where scripts are
        refused (for good once Redis says they are disabled), one pipelined HGET per name, and
        orphans stay (None)."""
        if not names:
            return []
        if self._page_script is not None:
            keys = [self._pods_key]
            for name in names:
                keys += (
                    rl.heartbeat_key(self.model, name),
                    rl.blocks_key(self.model, name),
                    kt.host_blocks_key(self.model, name),
                )
            try:
                urls = await self._page_script(keys=keys, args=names)
            except ResponseError as exc:  # Redis answered: scripts are refused (or failed) here
                if any(w in str(exc).lower() for w in ("unknown command", "noscript", "noperm")):
                    log.warning(
                        "scripts are disabled on this Redis (%s): pod names without a heartbeat are "
                        "no longer removed from the pods set",
                        exc,
                    )
                    self._page_script = None
            else:
                self.dm.orphans.inc(sum(1 for u in urls if u == 0))
                return urls
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hget(rl.heartbeat_key(self.model, name), rl.F_URL)
        return await pipe.execute()

    def _classify(
        self,
        names: list[str],
        urls: list[Any],
        named: set[str],
        unnamed: dict[Any, Endpoint],
        synced: bool,
    ) -> None:
        """Sort one page's names by their heartbeat's URL: known pods (read by name anyway),
        orphans (gone), claims on unnamed static backends, and the ignored rest."""
        where = self._sources_kind()
        for name, raw in zip(names, urls):
            if name in named or raw is None or raw == 0:
                continue
            url = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            ep = unnamed.get(normalize_url(url)) if unnamed else None
            if ep is not None:
                holder = self._claims.get(ep)
                if (
                    holder is None or name <= holder
                ):  # the smallest name wins, whatever the page order
                    if holder is not None and holder != name and synced:
                        self._swept.add((holder, "duplicate_url"), url, where)
                    self._claims[ep] = name
                    continue
                reason = "duplicate_url"
            else:
                reason = "unknown_pod"
            if synced:  # before every source has answered, an unmatched heartbeat proves nothing
                self._swept.add((name, reason), url, where)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - never let the refresh loop die
                log.exception("discovery refresh failed")
            await asyncio.sleep(self.refresh_interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())
        if self.endpoint_slices is not None:
            self.endpoint_slices.start()

    async def stop(self) -> None:
        tasks = [
            t
            for t in (self._task, self.endpoint_slices._task if self.endpoint_slices else None)
            if t
        ]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them close their HTTP sessions
