"""The prefix-aware router: an OpenAI-compatible front door (raw ASGI, for a lean hot path).

Per request: authenticate, read the body (size-limited), check the fields the router reads,
charge the rate limit, tokenize exactly like the engine (chat template included; long prompts
in a worker thread), compute the contract-1 block keys, ask Redis in one round trip how long a
prefix of them each live pod holds, score (contract 4), and proxy to the best pod with
streaming passthrough. Only what provably did not reach an engine (a connect error) or an
engine's "not me" (502/503, or 429 while another pod has room) is retried on the next pod: a
generation is never run twice. With no routable pod the request is held (scale from zero)
while a Redis key tells the autoscalers there is demand. See docs/router.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvmesh.common import openapi as oa
from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE, block_keys, key_hex
from kvmesh.common.json_body import load_json
from kvmesh.common.logging_setup import redact_url
from kvmesh.common.models import DEFAULT_MODEL
from kvmesh.common.prompts import chat_template_messages, prompt_batch
from kvmesh.router.auth import ApiKeys, KeyInfo, RateLimiter
from kvmesh.router import policies
from kvmesh.router.discovery import Discovery, EndpointSlices, Pod
from kvmesh.router.metrics import RouterMetrics, route_label, status_label
from kvmesh.router.policies import PolicySettings, RouteRequest
from kvmesh.router.request_checks import Refused, check_request, estimate_tokens, prompt_chars
from kvmesh.router.scoring import Candidate, Weights
from kvmesh.router import upstream_failure as uf

log = logging.getLogger("kvmesh.router")
access_log = logging.getLogger("kvmesh.router.access")

POLICIES = policies.NAMES  # the registry's names (router/policies)
_RID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PASS_HEADERS = {"content-type", "content-encoding", "cache-control", "retry-after"}
_GENERATE = ("/v1/completions", "/v1/chat/completions")
_GET = ("GET", "HEAD")
_METHODS = {"/v1/completions": ("POST",), "/v1/chat/completions": ("POST",), "/tokenize": ("POST",),
            "/detokenize": ("POST",), "/v1/models": _GET, "/health": _GET, "/ready": _GET, "/metrics": _GET,
            "/openapi.json": _GET}  # the routes the router documents, and their methods

OFF_LOOP_CHARS = 16384  # prompts this long are tokenised in a worker thread
OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies this large are parsed and checked in one

# One worker thread for a large request's JSON, checks, tokens and block keys. That work is mostly
# Python, which cannot run two threads at once anyway; and each more thread contending for the GIL
# makes the event loop wait longer to get it back after every poll (the convoy effect): under
# four 4 MB prompts, /health's p99 was 180-340 ms with asyncio's default pool, 50 ms with one thread.
_work_pool: ThreadPoolExecutor | None = None


async def off_loop(fn, *args):
    """``fn(*args)`` in the router's worker thread, while the event loop serves everything else."""
    global _work_pool
    if _work_pool is None:
        _work_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-router-work")
    return await asyncio.get_running_loop().run_in_executor(_work_pool, functools.partial(fn, *args))
KEEPALIVE_S = 3.0  # below the engines' 5 s keep-alive: a pooled connection is never one they closed


@dataclass
class RouterConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    static_backends: list[str] = field(default_factory=list)
    policy: str = policies.DEFAULT
    weights: Weights = field(default_factory=Weights)
    block_size: int = DEFAULT_BLOCK_SIZE
    api_keys: dict[str, KeyInfo] | None = None
    rate_limit_rpm: float | None = None
    rate_limit_tpm: float | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_retries: int = 2
    connect_timeout: float = 2.0
    read_timeout: float = 300.0
    request_timeout: float | None = None
    eject_after: int = 3
    eject_seconds: float = 10.0
    hot_ratio: float = 2.0
    hot_min: int = 2
    session_header: str = "x-session-id"
    redis_timeout: float = 0.25
    redis_retry_after: float = 1.0
    refresh_interval: float = 0.5
    upstream_api_key: str | None = None
    k8s_service: str | None = None
    k8s_namespace: str | None = None
    k8s_api_url: str | None = None
    backends_file: str | None = None  # NAME=URL lines, re-read on change (kvmesh up's supervisor)
    redis_stale_after: float = float(rl.HEARTBEAT_TTL_S)  # then route to known pods by load only
    # scale from zero: requests held while no pod is routable
    max_pending_requests: int = 256
    scale_from_zero_timeout: float = 300.0
    vocab_size: int | None = None  # token ids must be below it (default: the model's config.json)


class Breaker:
    """Per-pod circuit breaker: `eject_after` consecutive failures eject a pod for `eject_seconds`;
    after that it is tried again (one failure re-ejects it, one success closes the breaker)."""

    def __init__(self, eject_after: int, eject_seconds: float, metrics: RouterMetrics):
        self.eject_after = eject_after
        self.eject_seconds = eject_seconds
        self.metrics = metrics
        self.failures: dict[str, int] = {}
        self.until: dict[str, float] = {}

    def ejected(self, name: str, now: float) -> bool:
        return self.until.get(name, 0.0) > now

    def failure(self, name: str) -> None:
        n = self.failures.get(name, 0) + 1
        self.failures[name] = n
        now = time.monotonic()
        if n >= self.eject_after and not self.ejected(name, now):
            self.until[name] = now + self.eject_seconds
            self.metrics.ejections.labels(name).inc()
            log.warning("ejecting pod %s for %.0fs after %d consecutive failures", name, self.eject_seconds, n)

    def success(self, name: str) -> None:
        if self.failures.get(name):
            self.failures[name] = 0
            self.until.pop(name, None)


@dataclass
class Outcome:
    status: int
    pod: str
    usage: dict | None = None
    attempts: int = 1
    error: str | None = None  # what went wrong upstream (logged)


UNREACHED = "unreached"  # Outcome.error: no engine accepted the connection; nothing was sent


@dataclass
class _Call:
    """One request on its way through Router.handle's stages (each fills in its part)."""

    t0: float
    path: str
    route: str  # the metrics label
    headers: dict[str, str]  # names lower-cased
    rid: str  # X-Request-Id
    extra: list  # headers on every answer (X-Request-Id)
    client_id: str  # the rate-limit client: the API key's id, else "ip:<address>"
    key_info: KeyInfo | None = None
    body: bytes = b""
    req: dict[str, Any] = field(default_factory=dict)
    generate: bool = False  # a completion or chat completion (else /tokenize, /detokenize, ...)
    chars: int = 0  # prompt size read cheaply (prompt_chars)
    charged: int = 0  # tokens charged to the rate limit so far
    scores_prompt: bool = False  # prompt logprobs: nothing comes from the cache
    tokens: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # contract-1 block keys of the prompt
    held: "_Held | None" = None  # set while held for lack of a routable pod
    held_s: float | None = None
    ordered: list[Candidate] = field(default_factory=list)  # the pods to try, best first
    reason: str | None = None  # the routing decision's reason
    predicted: int = 0  # prompt tokens the chosen pod should serve from its cache

    @property
    def tpm(self) -> float | None:
        return self.key_info.tpm if self.key_info else None


class _Held:
    """A request held for lack of a routable pod; `go` resolves when it may be routed, `sent` is
    set once its body is on the engine's socket (or it has given up), so the next one is released
    after it and the engine sees them in arrival order."""

    __slots__ = ("go", "sent")

    def __init__(self):
        self.go: asyncio.Future = asyncio.get_running_loop().create_future()
        self.sent = asyncio.Event()


def _body_sent_trace() -> aiohttp.TraceConfig:
    """Calls a request's `trace_request_ctx["on_sent"]` as its body goes to the socket. aiohttp
    signals the chunk just before its synchronous write, and the callback only sets an event, so
    whoever waits on it runs after the bytes are on their way: a held request is released once
    the one before it has reached the engine's socket, and the engine sees them in arrival order."""
    async def chunk_sent(_session, ctx, _params) -> None:
        on_sent = (ctx.trace_request_ctx or {}).get("on_sent")
        if on_sent is not None:
            on_sent()

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(chunk_sent)
    return trace


class Router:
    def __init__(self, cfg: RouterConfig, encoder=None):
        self.cfg = cfg
        self.policy = policies.create(cfg.policy, PolicySettings(cfg.weights, cfg.hot_ratio, cfg.hot_min,
                                                                 cfg.session_header))
        self.metrics = RouterMetrics()
        vocab = cfg.vocab_size
        if encoder is None:
            from kvmesh.common.models import find_model_dir
            from kvmesh.common.tokenizer import KVMeshTokenizer
            from kvmesh.router.fast_tokenize import FastEncoder

            model_dir = find_model_dir(cfg.tokenizer or cfg.model)
            encoder = FastEncoder(KVMeshTokenizer(model_dir))
            vocab = vocab or _config_vocab(model_dir)
        self.encoder = encoder
        # The engine refuses token ids outside its model's vocabulary; so does the router.
        self.vocab_size = vocab or getattr(getattr(encoder, "tok", None), "vocab_size", None) or (1 << 32)
        self.keys = ApiKeys(cfg.api_keys)
        self.limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm)
        self.breaker = Breaker(cfg.eject_after, cfg.eject_seconds, self.metrics)
        self.inflight: dict[str, int] = {}
        self.full_until: dict[str, float] = {}  # pods that answered 429, until when
        self.redis = None
        self.discovery: Discovery | None = None
        self.session: aiohttp.ClientSession | None = None
        self._redis_down_until = 0.0
        self._use_lua = True
        self._match = None
        self._started = False
        self._held: deque[_Held] = deque()
        self._hold_task: asyncio.Task | None = None
        self._demand_at = -1e9
        self._demand_warned = -1e9
        self._openapi: bytes | None = None
        self.draining = False  # SIGTERM: every response from now on closes its connection
        self.cutting = False  # the drain timed out: the engines' responses still open are being cut
        self._upstream: set[aiohttp.ClientResponse] = set()  # engines' responses being passed through
        # proxy() tasks waiting for an engine's status line (a non-streamed answer being generated),
        # and those of them that cut() cancelled: they answer a 503, not the client's disconnect.
        self._awaiting: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()
        self._active: dict[object, tuple[str, float]] = {}  # requests inside the app: (route, start)

    @property
    def active(self) -> int:
        return len(self._active)

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_drained(self, timeout: float, stop=lambda: False) -> bool:
        """Wait up to `timeout` until no request is inside the router; `stop()` true ends the
        wait early (a second signal). Returns whether it drained."""
        deadline = time.monotonic() + timeout
        while self._active and not stop():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return not self._active

    def cut(self) -> None:
        """The drain timed out: close every engine response still being passed through, and
        cancel every request still waiting for its engine's status line (either cancels its work in
        the engine: the connection closes); each client gets an error event and [DONE], or a 503.
        Held requests get a 503."""
        self.cutting = True
        for resp in list(self._upstream):
            resp.close()
        for task in list(self._awaiting):
            self._cut.add(task)
            task.cancel()
        for h in list(self._held):  # still waiting for an engine (scale from zero): a 503 now
            h.go.cancel()

    def describe_active(self, limit: int = 10) -> str:
        now = time.monotonic()
        oldest = sorted(self._active.values(), key=lambda a: a[1])[:limit]
        return ", ".join(f"{path} for {now - t0:.1f}s" for path, t0 in oldest) or "none"

    def openapi(self) -> bytes:
        """The OpenAPI document of the router's surface (kvmesh.common.openapi): the engines'
        request and response schemas, the router's own statuses, its probes."""
        if self._openapi is None:
            vocab = self.vocab_size if self.vocab_size < (1 << 32) else None
            self._openapi = json.dumps(oa.router_document(self.cfg.model, vocab, auth=self.keys.enabled)).encode()
        return self._openapi

    @property
    def holds(self) -> bool:
        """Whether requests are held while no pod is routable (scale from zero)."""
        return self.cfg.max_pending_requests > 0 and self.cfg.scale_from_zero_timeout > 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        self._started = True
        if self.cfg.redis_url:
            import redis.asyncio as aioredis

            # A connection error is retried once (a restarted Redis leaves the pool's connections
            # dead; each would otherwise fail one lookup and pause the block sets for a second).
            self.redis = aioredis.Redis.from_url(self.cfg.redis_url, socket_timeout=self.cfg.redis_timeout,
                                                 socket_connect_timeout=self.cfg.redis_timeout,
                                                 retry=rl.reconnecting_retry())
            self._match = self.redis.register_script(rl.PREFIX_MATCH_LUA)
        slices = (EndpointSlices(self.cfg.k8s_service, self.cfg.k8s_namespace, self.cfg.k8s_api_url)
                  if self.cfg.k8s_service else None)
        self.discovery = Discovery(self.cfg.model, self.redis, self.metrics, self.cfg.static_backends,
                                   self.cfg.refresh_interval, slices, backends_file=self.cfg.backends_file,
                                   redis_stale_after=self.cfg.redis_stale_after)
        await self.discovery.refresh()
        self.discovery.start()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",),
                                             trace_configs=[_body_sent_trace()] if self.holds else None)

    async def shutdown(self) -> None:
        """Each step gets at most SHUTDOWN_STEP_S: a clean-up that hangs (a Redis or engine
        connection in a bad state) is logged by name and left behind, never holding the exit."""
        if self._hold_task is not None:
            self._hold_task.cancel()
        steps = [("discovery", self.discovery.stop() if self.discovery is not None else None),
                 ("engine connections", self.session.close() if self.session is not None else None),
                 ("redis", self.redis.aclose() if self.redis is not None else None)]
        for name, coro in steps:
            if coro is None:
                continue
            task = asyncio.ensure_future(coro)
            done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_S)
            if not done:
                task.cancel()
                log.warning("shutdown: closing the %s took over %.0fs; left behind", name, SHUTDOWN_STEP_S)
            elif not task.cancelled() and task.exception() is not None:
                log.warning("shutdown: closing the %s failed: %s", name, task.exception())

    # -- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as exc:  # noqa: BLE001
                        await send({"type": "lifespan.startup.failed", "message": str(exc)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if kind != "http":
            return
        started = False

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                if self.draining:  # the server honours it: this connection ends with this response
                    msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
            await send(msg)

        me = object()
        self._active[me] = (route_label(scope.get("path", "")), time.monotonic())
        # Nothing raises out of the app: an unexpected error is logged, counted, and answered
        # with a 500 if the status line is not out yet.
        try:
            await self._http(scope, receive, tracked)
        except asyncio.CancelledError:
            raise
        except OSError as exc:  # the client's connection is gone: nothing to answer
            log.debug("client connection error on %s: %s", scope.get("path"), exc)
        except Exception:  # noqa: BLE001
            self.metrics.internal_errors.inc()
            log.exception("unexpected error on %s %s", scope.get("method"), route_label(scope.get("path", "")))
            if not started:
                try:
                    await _error(tracked, 500, "internal router error", "server_error")
                except Exception:  # noqa: BLE001
                    pass
        finally:
            del self._active[me]

    async def _http(self, scope, receive, send):
        path, method = scope["path"], scope["method"]
        allowed = _METHODS.get(path)
        if allowed is not None and method not in allowed:  # a route of ours, another method: 405 + Allow
            self.metrics.requests.labels(route_label(path), "405").inc()
            return await _error(send, 405, f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                                "invalid_request_error", [(b"allow", ", ".join(allowed).encode())],
                                code="method_not_allowed")
        if method == "POST" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            return await self.handle(scope, receive, send)
        if path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if path == "/ready":
            return await self.ready(send)
        if path == "/metrics":
            return await _send(send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        if path == "/openapi.json":
            return await _send(send, 200, self.openapi())
        if path == "/v1/models":
            if self.keys.enabled and self.keys.check(_header(scope, b"authorization")) is None:
                self.metrics.auth_failures.inc()
                self.metrics.requests.labels("/v1/models", "401").inc()
                return await _error(send, 401, "invalid or missing API key", "authentication_error",
                                    code="invalid_api_key")
            return await _json(send, 200, {"object": "list", "data": [
                {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "kvmesh"}]})
        self.metrics.requests.labels(route_label(path), "404").inc()
        return await _error(send, 404, f"no route for {method} {path[:200]}", "not_found_error")

    async def ready(self, send):
        """200 while the router can accept requests: a routable pod, or none but requests are held
        until one is (scale from zero); the detail says how many are held. 503 once draining."""
        n = len(self.discovery.routable()) if self.discovery else 0
        ok = (bool(n) or self.holds) and not self.draining
        if self.draining:
            status = "draining: shutting down"
        elif n:
            status = "ready"
        elif self.holds:
            status = "ready: no routable engine, requests are held until one is (scale from zero)"
        else:
            status = "no ready engines"
        return await _json(send, 200 if ok else 503, {
            "status": status, "pods": n, "redis": bool(self.discovery and self.discovery.redis_ok),
            "discovery": self.discovery.detail() if self.discovery else None,
            "block_sets": self.block_sets_state() if self.discovery else "off",
            "held_requests": len(self._held), "max_pending_requests": self.cfg.max_pending_requests if self.holds else 0})

    # -- the request path: a pipeline of short stages -----------------------------------------------
    async def handle(self, scope, receive, send):
        """One generation (or tokenize) request: authenticate -> read body -> admit (rate limit)
        -> route -> proxy -> record.

        A stage that refuses the request raises :class:`Refused`: answered here with an OpenAI
        error, counted by route and status (a refusal after admission refunds the rate-limit
        charge). A client gone before its answer ends the pipeline with nothing sent."""
        call = self._begin(scope)
        try:  # the cheap checks first: key, body size, JSON, the fields the router reads, rate limit
            self._authenticate(call)
            if not await self._read_body(call, receive):
                return  # the client went away while sending its body
            if len(call.body) >= OFF_LOOP_BODY_BYTES:  # a large body's JSON and checks: off the loop
                await off_loop(self._parse, call)
            else:
                self._parse(call)
            self._admit(call)
        except Refused as r:
            return await self._refuse(send, call, r)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            try:
                if not await self._route(call, watcher):
                    return  # the client went away (counted as a 499)
            except Refused as r:
                self.limiter.adjust(call.client_id, -call.charged, call.tpm)  # never reached an engine
                return await self._refuse(send, call, r)
            out = await self._proxy_rerouting(call, scope, send, watcher)
        finally:
            watcher.cancel()
            if call.held is not None:
                call.held.sent.set()
        if out is not None:  # None: settled where the client went away
            self._record(call, out)

    def _begin(self, scope) -> _Call:
        t0 = time.perf_counter()
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id")
        if not rid or not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        return _Call(t0=t0, path=path, route=route_label(path), headers=headers, rid=rid,
                     extra=[(b"x-request-id", rid.encode())],
                     client_id="ip:" + ((scope.get("client") or ("?",))[0]))

    async def _refuse(self, send, call: _Call, r: Refused) -> None:
        self.metrics.requests.labels(call.route, status_label(r.status)).inc()
        await _error(send, r.status, r.message, r.etype, call.extra + list(r.headers), param=r.param, code=r.code)

    def _client_gone(self, call: _Call) -> None:
        self.metrics.client_disconnects.inc()
        self.metrics.requests.labels(call.route, "499").inc()

    def _authenticate(self, call: _Call) -> None:
        """With API keys on: the key's limits and id (the rate-limit client); else a 401."""
        if not self.keys.enabled:
            return
        info = self.keys.check(call.headers.get("authorization"))
        if info is None:
            self.metrics.auth_failures.inc()
            raise Refused(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        call.key_info, call.client_id = info, info.key_id

    async def _read_body(self, call: _Call, receive) -> bool:
        """The body, at most max_body_bytes (413 beyond, declared or sent); False if the client left."""
        limit = self.cfg.max_body_bytes
        try:
            declared = int(call.headers.get("content-length") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            raise Refused(413, f"request body is {declared} bytes; the limit is {limit}", "invalid_request_error",
                          code="body_too_large")
        chunks = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return False
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise Refused(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                              code="body_too_large")
            chunks.append(part)
            if not msg.get("more_body"):
                break
        call.body = b"".join(chunks)
        return True

    def _parse(self, call: _Call) -> None:
        """A JSON object; for a generation, the fields the router reads checked as the engine would."""
        try:
            req = load_json(call.body)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
            raise Refused(400, f"request body is not valid JSON: {str(exc)[:200]}", "invalid_request_error",
                          code="invalid_json") from None
        if not isinstance(req, dict):
            raise Refused(400, "request body must be a JSON object", "invalid_request_error")
        call.req = req
        call.generate = call.path in _GENERATE
        if call.generate:
            check_request(call.path, req, self.vocab_size)  # raises BadRequest (a Refused)

    def _admit(self, call: _Call) -> None:
        """The rate limit, charged a bounded estimate before the tokenizer runs (a client over its
        limit costs no tokenization); corrected with the real prompt length in _tokenize, settled
        with the engine's usage in _record (or refunded if the request is refused)."""
        req, info = call.req, call.key_info
        call.chars = prompt_chars(call.path, req) if call.generate else 0
        ok, retry_after, which, charged = self.limiter.admit_charge(
            call.client_id, estimate_tokens(req, call.chars // 4 + 1) if call.generate else 0,
            info.rpm if info else None, call.tpm)
        if not ok:
            self.metrics.rate_limited.labels(which).inc()
            raise Refused(429, f"rate limit exceeded ({which} per minute)", "rate_limit_error",
                          code="rate_limit_exceeded", headers=[(b"retry-after", str(retry_after).encode())])
        call.charged = charged

    async def _route(self, call: _Call, watcher: asyncio.Future) -> bool:
        """Tokens and block keys, a routable pod (held until one is: scale from zero), the
        policy's order. False if the client went away meanwhile; Refused (503) if no pod came."""
        await self._tokenize(call)
        if watcher.done():  # gone while we tokenised
            self._client_gone(call)
            return False
        pods = await self._routable_pods(call, watcher)
        if pods is None:
            return False
        await self._order(call, pods)
        return True

    async def _tokenize(self, call: _Call) -> None:
        """Tokenize like the engine (long prompts off the event loop) and compute the block keys."""
        req = call.req
        call.scores_prompt = req.get("prompt_logprobs") is not None or (bool(req.get("echo"))
                                                                        and req.get("logprobs") is not None)
        if not call.generate:
            return
        t_tok = time.perf_counter()
        if call.chars >= OFF_LOOP_CHARS:
            call.tokens, call.keys = await off_loop(self._tokens_and_keys, call.path, req,
                                                             call.scores_prompt, True)
        else:
            call.tokens, call.keys = self._tokens_and_keys(call.path, req, call.scores_prompt, False)
        self.metrics.tokenize.observe(time.perf_counter() - t_tok)
        if call.tokens and call.charged:
            call.charged += self.limiter.adjust(call.client_id,
                                                estimate_tokens(req, len(call.tokens)) - call.charged, call.tpm)

    async def _routable_pods(self, call: _Call, watcher: asyncio.Future) -> list[Pod] | None:
        """The pods to choose from (ejected ones only if nothing else); none routable: the request
        is held until one is (scale from zero). None if the client left while held."""
        pods = self.discovery.routable()
        if self.holds and (not pods or self._held):
            outcome, call.held_s, call.held = await self._hold(watcher)
            if outcome == "disconnect":
                self._client_gone(call)
                self.limiter.adjust(call.client_id, -call.charged, call.tpm)
                return None
            if outcome == "queue_full":
                raise Refused(503, f"no engine is ready and {self.cfg.max_pending_requests} requests already wait "
                              "for one (scale from zero); retry later", "service_unavailable",
                              code="no_ready_engine", headers=[(b"retry-after", b"5")])
            if outcome == "shutdown":
                raise Refused(503, SHUTDOWN_REFUSED_MSG, "service_unavailable", code="router_shutdown",
                              headers=[SHUTDOWN_RETRY_AFTER])
            if outcome != "dispatched":
                raise Refused(503, f"no engine became ready within {self.cfg.scale_from_zero_timeout:g} s "
                              "(scale from zero); retry later", "service_unavailable", code="no_ready_engine",
                              headers=[(b"retry-after", b"10")])
            pods = self.discovery.routable()
        now = time.monotonic()
        usable = [p for p in pods if not self.breaker.ejected(p.name, now)] or pods
        if not usable:
            raise Refused(503, "no ready engine for this model", "service_unavailable", code="no_ready_engine",
                          headers=[(b"retry-after", b"1")])
        return usable

    async def _order(self, call: _Call, pods: list[Pod]) -> None:
        """The policy's order (pods that just answered 429 last), and the predicted cached tokens."""
        ordered, reason = await self.decide(pods, call.keys, call.headers, call.body)
        if call.scores_prompt and reason == "short_prompt":
            reason = "scores_prompt"
        if self.full_until:
            now = time.monotonic()
            ordered.sort(key=lambda c: self.full_until.get(c.name, 0.0) > now)
        self.metrics.decisions.labels(self.cfg.policy, reason).inc()
        # The engine serves at most len - 1 prompt tokens from its cache (the last one is always
        # computed, for logits): a prompt of whole blocks, all matched, has its last block recomputed.
        bs = self.cfg.block_size
        call.predicted = min(ordered[0].matched_blocks, max(len(call.tokens) - 1, 0) // bs) * bs
        call.ordered, call.reason = ordered, reason

    async def _proxy_rerouting(self, call: _Call, scope, send, watcher: asyncio.Future) -> Outcome | None:
        """_proxy(); when no candidate even accepted the connection (the request reached no engine:
        the pods believed ready died an instant ago), route it again, with back-off, until a pod
        takes it or the scale-from-zero bound passes: a request no engine saw is not lost to a
        fault. Without holding (scale from zero off) the first such failure is answered (502).
        None when the client left while held (already counted)."""
        deadline = time.monotonic() + self.cfg.scale_from_zero_timeout
        pause = 0.1
        while True:
            last_chance = not self.holds or time.monotonic() + pause >= deadline or self.cutting
            out = await self._proxy(call, scope, send, watcher, answer_unreached=last_chance)
            if out.error != UNREACHED or last_chance:
                return out
            self.metrics.retries.labels("unreached").inc()
            await asyncio.wait({watcher}, timeout=pause)
            if watcher.done():
                self.metrics.client_disconnects.inc()
                return Outcome(499, out.pod)   # _record counts it
            pause = min(pause * 2, 2.0)
            try:
                pods = await self._routable_pods(call, watcher)
            except Refused as r:  # held, and no pod came back in time
                await _error(send, r.status, r.message, r.etype, call.extra + list(r.headers), param=r.param,
                             code=r.code)
                return Outcome(r.status, out.pod, attempts=out.attempts, error=r.code)
            if pods is None:  # the client left while held: _routable_pods settled it
                return None
            await self._order(call, pods)

    async def _proxy(self, call: _Call, scope, send, watcher: asyncio.Future, answer_unreached: bool = True) -> Outcome:
        """proxy() to the ordered pods; a client that goes away cancels the upstream request."""
        on_sent = call.held.sent.set if call.held is not None else None
        task = asyncio.ensure_future(self.proxy(scope, send, call.path, call.body, call.headers, call.rid,
                                                call.ordered, call.t0, call.extra, on_sent,
                                                answer_unreached=answer_unreached))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()  # the client went away: cancel the upstream request (closes its connection)
        self.metrics.client_disconnects.inc()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        return Outcome(499, call.ordered[0].name)

    def _record(self, call: _Call, out: Outcome) -> None:
        """Settle: metrics, the rate limit (the engine's usage, or a refund), the access log."""
        m = self.metrics
        status = out.status
        dur = time.perf_counter() - call.t0
        m.requests.labels(call.route, status_label(status)).inc()
        m.duration.observe(dur)
        m.prompt_tokens.inc(len(call.tokens))
        cached = None
        if status == 200:
            m.predicted_cached.inc(call.predicted)
            usage = out.usage
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                if isinstance(cached, int):
                    m.engine_cached.inc(cached)
                    m.prediction_error.observe(call.predicted - cached)
                real = usage.get("total_tokens")
                if isinstance(real, int) and real >= 0 and call.charged:
                    self.limiter.adjust(call.client_id, real - call.charged, call.tpm)
        elif status >= 400 and status not in (499, 504) and call.charged:
            self.limiter.adjust(call.client_id, -call.charged, call.tpm)  # refused, or never reached an engine
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("request", extra={"fields": {
                "request_id": call.rid, "route": call.route, "status": status, "pod": redact_url(out.pod),
                "policy": self.cfg.policy, "reason": call.reason, "attempts": out.attempts,
                "prompt_tokens": len(call.tokens), "predicted_cached_tokens": call.predicted,
                "cached_tokens": cached, "stream": bool(call.req.get("stream")),
                "held_s": round(call.held_s, 3) if call.held_s is not None else None, "error": out.error,
                "duration_ms": round(dur * 1000, 2), "client": call.client_id}})

    def _tokens_and_keys(self, path: str, req: dict[str, Any], scores_prompt: bool,
                         large: bool) -> tuple[list[int], list[int]]:
        tokens = self._tokens(path, req, large)
        # A request scoring its prompt (prompt logprobs, or echo with logprobs) computes every
        # position and reads nothing from the cache: no prefix to match, it goes by load.
        keys = (block_keys(tokens, self.cfg.model, self.cfg.block_size, cache_salt=req.get("cache_salt"))
                if tokens and not scores_prompt else [])
        return tokens, keys

    def _tokens(self, path: str, req: dict[str, Any], large: bool = False) -> list[int]:
        try:
            if path == "/v1/chat/completions":
                msgs = req.get("messages")
                if not isinstance(msgs, list):
                    return []
                kw = {"large": True} if large else {}
                # as the engine renders them: text parts joined, a null content as ""
                return self.encoder.encode_chat(chat_template_messages(msgs),
                                                add_generation_prompt=req.get("add_generation_prompt", True),
                                                continue_final_message=bool(req.get("continue_final_message")),
                                                template_kwargs=req.get("chat_template_kwargs"), **kw)
            if path == "/v1/completions":
                prompt = prompt_batch(req.get("prompt"))[0]  # a batch routes on its first prompt
                if isinstance(prompt, str):
                    if large and hasattr(self.encoder, "encode_large"):
                        return self.encoder.encode_large(prompt)
                    return self.encoder.encode(prompt)
                if isinstance(prompt, list) and prompt:
                    if all(type(t) is int for t in prompt):
                        return prompt
                    if all(isinstance(t, (int, float)) and float(t).is_integer() for t in prompt):
                        return [int(t) for t in prompt]
        except Exception as exc:  # noqa: BLE001 - the engine will answer the malformed request
            log.debug("could not tokenize: %s", exc)
        return []

    # -- scale from zero ---------------------------------------------------------------------------
    async def _hold(self, watcher: asyncio.Future) -> tuple[str, float, _Held | None]:
        """Wait, in arrival order, for a routable pod. Returns (outcome, seconds held, the hold):
        outcome is dispatched, timeout, queue_full, disconnect or shutdown (the drain timed out)."""
        m = self.metrics
        if len(self._held) >= self.cfg.max_pending_requests:
            m.held_outcomes.labels("queue_full").inc()
            return "queue_full", 0.0, None
        h = _Held()
        self._held.append(h)
        m.held.set(len(self._held))
        if self._hold_task is None or self._hold_task.done():
            self._hold_task = asyncio.ensure_future(self._hold_loop())
        t = time.monotonic()
        try:
            await asyncio.wait({h.go, watcher}, timeout=self.cfg.scale_from_zero_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not h.go.done():  # timed out, client gone, or cancelled: leave the queue
                h.go.cancel()
                try:
                    self._held.remove(h)
                except ValueError:
                    pass
                m.held.set(len(self._held))
        waited = time.monotonic() - t
        if not h.go.cancelled():
            outcome = "dispatched"
        elif watcher.done():
            outcome = "disconnect"
        elif self.cutting:
            outcome = "shutdown"
        else:
            outcome = "timeout"
        m.held_outcomes.labels(outcome).inc()
        m.held_wait.labels(outcome).observe(waited)
        if outcome == "timeout":
            log.warning("held request gave up: no engine ready within %.0f s", self.cfg.scale_from_zero_timeout)
        return outcome, waited, h

    async def _hold_loop(self) -> None:
        """While requests are held: signal demand (at most once a second) and release them, oldest
        first, one at a time, as soon as a pod is routable."""
        try:
            while self._held:
                now = time.monotonic()
                if now - self._demand_at >= 1.0:
                    self._demand_at = now
                    await self.signal_demand()
                if self.discovery.routable():
                    while self._held and self.discovery.routable():
                        h = self._held.popleft()
                        self.metrics.held.set(len(self._held))
                        if h.go.done():
                            continue
                        h.go.set_result(True)
                        try:  # the next one goes once this one is on its way
                            await asyncio.wait_for(h.sent.wait(), 2.0)
                        except asyncio.TimeoutError:
                            pass
                    continue
                await asyncio.sleep(0.05)
        finally:
            self.metrics.held.set(len(self._held))

    async def signal_demand(self) -> None:
        """Set the model's demand key (the current unix time, TTL DEMAND_TTL_S): the autoscalers
        (operator, `kvmesh up --autoscale`) scale a model at zero replicas back up when they see it."""
        if self.redis is None:
            return
        try:
            await self.redis.set(rl.demand_key(self.cfg.model), f"{time.time():.3f}", ex=rl.DEMAND_TTL_S)
            self.metrics.demand_signals.inc()
        except Exception as exc:  # noqa: BLE001 - the request still waits; the next second tries again
            self.metrics.redis_errors.labels("demand").inc()
            now = time.monotonic()
            if now - self._demand_warned > 30:  # once per 30 s, not every second
                self._demand_warned = now
                log.warning("could not signal demand in Redis (requests are held for lack of an engine): %s", exc)

    def block_sets_state(self) -> str:
        """Whether routing may read the pods' block sets now: "usable"; "off" (no Redis);
        "no current Redis view" (discovery's view expired); "paused after a Redis error" (for
        redis_retry_after, so that a Redis that is down costs each request one failed call at most)."""
        if self.redis is None:
            return "off"
        if not self.discovery.redis_fresh:
            return "no current Redis view"
        if time.monotonic() < self._redis_down_until:
            return "paused after a Redis error"
        return "usable"

    async def match(self, pods: list[Pod], keys: list[int]) -> dict[str, int] | None:
        """Matched leading blocks per pod, in one Redis round trip; None if Redis is unavailable."""
        if self.block_sets_state() != "usable":
            return None
        named = [p.name for p in pods if p.has_blocks]
        if not named:
            return {}
        bkeys = [rl.blocks_key(self.cfg.model, n) for n in named]
        hexes = [key_hex(k) for k in keys]
        try:
            if self._use_lua:
                try:
                    counts = await self._match(keys=bkeys, args=["".join(hexes)])
                except Exception as exc:  # noqa: BLE001
                    if "unknown command" in str(exc).lower() or "noscript" in str(exc).lower():
                        self._use_lua = False  # EVAL disabled on this Redis: use SMISMEMBER
                    raise
            else:
                pipe = self.redis.pipeline(transaction=False)
                for b in bkeys:
                    pipe.smismember(b, hexes)
                counts = [rl.leading_run(flags) for flags in await pipe.execute()]
        except Exception as exc:  # noqa: BLE001 - never fail a request because of Redis
            self.metrics.redis_errors.labels("match").inc()
            self.metrics.redis_up.set(0)
            self._redis_down_until = time.monotonic() + self.cfg.redis_retry_after
            log.debug("prefix match failed: %s", exc)
            return None
        return dict(zip(named, (int(c) for c in counts)))

    async def decide(self, pods: list[Pod], keys: list[int], headers: dict[str, str],
                     body: bytes) -> tuple[list[Candidate], str]:
        """The routing policy's order of `pods` (best first) and its reason (router/policies)."""
        cands = [Candidate(p.name, p.url, p.kv_usage, max(p.load, self.inflight.get(p.name, 0))) for p in pods]
        # Ties break on the prompt's last full block: prompts that share only a system prompt
        # spread over the pods, and every router still picks the same pod for the same prompt.
        tie = keys[-1].to_bytes(8, "little") if keys else body[:512]
        return await self.policy.order(RouteRequest(cands, keys, headers, tie, lambda: self.match(pods, keys)))

    async def proxy(self, scope, send, path, body, headers, rid, ordered, t0, extra, on_sent=None,
                    answer_unreached: bool = True) -> Outcome:
        """Send to the candidates in order. Retried on the next pod: a connect error (the request
        never left), a 502/503 (the engine says "not me"), a 429 while another pod has room. Not
        retried, and not counted against the pod's breaker: a disconnect after the request was
        sent, a timeout, any other 5xx (caused by the request), a failure mid-stream. When every
        try was a connect error and not ``answer_unreached``, nothing is sent to the client: the
        Outcome's error is UNREACHED and the caller may route the request again."""
        m = self.metrics
        cfg = self.cfg
        fwd = {"Content-Type": headers.get("content-type", "application/json"), "X-Request-Id": rid,
               "Accept-Encoding": "identity"}
        if "accept" in headers:
            fwd["Accept"] = headers["accept"]
        if cfg.upstream_api_key:
            fwd["Authorization"] = f"Bearer {cfg.upstream_api_key}"
        elif not self.keys.enabled and "authorization" in headers:
            fwd["Authorization"] = headers["authorization"]
        qs = scope.get("query_string") or b""
        target = path + ("?" + qs.decode("latin-1") if qs else "")
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=cfg.connect_timeout,
                                        sock_read=cfg.read_timeout)
        budget = cfg.max_retries + 1
        queue = list(ordered)
        tried = 0
        last_err = "no attempt"
        all_unreached = True  # every try so far failed to connect: no engine has seen the request
        me = asyncio.current_task()
        while queue and tried < budget:
            cand = queue.pop(0)
            tried += 1
            pod_hdr = [(b"x-kvmesh-pod", cand.name.encode())]
            if self.cutting:  # the drain timed out between two tries: no next one
                await _refuse_shutdown(send, extra)
                return Outcome(503, cand.name, None, tried - 1, "router_shutdown")
            if tried > 1:
                m.retries.labels(last_err).inc()
            self.inflight[cand.name] = self.inflight.get(cand.name, 0) + 1
            resp = None
            try:
                if tried == 1:
                    m.overhead.observe(time.perf_counter() - t0)
                t_send = time.perf_counter()
                self._awaiting.add(me)
                try:
                    resp = await self.session.post(cand.url + target, data=body, headers=fwd, timeout=timeout,
                                                   trace_request_ctx={"on_sent": on_sent} if on_sent else None)
                except asyncio.CancelledError:
                    if me not in self._cut:  # the client went away, or the server is cancelling us
                        raise
                    me.uncancel()  # our drain's cut: answered here, the task goes on to its end
                    await _refuse_shutdown(send, extra + pod_hdr)
                    return Outcome(503, cand.name, None, tried, "router_shutdown")
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # The connection was never made: the engine never saw the request.
                    self.breaker.failure(cand.name)
                    m.upstream_failures.labels("connect").inc()
                    last_err = "connect"
                    log.info("could not connect to %s: %s", redact_url(cand.name), exc,
                             extra={"fields": {"request_id": rid}})
                    continue
                except asyncio.TimeoutError as exc:  # sent, no answer in time: the engine may still run it
                    return await self._upstream_failed(send, uf.TIMEOUT, exc, cand.name, rid, tried, extra + pod_hdr)
                except (aiohttp.ClientError, OSError) as exc:
                    # Sent, then the connection failed: the engine may be running it. Never twice.
                    return await self._upstream_failed(send, uf.DISCONNECTED, exc, cand.name, rid, tried,
                                                       extra + pod_hdr)
                self._awaiting.discard(me)
                all_unreached = False
                m.ttfb.observe(time.perf_counter() - t_send)
                self._upstream.add(resp)
                st = resp.status
                if st == 429:  # the engine's queue is full: another pod with room may take it
                    self.full_until[cand.name] = time.monotonic() + _retry_after(resp, 1.0, 10.0)
                    now = time.monotonic()
                    queue = [c for c in queue if self.full_until.get(c.name, 0.0) <= now]
                    if queue and tried < budget:
                        last_err = "status_429"
                        await _drain_body(resp)
                        continue
                elif st in (502, 503):  # "not me": draining, loading, or a proxy in front of a dead engine
                    self.breaker.failure(cand.name)
                    if queue and tried < budget:
                        last_err = f"status_{st}"
                        await _drain_body(resp)
                        continue
                elif st < 500:
                    self.breaker.success(cand.name)
                    self.full_until.pop(cand.name, None)
                m.routed.labels(cand.name).inc()
                out_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
                               if k.lower() in _PASS_HEADERS]
                start = {"type": "http.response.start", "status": st, "headers": out_headers + extra + pod_hdr}
                if "event-stream" not in resp.headers.get("content-type", ""):
                    try:
                        data = await resp.read()
                    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                        return await self._upstream_failed(send, uf.BODY, exc, cand.name, rid, tried, extra + pod_hdr)
                    await send(start)
                    await send({"type": "http.response.body", "body": data})
                    return Outcome(st, cand.name, _usage(data, False) if st == 200 else None, tried)
                return await self._stream(send, resp, start, cand.name, rid, tried, extra + pod_hdr)
            finally:
                self._awaiting.discard(me)
                self._cut.discard(me)
                self.inflight[cand.name] -= 1
                if resp is not None:
                    self._upstream.discard(resp)
                    resp.close()  # a half-read response closes its connection (cancels the engine's work)
        if last_err == "connect" and all_unreached and not answer_unreached:
            return Outcome(502, ordered[-1].name if ordered else "", None, tried, UNREACHED)
        await _error(send, 502, f"no engine could take the request ({last_err})", "upstream_error", extra,
                     code="no_engine_reachable")
        return Outcome(502, ordered[-1].name if ordered else "", None, tried, last_err)

    async def _upstream_failed(self, send, failure: uf.UpstreamFailure, exc: BaseException, pod: str, rid: str,
                               tried: int, headers: list) -> Outcome:
        """Answer an engine's failure before anything reached the client (see router/upstream_failure.py)."""
        if failure.shutdown_first and self.cutting:  # our own drain timed out, not the engine
            await _refuse_shutdown(send, headers)
            return Outcome(503, pod, None, tried, "router_shutdown")
        self.metrics.upstream_failures.labels(failure.stage).inc()
        uf.log_failure(failure, pod, exc, rid)
        await _error(send, failure.status, failure.message, failure.etype, headers, code=failure.code)
        return Outcome(failure.status, pod, None, tried, failure.error)

    async def _stream(self, send, resp, start, pod, rid, tried, err_headers) -> Outcome:
        """Pass an SSE stream through. The status line waits for the first event, so an engine
        that dies before it gives a clean 502; one that dies later ends the stream with an error
        event and [DONE] (the client never sees a silently truncated stream)."""
        m = self.metrics
        it = resp.content.iter_any()
        keep = b""
        error = None
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return await self._upstream_failed(send, uf.FIRST_EVENT, exc, pod, rid, tried, err_headers)
        await send(start)
        chunk = first
        while chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            keep = (keep + chunk)[-8192:]
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                lead = b"" if not keep or keep.endswith(b"\n\n") else b"\n\n"
                if self.cutting:  # our own drain timed out, not the engine
                    error = "router_shutdown"
                    event = {"error": {"message": SHUTDOWN_MSG, "type": "service_unavailable", "param": None,
                                       "code": "router_shutdown"}}
                else:
                    error = "mid_stream"
                    m.upstream_failures.labels("mid_stream").inc()
                    log.warning("%s failed mid-stream: %s", redact_url(pod), exc or type(exc).__name__,
                                extra={"fields": {"request_id": rid}})
                    event = {"error": {"message": "the engine failed mid-stream; the response is incomplete",
                                       "type": "upstream_error", "param": None, "code": "upstream_failed"}}
                await send({"type": "http.response.body", "more_body": True,
                            "body": lead + b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"})
                break
        await send({"type": "http.response.body", "body": b""})
        usage = _usage(keep, True) if start["status"] == 200 and error is None else None
        return Outcome(start["status"], pod, usage, tried, error)


async def _refuse_shutdown(send, headers: list) -> None:
    """The drain's cut, before anything went back to the client: a 503 it may retry."""
    await _error(send, 503, SHUTDOWN_REFUSED_MSG, "service_unavailable", headers + [SHUTDOWN_RETRY_AFTER],
                 code="router_shutdown")


async def _drain_body(resp: aiohttp.ClientResponse) -> None:
    """Read a refusal's body before the next try (so its connection can be reused); a body that
    fails to arrive does not matter: the next pod is tried all the same."""
    try:
        await resp.read()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        pass


SHUTDOWN_STEP_S = 2.0
# What a request the drain's timeout cuts gets: a stream, an error event; anything else, a 503.
SHUTDOWN_MSG = "the router is shutting down (its drain timed out); the response is incomplete: retry"
SHUTDOWN_REFUSED_MSG = "the router is shutting down; retry"
SHUTDOWN_RETRY_AFTER = (b"retry-after", b"1")


def _config_vocab(model_dir: Path) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return v if isinstance(v, int) and v > 0 else None


def _retry_after(resp, lo: float, hi: float) -> float:
    try:
        v = float(resp.headers.get("Retry-After", lo))
    except ValueError:
        v = lo
    return min(max(v, lo), hi) if math.isfinite(v) else lo


def _usage(data: bytes, stream: bool) -> dict | None:
    try:
        if not stream:
            return json.loads(data).get("usage")
        at = data.rfind(b'"usage"')
        if at < 0:
            return None
        start = data.rfind(b"data: ", 0, at)
        end = data.find(b"\n", at)
        return json.loads(data[start + 6: end if end >= 0 else None]).get("usage")
    except Exception:  # noqa: BLE001
        return None


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _wait_disconnect(receive):
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _send(send, status: int, body: bytes, ctype: bytes = b"application/json", extra=()):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


async def _json(send, status: int, obj: Any, extra=()):
    await _send(send, status, json.dumps(obj).encode(), extra=extra)


async def _error(send, status: int, message: str, etype: str, extra=(), param: str | None = None,
                 code: str | None = None):
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    await _json(send, status, {"error": {"message": message, "type": etype, "param": param, "code": code}}, extra)
