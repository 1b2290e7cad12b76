"""The prefix-aware router: an OpenAI-compatible front door (raw ASGI, for a lean hot path).

Per request: authenticate, read the body (size-limited), tokenize exactly like the engine
(chat template included), compute the contract-1 block keys, ask Redis in one round trip
how long a prefix of them each live pod holds, score (contract 4), and proxy to the best
pod with streaming passthrough, retrying the next-best pod on a connect failure or a
5xx before the first byte. See docs/router.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import aiohttp

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import block_keys, key_hex
from kvmesh.common.prompts import prompt_batch
from kvmesh.router.auth import ApiKeys, KeyInfo, RateLimiter
from kvmesh.router.discovery import Discovery, EndpointSlices, Pod
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.scoring import Candidate, Weights, rank, rendezvous

log = logging.getLogger("kvmesh.router")
access_log = logging.getLogger("kvmesh.router.access")

POLICIES = ("prefix", "least-load", "round-robin", "session")
_RID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PASS_HEADERS = {"content-type", "content-encoding", "cache-control", "retry-after"}


@dataclass
class RouterConfig:
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    static_backends: list[str] = field(default_factory=list)
    policy: str = "prefix"
    weights: Weights = field(default_factory=Weights)
    block_size: int = 16
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


class _Upstream5xx(Exception):
    pass


class Router:
    def __init__(self, cfg: RouterConfig, encoder=None):
        self.cfg = cfg
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown policy {cfg.policy!r} (expected one of {', '.join(POLICIES)})")
        self.metrics = RouterMetrics()
        if encoder is None:
            from kvmesh.common.models import resolve_model_dir
            from kvmesh.common.tokenizer import KVMeshTokenizer
            from kvmesh.router.fast_tokenize import FastEncoder

            encoder = FastEncoder(KVMeshTokenizer(resolve_model_dir(cfg.tokenizer or cfg.model, convert=False)))
        self.encoder = encoder
        self.keys = ApiKeys(cfg.api_keys)
        self.limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm)
        self.breaker = Breaker(cfg.eject_after, cfg.eject_seconds, self.metrics)
        self.inflight: dict[str, int] = {}
        self._rr = count()
        self.redis = None
        self.discovery: Discovery | None = None
        self.session: aiohttp.ClientSession | None = None
        self._redis_down_until = 0.0
        self._use_lua = True
        self._match = None
        self._started = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        self._started = True
        if self.cfg.redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.Redis.from_url(self.cfg.redis_url, socket_timeout=self.cfg.redis_timeout,
                                                 socket_connect_timeout=self.cfg.redis_timeout)
            self._match = self.redis.register_script(rl.PREFIX_MATCH_LUA)
        slices = (EndpointSlices(self.cfg.k8s_service, self.cfg.k8s_namespace, self.cfg.k8s_api_url)
                  if self.cfg.k8s_service else None)
        self.discovery = Discovery(self.cfg.model, self.redis, self.metrics, self.cfg.static_backends,
                                   self.cfg.refresh_interval, slices)
        await self.discovery.refresh()
        self.discovery.start()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))

    async def shutdown(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self.session is not None:
            await self.session.close()
        if self.redis is not None:
            await self.redis.aclose()

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
        path, method = scope["path"], scope["method"]
        if method == "POST" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            return await self.handle(scope, receive, send)
        if path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if path == "/ready":
            n = len(self.discovery.routable()) if self.discovery else 0
            return await _json(send, 200 if n else 503, {"status": "ready" if n else "no ready engines",
                                                         "pods": n, "redis": bool(self.discovery and self.discovery.redis_ok)})
        if path == "/metrics":
            return await _send(send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/models" and method == "GET":
            if self.keys.enabled and self.keys.check(_header(scope, b"authorization")) is None:
                self.metrics.auth_failures.inc()
                return await _error(send, 401, "invalid or missing API key", "authentication_error")
            return await _json(send, 200, {"object": "list", "data": [
                {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "kvmesh"}]})
        return await _error(send, 404, f"no route for {method} {path}", "not_found_error")

    # -- the request path -----------------------------------------------------------------------
    async def handle(self, scope, receive, send):
        t0 = time.perf_counter()
        m = self.metrics
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id")
        if not rid or not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        extra = [(b"x-request-id", rid.encode())]

        key_info = None
        if self.keys.enabled:
            key_info = self.keys.check(headers.get("authorization"))
            if key_info is None:
                m.auth_failures.inc()
                m.requests.labels(path, "401").inc()
                return await _error(send, 401, "invalid or missing API key", "authentication_error", extra)
        client_id = key_info.key_id if key_info else "ip:" + ((scope.get("client") or ("?",))[0])

        limit = self.cfg.max_body_bytes
        try:
            declared = int(headers.get("content-length") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            m.requests.labels(path, "413").inc()
            return await _error(send, 413, f"request body larger than {limit} bytes", "invalid_request_error", extra)
        chunks = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                m.requests.labels(path, "413").inc()
                return await _error(send, 413, f"request body larger than {limit} bytes", "invalid_request_error",
                                    extra)
            chunks.append(part)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            m.requests.labels(path, "400").inc()
            return await _error(send, 400, "request body must be a JSON object", "invalid_request_error", extra)

        tokens = self._tokens(path, req)
        est = estimate_tokens(req, len(tokens))
        ok, retry_after, which = self.limiter.admit(client_id, est, key_info.rpm if key_info else None,
                                                    key_info.tpm if key_info else None)
        if not ok:
            m.rate_limited.labels(which).inc()
            m.requests.labels(path, "429").inc()
            return await _error(send, 429, f"rate limit exceeded ({which} per minute)", "rate_limit_error",
                                extra + [(b"retry-after", str(retry_after).encode())])

        # A request scoring its prompt (prompt logprobs, or echo with logprobs) computes every
        # position and reads nothing from the cache: no prefix to match, it goes by load.
        scores_prompt = req.get("prompt_logprobs") is not None or (bool(req.get("echo"))
                                                                    and req.get("logprobs") is not None)
        keys = block_keys(tokens, self.cfg.model, self.cfg.block_size, cache_salt=req.get("cache_salt")) \
            if tokens and not scores_prompt else []
        pods = self.discovery.routable()
        now = time.monotonic()
        usable = [p for p in pods if not self.breaker.ejected(p.name, now)] or pods
        if not usable:
            m.requests.labels(path, "503").inc()
            return await _error(send, 503, "no ready engine for this model", "service_unavailable", extra)
        ordered, reason = await self.decide(usable, keys, headers, body)
        if scores_prompt and reason == "short_prompt":
            reason = "scores_prompt"
        m.decisions.labels(self.cfg.policy, reason).inc()
        predicted = ordered[0].matched_blocks * self.cfg.block_size

        task = asyncio.ensure_future(self.proxy(scope, send, path, body, headers, rid, ordered, t0, extra))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if not task.done():
            task.cancel()  # the client went away: cancel the upstream request (closes its connection)
            m.client_disconnects.inc()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            status, pod, usage, attempts = 499, ordered[0].name, None, 1
        else:
            status, pod, usage, attempts = task.result()
        dur = time.perf_counter() - t0
        m.requests.labels(path, str(status)).inc()
        m.duration.observe(dur)
        m.prompt_tokens.inc(len(tokens))
        cached = None
        if status == 200:
            m.predicted_cached.inc(predicted)
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                if isinstance(cached, int):
                    m.engine_cached.inc(cached)
                    m.prediction_error.observe(predicted - cached)
                real = int(usage.get("total_tokens") or 0)
                if real and real != est:
                    self.limiter.adjust(client_id, real - est, key_info.tpm if key_info else None)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("request", extra={"fields": {
                "request_id": rid, "route": path, "status": status, "pod": pod, "policy": self.cfg.policy,
                "reason": reason, "attempts": attempts, "prompt_tokens": len(tokens),
                "predicted_cached_tokens": predicted, "cached_tokens": cached, "stream": bool(req.get("stream")),
                "duration_ms": round(dur * 1000, 2), "client": client_id}})

    def _tokens(self, path: str, req: dict[str, Any]) -> list[int]:
        try:
            if path == "/v1/chat/completions":
                msgs = req.get("messages")
                if not isinstance(msgs, list):
                    return []
                return self.encoder.encode_chat(msgs, add_generation_prompt=req.get("add_generation_prompt", True),
                                                continue_final_message=bool(req.get("continue_final_message")),
                                                template_kwargs=req.get("chat_template_kwargs"))
            if path == "/v1/completions":
                prompt = prompt_batch(req.get("prompt"))[0]  # a batch routes on its first prompt
                if isinstance(prompt, str):
                    return self.encoder.encode(prompt)
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    return prompt
        except Exception as exc:  # noqa: BLE001 - the engine will answer the malformed request
            log.debug("could not tokenize: %s", exc)
        return []

    async def match(self, pods: list[Pod], keys: list[int]) -> dict[str, int] | None:
        """Matched leading blocks per pod, in one Redis round trip; None if Redis is unavailable."""
        if self.redis is None or time.monotonic() < self._redis_down_until:
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
        policy = self.cfg.policy
        cands = [Candidate(p.name, p.url, p.kv_usage, max(p.load, self.inflight.get(p.name, 0))) for p in pods]
        # Ties break on the prompt's last full block: prompts that share only a system prompt
        # spread over the pods, and every router still picks the same pod for the same prompt.
        tie = keys[-1].to_bytes(8, "little") if keys else body[:512]
        if policy == "round-robin":
            cands.sort(key=lambda c: c.name)
            i = next(self._rr) % len(cands)
            return cands[i:] + cands[:i], "round_robin"
        if policy == "session":
            sid = headers.get(self.cfg.session_header.lower())
            if sid:
                rank(cands, 0, Weights(0, 0, 0), tie, self.cfg.hot_ratio, self.cfg.hot_min)  # marks hot pods
                sid_b = sid.encode()
                cands.sort(key=lambda c: (c.hot, -rendezvous(sid_b, c.name)))
                return cands, "session"
        if policy == "least-load":
            return rank(cands, 0, Weights(0, self.cfg.weights.kv, self.cfg.weights.queue), tie,
                        self.cfg.hot_ratio, self.cfg.hot_min), "least_load"
        # prefix (and session without a session id)
        reason = None
        if keys:
            matched = await self.match(pods, keys)
            if matched is None:
                reason = "redis_unavailable"
            else:
                for c in cands:
                    c.matched_blocks = matched.get(c.name, 0)
        ordered = rank(cands, len(keys), self.cfg.weights, tie, self.cfg.hot_ratio, self.cfg.hot_min)
        if reason is None:
            best = max(ordered, key=lambda c: c.score)
            if best.hot and best is not ordered[0]:
                reason = "hotspot_guard"
            elif not keys:
                reason = "short_prompt"
            elif ordered[0].matched_blocks:
                reason = "prefix_match"
            else:
                reason = "no_match"
        return ordered, reason

    async def proxy(self, scope, send, path, body, headers, rid, ordered, t0, extra):
        """Try the candidates in order; returns (status, pod, usage, attempts)."""
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
        attempts = ordered[: cfg.max_retries + 1]
        last_err = "no attempt"
        for i, cand in enumerate(attempts):
            final = i == len(attempts) - 1
            if i:
                m.retries.labels(last_err.split(":")[0]).inc()
            self.inflight[cand.name] = self.inflight.get(cand.name, 0) + 1
            resp = None
            try:
                if i == 0:
                    m.overhead.observe(time.perf_counter() - t0)
                t_send = time.perf_counter()
                try:
                    resp = await self.session.post(cand.url + target, data=body, headers=fwd, timeout=timeout)
                except asyncio.TimeoutError:
                    self.breaker.failure(cand.name)
                    await _error(send, 504, "upstream engine timed out", "timeout_error",
                                 extra + [(b"x-kvmesh-pod", cand.name.encode())])
                    return 504, cand.name, None, i + 1
                except (aiohttp.ClientError, OSError) as exc:
                    self.breaker.failure(cand.name)
                    last_err = f"connect: {type(exc).__name__}"
                    log.info("upstream %s failed before the response: %s", cand.name, exc,
                             extra={"fields": {"request_id": rid}})
                    continue
                m.ttfb.observe(time.perf_counter() - t_send)
                if resp.status >= 500:
                    self.breaker.failure(cand.name)
                    if not final:
                        last_err = f"status_{resp.status}: upstream"
                        await resp.read()
                        continue
                else:
                    self.breaker.success(cand.name)
                m.routed.labels(cand.name).inc()
                out_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
                               if k.lower() in _PASS_HEADERS]
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": out_headers + extra + [(b"x-kvmesh-pod", cand.name.encode())]})
                stream = "event-stream" in resp.headers.get("content-type", "")
                keep = b""
                async for chunk in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if stream:
                        keep = (keep + chunk)[-8192:]
                    elif len(keep) < 1 << 20:
                        keep += chunk
                await send({"type": "http.response.body", "body": b""})
                usage = _usage(keep, stream) if resp.status == 200 else None
                return resp.status, cand.name, usage, i + 1
            except asyncio.TimeoutError:
                return 504, cand.name, None, i + 1  # headers already sent: the stream just ends
            finally:
                self.inflight[cand.name] -= 1
                if resp is not None:
                    resp.close()  # a half-read response closes its connection (cancels the engine's work)
        await _error(send, 502, f"no engine could take the request ({last_err})", "upstream_error", extra)
        return 502, attempts[-1].name if attempts else "", None, len(attempts)


def estimate_tokens(req: dict[str, Any], prompt_tokens: int) -> int:
    """Tokens a request will use, charged to the rate limit up front (settled with its usage):
    every prompt of a batch (sized like the first) and n completions of each."""
    try:
        n = max(1, int(req.get("n") or 1))
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 0)
    except (TypeError, ValueError):
        n, max_tokens = 1, 0  # malformed: the engine refuses it
    prompts = len(prompt_batch(req.get("prompt")))
    return prompts * (prompt_tokens + n * max_tokens)


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
                "headers": [(b"content-type", ctype), *extra]})
    await send({"type": "http.response.body", "body": body})


async def _json(send, status: int, obj: Any, extra=()):
    await _send(send, status, json.dumps(obj).encode(), extra=extra)


async def _error(send, status: int, message: str, etype: str, extra=()):
    await _json(send, status, {"error": {"message": message, "type": etype, "param": None, "code": status}}, extra)
