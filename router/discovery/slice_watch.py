"""The EndpointSlice source: a Kubernetes Service's endpoints, listed then watched."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from typing import Any
from urllib.parse import quote

from kvmesh.router.discovery.sources import Endpoint

log = logging.getLogger("kvmesh.router.discovery")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class EndpointSlices:
    """The ready endpoints of a Service's EndpointSlices: a list, then a watch from its
    resourceVersion (re-listing when the watch ends, fails or is told 410 Gone).

    `endpoints()` is None until the first successful list; after a failure the last good
    answer is kept (an API outage never empties the pool). The service-account token is
    re-read for every request (projected tokens rotate).

    RBAC: `get`, `list` and `watch` on `endpointslices` in API group `discovery.k8s.io`,
    in the Service's namespace."""

    def __init__(
        self,
        service: str,
        namespace: str | None = None,
        api_url: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        interval: float = 5.0,
        port_name: str = "http",
        watch: bool = True,
        watch_timeout: int = 300,
    ):
        self.service = service
        self.namespace = namespace or _read(f"{SA_DIR}/namespace") or "default"
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if host and ":" in host:
            host = f"[{host}]"
        self.api_url = (
            api_url or (f"https://{host}:{port}" if host else "https://kubernetes.default.svc")
        ).rstrip("/")
        self.token = token
        self.token_file = None if token is not None else f"{SA_DIR}/token"
        self.ca_file = ca_file or (
            f"{SA_DIR}/ca.crt" if os.path.exists(f"{SA_DIR}/ca.crt") else None
        )
        self.interval = interval
        self.port_name = port_name
        self.watch = watch
        self.watch_timeout = watch_timeout
        self.slices: dict[
            str, tuple[list[Endpoint], set[str]]
        ] = {}  # name -> (endpoints, ready addresses)
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
        return {
            "kind": "k8s",
            "service": self.service,
            "namespace": self.namespace,
            "synced": self.synced,
            "endpoints": len(self._endpoints or []),
            "error": self.last_error,
        }

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
        ports = [
            p
            for p in item.get("ports") or []
            if isinstance(p, dict) and isinstance(p.get("port"), int)
        ]
        port = next((p["port"] for p in ports if p.get("name") == self.port_name), None)
        if port is None and ports:
            port = ports[0]["port"]
        ipv6 = item.get("addressType") == "IPv6"
        out, hosts = [], set()
        for ep in item.get("endpoints") or []:
            if not isinstance(ep, dict):
                continue
            cond = ep.get("conditions") or {}
            ready = (
                isinstance(cond, dict) and cond.get("ready") is not False
            )  # nil means ready (the API's rule)
            addrs = [a for a in ep.get("addresses") or [] if isinstance(a, str) and a]
            if not addrs:
                continue
            if ready:
                hosts.update(addrs)
            if port is None:
                continue  # a Service without ports: nothing to send requests to
            host = f"[{addrs[0]}]" if ipv6 or ":" in addrs[0] else addrs[0]
            ref = ep.get("targetRef") if isinstance(ep.get("targetRef"), dict) else {}
            name = (
                ref.get("name")
                if ref.get("kind", "Pod") == "Pod" and isinstance(ref.get("name"), str)
                else None
            )
            out.append(Endpoint(name, f"http://{host}:{port}", ready))
        return out, hosts

    # -- the Kubernetes API -------------------------------------------------------------------------
    def _url(self, **params: str) -> str:
        query = "&".join(
            [f"labelSelector={quote('kubernetes.io/service-name=' + self.service)}"]
            + [f"{k}={quote(str(v))}" for k, v in params.items()]
        )
        return f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{quote(self.namespace)}/endpointslices?{query}"

    def _headers(self) -> dict[str, str]:
        token = (
            self.token
            if self.token is not None
            else (_read(self.token_file) if self.token_file else None)
        )
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl(self, url: str):
        return ssl.create_default_context(cafile=self.ca_file) if url.startswith("https") else None

    async def _list(self, session) -> str:
        import aiohttp

        url = self._url()
        async with session.get(
            url,
            headers=self._headers(),
            ssl=self._ssl(url),
            timeout=aiohttp.ClientTimeout(total=10),
        ) as r:
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

        params = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout),
        }
        if rv:
            params["resourceVersion"] = rv
        url = self._url(**params)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=10, sock_read=self.watch_timeout + 30
        )
        async with session.get(
            url, headers=self._headers(), ssl=self._ssl(url), timeout=timeout
        ) as r:
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
            log.info(
                "EndpointSlices watch: %s (code %s); re-listing",
                obj.get("message"),
                obj.get("code"),
            )
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
                    log.warning(
                        "EndpointSlices of %s/%s: %s (keeping the last good list)",
                        self.namespace,
                        self.service,
                        self.last_error,
                    )
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
