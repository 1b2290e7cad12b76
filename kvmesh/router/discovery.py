"""Which pods the router may use: Redis heartbeats (contract 3), or a static list, optionally
cross-checked against the engine Service's EndpointSlices in Kubernetes."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import redis.asyncio as aioredis

from kvmesh.common import redis_layout as rl
from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router.discovery")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


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


class Discovery:
    def __init__(self, model: str, redis_client: aioredis.Redis | None, metrics: RouterMetrics,
                 static_backends: list[str] | None = None, refresh_interval: float = 0.5,
                 endpoint_slices: "EndpointSlices | None" = None):
        self.model = model
        self.redis = redis_client
        self.metrics = metrics
        self.static = [u.rstrip("/") for u in static_backends or []]
        self.refresh_interval = refresh_interval
        self.endpoint_slices = endpoint_slices
        self.pods: dict[str, Pod] = {}
        self.redis_ok = False
        self.last_refresh = 0.0
        self._pods_key = rl.pods_key(model)
        self._cleanup = redis_client.register_script(rl.ORPHAN_CLEANUP_LUA) if redis_client is not None else None
        self._task: asyncio.Task | None = None
        if self.static:
            self.pods = {u: Pod(name=u, url=u, has_blocks=False) for u in self.static}

    def routable(self) -> list[Pod]:
        pods = [p for p in self.pods.values() if p.state == rl.STATE_READY]
        if self.endpoint_slices is not None and self.endpoint_slices.ready_hosts is not None:
            hosts = self.endpoint_slices.ready_hosts
            pods = [p for p in pods if urlparse(p.url).hostname in hosts]
        return pods

    async def refresh(self) -> None:
        if self.redis is None:
            return
        try:
            names = sorted(n.decode() if isinstance(n, bytes) else n
                           for n in await self.redis.smembers(self._pods_key))
            pipe = self.redis.pipeline(transaction=False)
            for n in names:
                pipe.hgetall(rl.heartbeat_key(self.model, n))
            results = await pipe.execute() if names else []
        except Exception as exc:  # noqa: BLE001 - any Redis/network error: keep the last known view
            self.redis_ok = False
            self.metrics.redis_errors.labels("discovery").inc()
            self.metrics.redis_up.set(0)
            log.debug("discovery refresh failed: %s", exc)
            return
        self.redis_ok = True
        self.metrics.redis_up.set(1)
        found: dict[str, Pod] = {}
        dead: list[str] = []
        for name, data in zip(names, results):
            hb = rl.Heartbeat.from_mapping(name, data)
            if hb is None:
                dead.append(name)
                continue
            found[name] = Pod(name=name, url=hb.url.rstrip("/"), kv_usage=hb.kv_usage, running=hb.running,
                              waiting=hb.waiting, state=hb.state, ts=hb.ts)
        for name in dead:  # orphaned: heartbeat expired; delete its block set unless it just came back
            try:
                await self._cleanup(keys=[rl.heartbeat_key(self.model, name), rl.blocks_key(self.model, name),
                                          self._pods_key], args=[name])
            except Exception:  # noqa: BLE001
                self.metrics.redis_errors.labels("cleanup").inc()
        if self.static:
            by_url = {p.url: p for p in found.values()}
            pods = {}
            for u in self.static:
                if u in by_url:  # a static backend with a sidecar: use its name (block set) and load
                    pods[by_url[u].name] = by_url[u]
                else:
                    pods[u] = Pod(name=u, url=u, has_blocks=False)
            found = pods
        self.pods = found
        self.last_refresh = time.monotonic()
        states: dict[str, int] = {rl.STATE_READY: 0, rl.STATE_DRAINING: 0}
        for p in found.values():
            states[p.state] = states.get(p.state, 0) + 1
        for s, n in states.items():
            self.metrics.pods.labels(s).set(n)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_interval)

    def start(self) -> None:
        if self.redis is not None and self._task is None:
            self._task = asyncio.ensure_future(self.run())
        if self.endpoint_slices is not None:
            self.endpoint_slices.start()

    async def stop(self) -> None:
        for t in (self._task, self.endpoint_slices._task if self.endpoint_slices else None):
            if t is not None:
                t.cancel()


class EndpointSlices:
    """Ready addresses of a Service's EndpointSlices, polled from the Kubernetes API.

    `ready_hosts` is None until the first successful poll (and after failures it keeps the
    last good answer), so an API outage never empties the pool."""

    def __init__(self, service: str, namespace: str | None = None, api_url: str | None = None,
                 token: str | None = None, ca_file: str | None = None, interval: float = 5.0):
        self.service = service
        self.namespace = namespace or _read(f"{SA_DIR}/namespace") or "default"
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_url = (api_url or (f"https://{host}:{port}" if host else "https://kubernetes.default.svc")).rstrip("/")
        self.token = token if token is not None else _read(f"{SA_DIR}/token")
        self.ca_file = ca_file or (f"{SA_DIR}/ca.crt" if os.path.exists(f"{SA_DIR}/ca.crt") else None)
        self.interval = interval
        self.ready_hosts: set[str] | None = None
        self._task: asyncio.Task | None = None

    async def poll_once(self) -> None:
        import aiohttp

        url = (f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
               f"?labelSelector=kubernetes.io/service-name%3D{self.service}")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ssl_ctx = ssl.create_default_context(cafile=self.ca_file) if url.startswith("https") else None
        async with aiohttp.ClientSession() as s:
            async with s.get(url, headers=headers, ssl=ssl_ctx, timeout=aiohttp.ClientTimeout(total=5)) as r:
                r.raise_for_status()
                data = await r.json()
        hosts: set[str] = set()
        for item in data.get("items") or []:
            for ep in item.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready", True):
                    hosts.update(ep.get("addresses") or [])
        self.ready_hosts = hosts

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # noqa: BLE001
                log.warning("EndpointSlices poll failed: %s", exc)
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
