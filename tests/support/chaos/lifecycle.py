"""The one lifecycle of a loopback mesh, whichever launcher starts it: scratch folder, start, probes, close."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh_testing.chaos.processes import ChaosError, wait_for


class LoopbackMesh:
    """A router on 127.0.0.1:`port` in front of `replicas` engines, with Redis. A launcher
    (`Mesh`: each process by hand; `UpMesh`: `kvmesh up`) implements `_launch`, `_stop_processes`
    and `_redis_url`; `start` then waits until the router routes to every replica."""

    def __init__(self, cfg: Any, port: int, replicas: int, route_timeout: float, dir_prefix: str):
        self.cfg = cfg  # the launcher's config (its `model` is the served model name)
        self.port = port
        self.replicas = replicas
        self.route_timeout = (
            route_timeout  # after the launch, for the router to route to every replica
        )
        self.dir = Path(tempfile.mkdtemp(prefix=dir_prefix))
        self.http = httpx.AsyncClient(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
        self._redis_client = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self):
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        await self._launch()
        n = self.replicas
        try:
            await wait_for(
                lambda: self.routable(n), self.route_timeout, f"the router routing to {n} replicas"
            )
        except ChaosError as exc:  # say what the router saw and what each process said
            discovery = ((await self.ready()) or {}).get("discovery")
            raise ChaosError(f"{exc}\nrouter discovery: {discovery}\n{self.log_tails()}") from None

    async def close(self) -> None:
        await self._stop_processes()
        await self.http.aclose()
        if self._redis_client is not None:
            try:
                await self._redis_client.aclose()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _launch(self) -> None:
        raise NotImplementedError

    def log_tails(self, n: int = 25) -> str:
        """The last lines each process of the mesh wrote (for an error that says why)."""
        return ""

    async def _stop_processes(self) -> None:
        raise NotImplementedError

    def _redis_url(self) -> str:
        raise NotImplementedError

    # -- probes --------------------------------------------------------------------------------
    def _redis(self):
        if self._redis_client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            # no retries: a probe of a Redis that is down fails at once
            self._redis_client = aioredis.Redis.from_url(
                self._redis_url(),
                socket_timeout=1.0,
                socket_connect_timeout=1.0,
                retry=Retry(NoBackoff(), 0),
            )
        return self._redis_client

    async def redis_ping(self) -> bool:
        return bool(await self._redis().ping())

    async def block_keys(self, pod: str) -> int:
        return int(await self._redis().scard(rl.blocks_key(self.cfg.model, pod)))

    async def ready(self) -> dict | None:
        try:
            return (await self.http.get(self.url + "/ready")).json()
        except (httpx.HTTPError, ValueError):
            return None

    async def routable(self, n: int) -> bool:
        r = await self.ready()
        return r is not None and (r.get("discovery") or {}).get("routable_pods") == n

    async def metric(self, name: str, **labels: str) -> float:
        from kvmesh.common.engine_load import parse_prometheus

        text = (await self.http.get(self.url + "/metrics")).text
        return sum(
            v
            for n, lab, v in parse_prometheus(text)
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        )
