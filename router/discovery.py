"""Which pods the router may use (DESIGN.md contract 3, "Trust").

Where a pod is reachable comes from the platform, never from Redis. The router knows its
pods from one or more *endpoint sources*:

* ``--k8s-service``: the ready endpoints of the engine Service's EndpointSlices (list, then
  watch, with the pod's service account). A pod is named by its ``targetRef`` (the Pod name,
  which is the sidecar's ``--pod-name``); its URL is the endpoint address and the slice's
  ``http`` port.
* ``--static-backends``: a fixed list of ``URL`` or ``NAME=URL``.
* ``--backends-file``: ``NAME=URL`` lines that the router re-reads when the file changes
  (``kvmesh up``'s supervisor writes it as it adds and removes replicas).

Redis heartbeats only add load, readiness (``ready``/``draining``) and a block set to a pod
the router already knows. A heartbeat is matched to a known pod by its name (and must then
name the same URL), or, for an unnamed static backend, by its URL. The router always sends
traffic to the URL from the platform. Any other heartbeat (an unknown pod, a URL that does
not match) is ignored and counted (``kvmesh_router_ignored_heartbeats_total{reason}``), so
whoever can write Redis can at worst skew the scores of known pods, never redirect a request.

Bounded work: whatever a Redis writer adds, a refresh runs one page of the pods set
(``SWEEP_PAGE`` names, SSCAN, resuming where the last refresh stopped), one command for that
page's heartbeat URLs (``POD_PAGE_LUA``) and one pipelined read of the known pods' heartbeats by
name. A name on the page is judged by its heartbeat's URL alone, before anything else of it is
read: an orphan (no heartbeat) has its block set and membership deleted by that same command;
the URL of an unnamed static backend makes the name that backend's heartbeat (read by name
from then on; the smallest such name wins); anything else is ignored and counted. A pile of
junk names is worked down a page per refresh and never delays the known pods' heartbeats, so
Redis is called unreachable only when these few commands fail. An unnamed static backend
may wait up to a pass over the set for its heartbeat to be found (routed by load meanwhile).

Routability:
* Redis answering: a *named* pod (Kubernetes, ``NAME=URL``) needs a live heartbeat in state
  ``ready`` (it has a sidecar, which only heart-beats once its engine is ready); an unnamed
  static backend without a heartbeat is routed to by load.
* Redis unreachable: the last heartbeats are used for ``--redis-stale-after`` seconds (10 s,
  the heartbeat TTL); after that the view expires and every known pod is routed to by load
  only (in-flight counts), until Redis answers again. ``/ready`` and
  ``kvmesh_router_discovery_fallback`` say so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import quote, urlsplit

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import ResponseError

from kvmesh.common import redis_layout as rl
from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router.discovery")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
STATE_NO_HEARTBEAT = "no_heartbeat"  # a known pod with a sidecar whose heartbeat is missing
STATE_UNKNOWN = "unknown"  # a heartbeat state this router does not know (never routed to)
STATE_NOT_READY = "not_ready"  # the platform lists the pod as not ready
IGNORE_REASONS = ("unknown_pod", "url_mismatch", "duplicate_url")
FALLBACK_REDIS = "redis_unavailable"
SWEEP_PAGE = rl.SCAN_PAGE  # names of the pods set examined per refresh
IGNORED_TRACKED = 10_000  # ignored heartbeats remembered (for the counter and /ready); more are only counted
IGNORED_LOGGED = 20  # new ignored heartbeats logged one by one per pass over the pods set


@dataclass
class Pod:
    name: str
    url: str
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    state: str = rl.STATE_READY
    has_blocks: bool = True  # has a Redis block set (a sidecar)
    ts: float = 0.0

    @property
    def load(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class Endpoint:
    """A pod as the platform knows it: `name` is None for an unnamed static backend; `ready`
    is False for an endpoint Kubernetes lists as not ready (starting, failing its readiness
    probe, terminating): known, so its heartbeat is not "unknown", but never routed to."""

    name: str | None
    url: str
    ready: bool = True


def normalize_url(url: str) -> tuple[str, str, int | None, str] | None:
    """(scheme, host, port, path) for comparing URLs; None if it is not an http(s) URL."""
    try:
        u = urlsplit(url.strip())
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    return u.scheme, u.hostname.lower(), port, u.path.rstrip("/")


def parse_backend(entry: str) -> Endpoint:
    """`URL` or `NAME=URL` (a static backend, a line of --backends-file)."""
    entry = entry.strip()
    name: str | None = None
    if "=" in entry and "://" not in entry.split("=", 1)[0]:
        name, entry = (x.strip() for x in entry.split("=", 1))
        if not name:
            raise ValueError(f"backend {entry!r}: empty name before '='")
    if normalize_url(entry) is None:
        raise ValueError(f"backend {entry!r} is not an http(s) URL")
    return Endpoint(name, entry.rstrip("/"))


class StaticEndpoints:
    def __init__(self, entries: Iterable[str]):
        self.items = [parse_backend(e) for e in entries if e.strip()]
        names = [e.name for e in self.items if e.name]
        if len(names) != len(set(names)):
            raise ValueError("duplicate backend names in --static-backends")

    def endpoints(self) -> list[Endpoint] | None:
        return self.items

    def describe(self) -> dict[str, Any]:
        return {"kind": "static", "endpoints": len(self.items)}


class FileEndpoints:
    """`NAME=URL` (or `URL`) lines, `#` comments; re-read when the file changes. A file that
    cannot be read or parsed keeps the last good list (and says so in `error`)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self.items: list[Endpoint] | None = None
        self.error: str | None = None

    def endpoints(self) -> list[Endpoint] | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
            if stamp != self._stamp:
                with open(self.path) as f:
                    lines = [ln.split("#", 1)[0].strip() for ln in f]
                self.items = [parse_backend(ln) for ln in lines if ln]
                self._stamp = stamp
                self.error = None
        except (OSError, ValueError) as exc:
            if self.error != str(exc):
                log.warning("--backends-file %s: %s (keeping the last good list)", self.path, exc)
            self.error = str(exc)
        return self.items

    def describe(self) -> dict[str, Any]:
        return {"kind": "file", "path": self.path, "endpoints": len(self.items or []), "error": self.error}


class _DiscoveryMetrics:
    """Discovery's own series, registered on the router's registry."""

    def __init__(self, metrics: RouterMetrics):
        r = metrics.registry
        self.ignored = Counter("kvmesh_router_ignored_heartbeats",
                               "Heartbeats ignored because they name a pod or URL the platform does not know "
                               "(counted once each time one appears)", ["reason"], registry=r)
        self.ignored_now = Gauge("kvmesh_router_ignored_heartbeats_current",
                                 "Heartbeats ignored now (the last pass over the pods set)", ["reason"], registry=r)
        self.known = Gauge("kvmesh_router_known_pods", "Pods known from the endpoint sources (platform)",
                           registry=r)
        self.fallback = Gauge("kvmesh_router_discovery_fallback",
                              "1 while routing to the platform's pods by load only because the Redis view "
                              "expired", registry=r)
        self.view_age = Gauge("kvmesh_router_redis_view_age_seconds",
                              "Seconds since heartbeats were last read from Redis (-1: never)", registry=r)
        self.orphans = Counter("kvmesh_router_orphans_removed",
                               "Pod names without a heartbeat removed from the pods set (with their block sets)",
                               registry=r)
        self.sweep_passes = Counter("kvmesh_router_pods_set_passes",
                                    "Full passes over the pods set (one page per refresh)", registry=r)
        for reason in IGNORE_REASONS:
            self.ignored.labels(reason)
            self.ignored_now.labels(reason).set(0)
        self.view_age.set(-1)


def _discovery_metrics(metrics: RouterMetrics) -> _DiscoveryMetrics:
    dm = getattr(metrics, "_discovery", None)
    if dm is None:
        dm = metrics._discovery = _DiscoveryMetrics(metrics)
    return dm


class _SweptIgnored:
    """Heartbeats the pods-set sweep ignored: those of the current pass and the last complete
    one, at most IGNORED_TRACKED remembered (and counted once each); how many the last complete
    pass saw, all of them; and a log line for at most IGNORED_LOGGED new ones per pass."""

    def __init__(self, dm: _DiscoveryMetrics):
        self.dm = dm
        self.items: dict[tuple[str, str], str] = {}  # (pod, reason) -> the URL its heartbeat named
        self.by_reason = {reason: 0 for reason in IGNORE_REASONS}
        self.last_pass: dict[str, int] | None = None  # reason -> heartbeats ignored in the last full pass
        self._this_pass: set[tuple[str, str]] = set()
        self._counts = {reason: 0 for reason in IGNORE_REASONS}
        self._logged = 0
        self._not_logged = 0

    def current(self) -> dict[str, int]:
        """reason -> heartbeats ignored now: the last full pass, or what this first one has seen."""
        return self.last_pass if self.last_pass is not None else self.by_reason

    def add(self, key: tuple[str, str], url: str, where: str) -> None:
        self._counts[key[1]] += 1
        if key in self.items:
            self._this_pass.add(key)
            return
        if len(self.items) >= IGNORED_TRACKED:
            return
        self._this_pass.add(key)
        self.items[key] = url
        self.by_reason[key[1]] += 1
        self.dm.ignored.labels(key[1]).inc()
        if self._logged >= IGNORED_LOGGED:
            self._not_logged += 1
            return
        self._logged += 1
        log.warning("ignoring the heartbeat of pod %r (%s): it names %r, which is not a pod this router "
                    "knows from %s", key[0][:100], key[1], url[:200], where)

    def end_pass(self) -> None:
        """Forget what this pass did not see again (the heartbeat is gone, or the pod is known now)."""
        for key in [k for k in self.items if k not in self._this_pass]:
            del self.items[key]
            self.by_reason[key[1]] -= 1
        if self._not_logged:
            log.warning("ignoring %d more heartbeats of pods this router does not know (not logged one by one)",
                        self._not_logged)
        self.last_pass = self._counts
        self._this_pass, self._logged, self._not_logged = set(), 0, 0
        self._counts = {reason: 0 for reason in IGNORE_REASONS}


class Discovery:
    def __init__(self, model: str, redis_client: aioredis.Redis | None, metrics: RouterMetrics,
                 static_backends: list[str] | None = None, refresh_interval: float = 0.5,
                 endpoint_slices: "EndpointSlices | None" = None, backends_file: str | None = None,
                 redis_stale_after: float = float(rl.HEARTBEAT_TTL_S), sweep_page: int = SWEEP_PAGE):
        self.model = model
        self.redis = redis_client
        self.metrics = metrics
        self.dm = _discovery_metrics(metrics)
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
        self.static = [e.url for src in self.sources if isinstance(src, StaticEndpoints) for e in src.items]
        self.pods: dict[str, Pod] = {}
        self.redis_ok = False
        self.last_refresh = 0.0
        self.fallback: str | None = None
        self.known: list[Endpoint] = []
        self.sweep = rl.PodsSetCursor(model, page=sweep_page)
        self._claims: dict[Endpoint, str] = {}  # unnamed static backend -> the pod whose heartbeat names its URL
        self._swept = _SweptIgnored(self.dm)
        self._ignored_by_name: dict[tuple[str, str], str] = {}  # known pods whose heartbeat names another URL
        self._heartbeats: dict[str, rl.Heartbeat] | None = None  # the last good Redis view (known pods only)
        self._redis_read_at: float | None = None
        self._pods_key = rl.pods_key(model)
        self._page_script = redis_client.register_script(rl.POD_PAGE_LUA) if redis_client is not None else None
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
    def redis_fresh(self) -> bool:
        """True while the heartbeats held are a current Redis view (block sets may be used)."""
        return self.redis is not None and self.fallback is None and self._heartbeats is not None

    @property
    def ignored(self) -> dict[tuple[str, str], str]:
        """(pod, reason) -> the URL its heartbeat named, for the heartbeats ignored now."""
        known = {e.name for e in self.known if e.name} | set(self._claims.values())
        swept = {k: v for k, v in self._swept.items.items() if k[0] not in known}
        return {**swept, **self._ignored_by_name}

    def detail(self) -> dict[str, Any]:
        """For the router's /ready: where pods come from and how fresh the Redis view is."""
        age = None if self._redis_read_at is None else round(time.monotonic() - self._redis_read_at, 3)
        return {
            "sources": [s.describe() for s in self.sources],
            "known_pods": len(self.known),
            "routable_pods": len(self.routable()),
            "redis": "off" if self.redis is None else ("ok" if self.redis_ok else "unreachable"),
            "redis_view_age_s": age,
            "redis_stale_after_s": self.redis_stale_after,
            "fallback": self.fallback,
            "ignored_heartbeats": sum(self._swept.current().values()) + len(self._ignored_by_name),
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
        now = time.monotonic()
        if self.redis is not None and self._redis_read_at is not None:
            self.dm.view_age.set(round(now - self._redis_read_at, 3))
        hbs = self._heartbeats
        fallback = None
        expired = self._redis_read_at is None or now - self._redis_read_at > self.redis_stale_after
        if self.redis is not None and expired:
            # No current Redis view: drop the last heartbeats (their load and block sets are
            # older than a heartbeat's TTL) and route to every known pod by load only.
            if self.fallback is None and self._redis_read_at is not None:
                log.warning("no Redis view for %.1fs: routing to the %d known pods by load only",
                            now - self._redis_read_at, len(known))
            hbs = self._heartbeats = None
            fallback = FALLBACK_REDIS
        elif self.fallback is not None:
            log.info("Redis view restored: routing on heartbeats and block sets again")
        self.fallback = fallback
        self.dm.fallback.set(1 if fallback else 0)

        named = {e.name: e for e in known if e.name}
        pods: dict[str, Pod] = {}
        ignored: dict[tuple[str, str], str] = {}
        for ep in known:
            if ep.name and ep is not named[ep.name]:
                continue  # a name listed twice (two sources): the last one's URL
            if ep.name:
                name, hb = ep.name, (hbs or {}).get(ep.name)
                if hb is not None and normalize_url(hb.url) != normalize_url(ep.url):
                    if synced:  # before every source has answered, an unmatched heartbeat proves nothing
                        ignored[(name, "url_mismatch")] = hb.url
                    hb = None
            else:
                claim = self._claims.get(ep)
                hb = (hbs or {}).get(claim) if claim and claim not in named else None
                if hb is not None and normalize_url(hb.url) != normalize_url(ep.url):
                    hb = None
                name = claim if hb is not None else ep.url
            if name in pods:
                continue
            if hb is not None:
                state = hb.state if hb.state in (rl.STATE_READY, rl.STATE_DRAINING) else STATE_UNKNOWN
                if not ep.ready:
                    state = STATE_NOT_READY
                # The URL is always the platform's; the heartbeat adds load, state and its block set.
                # Numbers from Redis are clamped: a NaN or a negative load must not upset the ranking.
                kv = hb.kv_usage if math.isfinite(hb.kv_usage) else 1.0
                pods[name] = Pod(name=name, url=ep.url, kv_usage=min(max(kv, 0.0), 1.0),
                                 running=max(0, hb.running), waiting=max(0, hb.waiting), state=state,
                                 has_blocks=True, ts=hb.ts)
            elif not ep.ready:
                pods[name] = Pod(name=name, url=ep.url, state=STATE_NOT_READY, has_blocks=False)
            elif hbs is None or not ep.name:
                # No Redis (or an expired view), or an unnamed static backend: by load only.
                pods[name] = Pod(name=name, url=ep.url, has_blocks=False)
            else:
                pods[name] = Pod(name=name, url=ep.url, state=STATE_NO_HEARTBEAT, has_blocks=False)
        for key in ignored.keys() - self._ignored_by_name.keys():
            self.dm.ignored.labels(key[1]).inc()
            log.warning("ignoring the heartbeat of pod %r (%s): it names %r, which is not a pod this router "
                        "knows from %s", key[0][:100], key[1], ignored[key][:200], self._sources_kind())
        self._ignored_by_name = ignored
        for reason in IGNORE_REASONS:
            n = self._swept.current()[reason] + sum(1 for k in ignored if k[1] == reason)
            self.dm.ignored_now.labels(reason).set(n)
        self.known = known
        self.pods = pods
        self.dm.known.set(len(known))
        states = {rl.STATE_READY: 0, rl.STATE_DRAINING: 0, STATE_NO_HEARTBEAT: 0, STATE_NOT_READY: 0,
                  STATE_UNKNOWN: 0}
        for p in pods.values():
            states[p.state] = states.get(p.state, 0) + 1
        for s, n in states.items():
            self.metrics.pods.labels(s).set(n)

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
                del self._claims[ep]  # gone, or it names another URL now: the sweep finds the next claim
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
                keys += (rl.heartbeat_key(self.model, name), rl.blocks_key(self.model, name))
            try:
                urls = await self._page_script(keys=keys, args=names)
            except ResponseError as exc:  # Redis answered: scripts are refused (or failed) here
                if any(w in str(exc).lower() for w in ("unknown command", "noscript", "noperm")):
                    log.warning("scripts are disabled on this Redis (%s): pod names without a heartbeat are "
                                "no longer removed from the pods set", exc)
                    self._page_script = None
            else:
                self.dm.orphans.inc(sum(1 for u in urls if u == 0))
                return urls
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hget(rl.heartbeat_key(self.model, name), rl.F_URL)
        return await pipe.execute()

    def _classify(self, names: list[str], urls: list[Any], named: set[str], unnamed: dict[Any, Endpoint],
                  synced: bool) -> None:
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
                if holder is None or name <= holder:  # the smallest name wins, whatever the page order
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
        tasks = [t for t in (self._task, self.endpoint_slices._task if self.endpoint_slices else None) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them close their HTTP sessions


class EndpointSlices:
    """The ready endpoints of a Service's EndpointSlices: a list, then a watch from its
    resourceVersion (re-listing when the watch ends, fails or is told 410 Gone).

    `endpoints()` is None until the first successful list; after a failure the last good
    answer is kept (an API outage never empties the pool). The service-account token is
    re-read for every request (projected tokens rotate).

    RBAC: `get`, `list` and `watch` on `endpointslices` in API group `discovery.k8s.io`,
    in the Service's namespace."""

    def __init__(self, service: str, namespace: str | None = None, api_url: str | None = None,
                 token: str | None = None, ca_file: str | None = None, interval: float = 5.0,
                 port_name: str = "http", watch: bool = True, watch_timeout: int = 300):
        self.service = service
        self.namespace = namespace or _read(f"{SA_DIR}/namespace") or "default"
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if host and ":" in host:
            host = f"[{host}]"
        self.api_url = (api_url or (f"https://{host}:{port}" if host else "https://kubernetes.default.svc")).rstrip("/")
        self.token = token
        self.token_file = None if token is not None else f"{SA_DIR}/token"
        self.ca_file = ca_file or (f"{SA_DIR}/ca.crt" if os.path.exists(f"{SA_DIR}/ca.crt") else None)
        self.interval = interval
        self.port_name = port_name
        self.watch = watch
        self.watch_timeout = watch_timeout
        self.slices: dict[str, tuple[list[Endpoint], set[str]]] = {}  # name -> (endpoints, ready addresses)
        self.synced = False
        self.last_error: str | None = None
        self.lists = 0
        self.watch_events = 0
        self._endpoints: list[Endpoint] | None = None
        self._hosts: set[str] | None = None
        self._task: asyncio.Task | None = None

    # -- the answer ---------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint] | None:
        """Every endpoint of the Service's slices (not-ready ones marked); None before the first list."""
        return self._endpoints

    @property
    def ready_hosts(self) -> set[str] | None:
        """Ready addresses (None before the first list)."""
        return self._hosts

    def describe(self) -> dict[str, Any]:
        return {"kind": "k8s", "service": self.service, "namespace": self.namespace, "synced": self.synced,
                "endpoints": len(self._endpoints or []), "error": self.last_error}

    def _publish(self) -> None:
        seen: dict[str, Endpoint] = {}
        hosts: set[str] = set()
        for eps, addrs in self.slices.values():
            hosts |= addrs
            for e in eps:
                if e.ready or (e.name or e.url) not in seen:  # a pod in two slices: ready wins
                    seen[e.name or e.url] = e
        self._endpoints = list(seen.values())
        self._hosts = hosts

    def parse_slice(self, item: Any) -> tuple[list[Endpoint], set[str]]:
        """The ready endpoints of one EndpointSlice, named by their Pod, and its ready addresses.
        The port is the slice's port named `port_name` (`http`), else its first port."""
        if not isinstance(item, dict):
            return [], set()
        ports = [p for p in item.get("ports") or [] if isinstance(p, dict) and isinstance(p.get("port"), int)]
        port = next((p["port"] for p in ports if p.get("name") == self.port_name), None)
        if port is None and ports:
            port = ports[0]["port"]
        ipv6 = item.get("addressType") == "IPv6"
        out, hosts = [], set()
        for ep in item.get("endpoints") or []:
            if not isinstance(ep, dict):
                continue
            cond = ep.get("conditions") or {}
            ready = isinstance(cond, dict) and cond.get("ready") is not False  # nil means ready (the API's rule)
            addrs = [a for a in ep.get("addresses") or [] if isinstance(a, str) and a]
            if not addrs:
                continue
            if ready:
                hosts.update(addrs)
            if port is None:
                continue  # a Service without ports: nothing to send requests to
            host = f"[{addrs[0]}]" if ipv6 or ":" in addrs[0] else addrs[0]
            ref = ep.get("targetRef") if isinstance(ep.get("targetRef"), dict) else {}
            name = ref.get("name") if ref.get("kind", "Pod") == "Pod" and isinstance(ref.get("name"), str) else None
            out.append(Endpoint(name, f"http://{host}:{port}", ready))
        return out, hosts

    # -- the Kubernetes API -------------------------------------------------------------------------
    def _url(self, **params: str) -> str:
        query = "&".join([f"labelSelector={quote('kubernetes.io/service-name=' + self.service)}"] +
                         [f"{k}={quote(str(v))}" for k, v in params.items()])
        return f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{quote(self.namespace)}/endpointslices?{query}"

    def _headers(self) -> dict[str, str]:
        token = self.token if self.token is not None else (_read(self.token_file) if self.token_file else None)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl(self, url: str):
        return ssl.create_default_context(cafile=self.ca_file) if url.startswith("https") else None

    async def _list(self, session) -> str:
        import aiohttp

        url = self._url()
        async with session.get(url, headers=self._headers(), ssl=self._ssl(url),
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            r.raise_for_status()
            data = await r.json(content_type=None)
        self.slices = {}
        for item in data.get("items") or []:
            name = ((item or {}).get("metadata") or {}).get("name") or f"#{len(self.slices)}"
            self.slices[name] = self.parse_slice(item)
        self._publish()
        self.synced = True
        self.last_error = None
        self.lists += 1
        return str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, session, rv: str) -> str | None:
        """Apply watch events until the server ends the watch; the resourceVersion to resume
        from, or None to re-list (410 Gone, or an ERROR event)."""
        import aiohttp

        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_timeout)}
        if rv:
            params["resourceVersion"] = rv
        url = self._url(**params)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.watch_timeout + 30)
        async with session.get(url, headers=self._headers(), ssl=self._ssl(url), timeout=timeout) as r:
            if r.status == 410:
                return None
            r.raise_for_status()
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                if len(buf) > 64 << 20:
                    raise ValueError("watch event larger than 64 MiB")
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        rv = self._apply_event(json.loads(line), rv)
                        if rv is None:
                            return None
        return rv

    def _apply_event(self, event: dict[str, Any], rv: str) -> str | None:
        kind = event.get("type")
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if kind == "ERROR":
            log.info("EndpointSlices watch: %s (code %s); re-listing", obj.get("message"), obj.get("code"))
            return None
        self.watch_events += 1
        name = meta.get("name")
        if kind in ("ADDED", "MODIFIED") and name:
            self.slices[name] = self.parse_slice(obj)
        elif kind == "DELETED" and name:
            self.slices.pop(name, None)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._publish()
        return str(meta.get("resourceVersion") or rv)

    async def poll_once(self) -> None:
        """One list (no watch)."""
        import aiohttp

        async with aiohttp.ClientSession() as s:
            await self._list(s)

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    rv: str | None = await self._list(session)
                    while self.watch and rv is not None:
                        rv = await self._watch(session, rv)
                    if not self.watch:
                        await asyncio.sleep(self.interval)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep the last good answer, retry
                    self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                    log.warning("EndpointSlices of %s/%s: %s (keeping the last good list)", self.namespace,
                                self.service, self.last_error)
                    await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
