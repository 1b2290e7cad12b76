"""The router's ASGI application: the front door (routes, probes, lifespan, drain) over the request pipeline.

`Router` builds the parts and serves what is not a generation itself: /health, /ready,
/metrics, /openapi.json, /v1/models, 404 and 405. Every `POST /v1/*`, /tokenize and /detokenize
goes through router/pipeline.py: admission (router/admission.py), routing (router/routing.py,
held while no pod is routable: router/hold_queue.py), the proxy (router/proxy.py) and the
settlement (router/settle.py). See docs/router.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp

from kvmesh.common import openapi as oa
from kvmesh.common import redis_layout as rl
from kvmesh.common.chat_prompt import TOOL_PROMPTS
from kvmesh.router import adapters, policies
from kvmesh.router.admission import Admission
from kvmesh.router.auth import ApiKeys, RateLimiter
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import Discovery, EndpointSlices
from kvmesh.router.drain import Drain
from kvmesh.router.flow import FlowControl
from kvmesh.router.hold_queue import HoldQueue, body_sent_trace
from kvmesh.router.metrics import RouterMetrics, route_label
from kvmesh.router.pipeline import Pipeline
from kvmesh.router.pod_traffic import Breaker, PodTraffic
from kvmesh.router.policies import PolicySettings
from kvmesh.router.prefix_match import PrefixMatch
from kvmesh.router.prompt_tokens import PromptTokens
from kvmesh.router.proxy import Proxy
from kvmesh.router.responses import header, send_body, send_error, send_json
from kvmesh.router.routing import Routing

__all__ = ["Router", "RouterConfig", "POLICIES"]

log = logging.getLogger("kvmesh.router")

POLICIES = policies.NAMES  # the registry's names (router/policies)
_GET = ("GET", "HEAD")
_METHODS = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/v1/models": _GET,
    "/health": _GET,
    "/ready": _GET,
    "/metrics": _GET,
    "/openapi.json": _GET,
}  # the routes the router documents, and their methods
MAX_LISTED_ADAPTERS = 4096  # /v1/models lists at most this many adapters (sorted by name)
KEEPALIVE_S = 3.0  # below the engines' 5 s keep-alive: a pooled connection is never one they closed
SHUTDOWN_STEP_S = 2.0


class Router:
    def __init__(self, cfg: RouterConfig, encoder=None):
        self.cfg = cfg
        self.policy = policies.create(
            cfg.policy, PolicySettings(cfg.weights, cfg.hot_ratio, cfg.hot_min, cfg.session_header)
        )
        self.metrics = RouterMetrics()
        vocab = cfg.vocab_size
        if encoder is None:
            from kvmesh.common.model_lookup import find_model_dir
            from kvmesh.common.tokenizer import KVMeshTokenizer
            from kvmesh.router.fast_tokenize import FastEncoder

            model_dir = find_model_dir(cfg.tokenizer or cfg.model)
            encoder = FastEncoder(KVMeshTokenizer(model_dir))
            vocab = vocab or _config_vocab(model_dir)
        self.encoder = encoder
        # The engine refuses token ids outside its model's vocabulary; so does the router.
        self.vocab_size = (
            vocab or getattr(getattr(encoder, "tok", None), "vocab_size", None) or (1 << 32)
        )
        self.keys = ApiKeys(cfg.api_keys)
        self.limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm)
        self.traffic = PodTraffic(Breaker(cfg.eject_after, cfg.eject_seconds, self.metrics))
        self.drain = Drain()
        self.redis = None
        self.discovery: Discovery | None = None
        self.session: aiohttp.ClientSession | None = None
        self.prompt_tokens = PromptTokens(
            encoder,
            cfg.model,
            cfg.block_size,
            TOOL_PROMPTS[cfg.tool_call_parser],
            engine=cfg.engine,
        )
        self.hold_queue = HoldQueue(
            cfg.model,
            cfg.max_pending_requests,
            cfg.scale_from_zero_timeout,
            self.metrics,
            self.drain,
        )
        self.prefix_match = PrefixMatch(cfg.model, self.metrics, cfg.redis_retry_after)
        self.admission = Admission(
            self.keys, self.limiter, self.metrics, cfg.max_body_bytes, self.vocab_size
        )
        self.routing = Routing(
            self.policy,
            cfg.policy,
            cfg.block_size,
            self.prompt_tokens,
            self.prefix_match,
            self.hold_queue,
            self.traffic,
            self.admission,
            self.metrics,
        )
        self.routing.holds = cfg.holds
        self.proxy = Proxy(cfg, not self.keys.enabled, self.metrics, self.traffic, self.drain)
        self.pipeline = Pipeline(
            self.admission,
            self.routing,
            self.proxy,
            self.limiter,
            self.metrics,
            self.drain,
            cfg.policy,
            cfg.holds,
            cfg.scale_from_zero_timeout,
            cfg.max_resumes,
            cfg.resume_timeout,
            cfg.engine,
        )
        # flow control (router/flow): off unless configured, as GIE's flow-control layer
        self.flow = (
            FlowControl(cfg.flow, cfg.model, self.metrics, self.traffic)
            if cfg.flow.enabled
            else None
        )
        self.routing.flow = self.pipeline.flow = self.flow
        self._started = False
        self._openapi: bytes | None = None

    # -- the drain's last step (router/server.py) --------------------------------------------------
    def cut(self) -> None:
        """The drain timed out: every engine response still open is closed and every request
        waiting for its engine's status line cancelled (each client gets an error event and
        [DONE], or a 503); held requests get a 503."""
        self.drain.cutting = True
        self.proxy.cut()
        self.hold_queue.cancel_all()
        if self.flow is not None:
            self.flow.cancel_all()

    # -- lifespan ---------------------------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.cfg
        if cfg.redis_url:
            import redis.asyncio as aioredis

            # A connection error is retried once (a restarted Redis leaves the pool's connections
            # dead; each would otherwise fail one lookup and pause the block sets for a second).
            self.redis = aioredis.Redis.from_url(
                cfg.redis_url,
                socket_timeout=cfg.redis_timeout,
                socket_connect_timeout=cfg.redis_timeout,
                retry=rl.reconnecting_retry(),
            )
        slices = (
            EndpointSlices(cfg.k8s_service, cfg.k8s_namespace, cfg.k8s_api_url)
            if cfg.k8s_service
            else None
        )
        self.discovery = Discovery(
            cfg.model,
            self.redis,
            self.metrics,
            cfg.static_backends,
            cfg.refresh_interval,
            slices,
            backends_file=cfg.backends_file,
            redis_stale_after=cfg.redis_stale_after,
        )
        self.prefix_match.attach(self.discovery, self.redis)
        self.hold_queue.attach(self.discovery, self.redis)
        self.routing.discovery = self.discovery
        if self.flow is not None:
            self.flow.attach(self.discovery, self.redis)
        await self.discovery.refresh()
        self.discovery.start()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=KEEPALIVE_S)
        self.session = self.proxy.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            trace_configs=[body_sent_trace()] if self.cfg.holds or self.flow else None,
        )

    async def shutdown(self) -> None:
        """Each step gets at most SHUTDOWN_STEP_S: a clean-up that hangs (a Redis or engine
        connection in a bad state) is logged by name and left behind, never holding the exit."""
        self.hold_queue.stop()
        steps = [
            ("flow control", self.flow.stop() if self.flow is not None else None),
            ("discovery", self.discovery.stop() if self.discovery is not None else None),
            ("engine connections", self.session.close() if self.session is not None else None),
            ("redis", self.redis.aclose() if self.redis is not None else None),
        ]
        for name, coro in steps:
            if coro is None:
                continue
            task = asyncio.ensure_future(coro)
            done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_S)
            if not done:
                task.cancel()
                log.warning(
                    "shutdown: closing the %s took over %.0fs; left behind", name, SHUTDOWN_STEP_S
                )
            elif not task.cancelled() and task.exception() is not None:
                log.warning("shutdown: closing the %s failed: %s", name, task.exception())

    async def _lifespan(self, receive, send) -> None:
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

    # -- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        started = False

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                if (
                    self.drain.draining
                ):  # the server honours it: this connection ends with this response
                    msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
            await send(msg)

        me = object()
        self.drain.active[me] = (route_label(scope.get("path", "")), time.monotonic())
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
            log.exception(
                "unexpected error on %s %s", scope.get("method"), route_label(scope.get("path", ""))
            )
            if not started:
                try:
                    await send_error(tracked, 500, "internal router error", "server_error")
                except Exception:  # noqa: BLE001
                    pass
        finally:
            del self.drain.active[me]

    async def _http(self, scope, receive, send):
        path, method = scope["path"], scope["method"]
        allowed = _METHODS.get(path)
        if (
            allowed is not None and method not in allowed
        ):  # a route of ours, another method: 405 + Allow
            self.metrics.requests.labels(route_label(path), "405").inc()
            return await send_error(
                send,
                405,
                f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                "invalid_request_error",
                [(b"allow", ", ".join(allowed).encode())],
                code="method_not_allowed",
            )
        if method == "POST" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            return await self.pipeline.handle(scope, receive, send)
        if path == "/health":
            return await send_json(send, 200, {"status": "ok"})
        if path == "/ready":
            return await self.ready(send)
        if path == "/metrics":
            return await send_body(
                send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8"
            )
        if path == "/openapi.json":
            return await send_body(send, 200, self.openapi())
        if path == "/v1/models":
            return await self._models(scope, send)
        self.metrics.requests.labels(route_label(path), "404").inc()
        return await send_error(send, 404, f"no route for {method} {path[:200]}", "not_found_error")

    async def _models(self, scope, send):
        if self.keys.enabled and self.keys.check(header(scope, b"authorization")) is None:
            self.metrics.auth_failures.inc()
            self.metrics.requests.labels("/v1/models", "401").inc()
            return await send_error(
                send,
                401,
                "invalid or missing API key",
                "authentication_error",
                code="invalid_api_key",
            )
        return await send_json(send, 200, {"object": "list", "data": self.model_cards()})

    def model_cards(self) -> list[dict]:
        """The served model, then the LoRA adapters the routable replicas serve (parent: the model)."""
        base = self.cfg.model
        pods = self.discovery.routable() if self.discovery else []
        cards = [{"id": base, "object": "model", "created": 0, "owned_by": "kvmesh"}]
        for name in adapters.listed(pods, MAX_LISTED_ADAPTERS):
            cards.append(
                {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh", "parent": base}
            )
        return cards

    async def ready(self, send):
        """200 while the router can accept requests: a routable pod, or none but requests are held
        until one is (scale from zero); the detail says how many are held. 503 once draining."""
        n = len(self.discovery.routable()) if self.discovery else 0
        draining = self.drain.draining
        ok = (bool(n) or self.cfg.holds) and not draining
        if draining:
            status = "draining: shutting down"
        elif n:
            status = "ready"
        elif self.cfg.holds:
            status = "ready: no routable engine, requests are held until one is (scale from zero)"
        else:
            status = "no ready engines"
        return await send_json(
            send,
            200 if ok else 503,
            {
                "status": status,
                "pods": n,
                "redis": bool(self.discovery and self.discovery.redis_ok),
                "discovery": self.discovery.detail() if self.discovery else None,
                "block_sets": self.prefix_match.state() if self.discovery else "off",
                "held_requests": len(self.hold_queue),
                "max_pending_requests": self.cfg.max_pending_requests if self.cfg.holds else 0,
                "flow_queued": len(self.flow.queue) if self.flow is not None else None,
            },
        )

    def openapi(self) -> bytes:
        """The OpenAPI document of the router's surface (kvmesh.common.openapi): the engines'
        request and response schemas, the router's own statuses, its probes."""
        if self._openapi is None:
            vocab = self.vocab_size if self.vocab_size < (1 << 32) else None
            self._openapi = json.dumps(
                oa.router_document(self.cfg.model, vocab, auth=self.keys.enabled)
            ).encode()
        return self._openapi


def _config_vocab(model_dir: Path) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return v if isinstance(v, int) and v > 0 else None
