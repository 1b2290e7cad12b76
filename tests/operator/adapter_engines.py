"""Stub engines for the adapter tests: one HTTP server standing for every replica's engine
(``/<pod>/v1/load_lora_adapter`` and ``/<pod>/v1/unload_lora_adapter``, vLLM's answers),
and the heartbeats their sidecars would write (the adapters each engine serves)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import aiohttp.web
import redis.asyncio as aioredis

from kvmesh.common.redis_layout import Heartbeat, heartbeat_key, pods_key


class StubEngines:
    """Answers loads and unloads per pod; ``fail[name]`` makes loading that adapter fail."""

    def __init__(self) -> None:
        self.serves: dict[str, set[str]] = {}
        self.calls: Counter[tuple[str, str, str]] = Counter()  # (pod, op, adapter)
        self.paths: dict[tuple[str, str], str] = {}  # (pod, adapter) -> lora_path asked for
        self.auth: set[str] = set()
        self.fail: dict[str, str] = {}
        self.runner: aiohttp.web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.router.add_post("/{pod}/v1/{op}", self.handle)
        self.runner = aiohttp.web.AppRunner(app)
        await self.runner.setup()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def pod_url(self, pod: str) -> str:
        return f"{self.url}/{pod}"

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        pod, op = request.match_info["pod"], request.match_info["op"]
        body = await request.json()
        name = body["lora_name"]
        self.calls[(pod, op, name)] += 1
        self.auth.add(request.headers.get("Authorization", ""))
        serves = self.serves.setdefault(pod, set())
        if op == "load_lora_adapter":
            self.paths[(pod, name)] = body["lora_path"]
            if name in self.fail:
                return aiohttp.web.json_response(
                    {"error": {"message": self.fail[name], "type": "BadRequestError"}}, status=400
                )
            serves.add(name)
            return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in serves:
            return aiohttp.web.json_response(
                {"error": {"message": f"The lora adapter '{name}' cannot be found."}}, status=404
            )
        serves.discard(name)
        return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def count(self, op: str, name: str) -> dict[str, int]:
        return {p: n for (p, o, a), n in self.calls.items() if o == op and a == name}


class AdapterHeartbeats:
    """Writes each pod's heartbeat (as its sidecar does) with what its stub engine serves."""

    def __init__(self, redis_url: str, model: str, engines: StubEngines) -> None:
        self.r = aioredis.Redis.from_url(redis_url)
        self.model, self.engines = model, engines
        self.pods: list[str] = []
        self.task: asyncio.Task | None = None

    async def beat(self) -> None:
        for pod in self.pods:
            hb = Heartbeat(
                pod=pod,
                url=self.engines.pod_url(pod),
                model=self.model,
                total_blocks=100,
                ts=time.time(),
                adapters={n: "" for n in sorted(self.engines.serves.get(pod, ()))},
                max_loras=2,
            )
            await self.r.sadd(pods_key(self.model), pod)
            await self.r.hset(heartbeat_key(self.model, pod), mapping=hb.to_mapping())
            await self.r.expire(heartbeat_key(self.model, pod), 10)

    async def run(self, interval: float = 0.1) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(interval)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for pod in self.pods:  # only its own keys: the Redis may be shared with other tests
            await self.r.delete(heartbeat_key(self.model, pod))
            await self.r.srem(pods_key(self.model), pod)
        await self.r.aclose()


class EnginesThread:
    """The stub engines and their heartbeats on an event loop of their own, for tests that
    are not async (the real API server's)."""

    def __init__(self, redis_url: str, model: str, pods: list[str]) -> None:
        self.redis_url, self.model, self.pods = redis_url, model, pods
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.engines = StubEngines()
        self.beats: AdapterHeartbeats | None = None

    def _run(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> None:
        await self.engines.start()
        self.beats = AdapterHeartbeats(self.redis_url, self.model, self.engines)
        self.beats.pods = list(self.pods)
        self.beats.start()

    async def _stop(self) -> None:
        if self.beats is not None:
            await self.beats.close()
        await self.engines.stop()

    def __enter__(self) -> StubEngines:
        self.thread.start()
        self._run(self._start())
        return self.engines

    def __exit__(self, *exc: object) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
