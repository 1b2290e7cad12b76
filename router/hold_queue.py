"""The hold queue (scale from zero): requests wait, in arrival order, until a pod is routable.

While requests are held, the model's demand key in Redis tells the autoscalers (the operator,
`kvmesh up --autoscale`) to scale a model at zero replicas back up. Held requests are released
one at a time, oldest first, each once the one before it is on the engine's socket, so the
engine sees them in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import aiohttp

from kvmesh.common import redis_layout as rl
from kvmesh.router.drain import Drain
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request_checks import Refused
from kvmesh.router.responses import shutdown_refused

log = logging.getLogger("kvmesh.router")


class Held:
    """A request held for lack of a routable pod; `go` resolves when it may be routed, `sent` is
    set once its body is on the engine's socket (or it has given up), so the next one is released
    after it."""

    __slots__ = ("go", "sent")

    def __init__(self):
        self.go: asyncio.Future = asyncio.get_running_loop().create_future()
        self.sent = asyncio.Event()


def body_sent_trace() -> aiohttp.TraceConfig:
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


class HoldQueue:
    def __init__(
        self, model: str, max_pending: int, timeout: float, metrics: RouterMetrics, drain: Drain
    ):
        self.model = model
        self.max_pending = max_pending
        self.timeout = timeout
        self.metrics = metrics
        self.drain = drain  # a hold the drain's cut ends is a "shutdown", not a "timeout"
        self.discovery = None
        self.redis = None
        self._held: deque[Held] = deque()
        self._task: asyncio.Task | None = None
        self._demand_at = -1e9
        self._demand_warned = -1e9

    def attach(self, discovery, redis) -> None:
        """At the router's startup: the pods' discovery and the Redis client (or None)."""
        self.discovery = discovery
        self.redis = redis

    def __len__(self) -> int:
        return len(self._held)

    async def hold(self, watcher: asyncio.Future) -> tuple[str, float, Held | None]:
        """Wait, in arrival order, for a routable pod. Returns (outcome, seconds held, the hold):
        outcome is dispatched, timeout, queue_full, disconnect or shutdown (the drain timed out)."""
        m = self.metrics
        if len(self._held) >= self.max_pending:
            m.held_outcomes.labels("queue_full").inc()
            return "queue_full", 0.0, None
        h = Held()
        self._held.append(h)
        m.held.set(len(self._held))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._release_loop())
        t = time.monotonic()
        try:
            await asyncio.wait(
                {h.go, watcher}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
            )
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
        elif self.drain.cutting:
            outcome = "shutdown"
        else:
            outcome = "timeout"
        m.held_outcomes.labels(outcome).inc()
        m.held_wait.labels(outcome).observe(waited)
        if outcome == "timeout":
            log.warning("held request gave up: no engine ready within %.0f s", self.timeout)
        return outcome, waited, h

    def refusal(self, outcome: str) -> Refused:
        """The 503 a held request gets when it was not dispatched."""
        if outcome == "queue_full":
            return Refused(
                503,
                f"no engine is ready and {self.max_pending} requests already wait "
                "for one (scale from zero); retry later",
                "service_unavailable",
                code="no_ready_engine",
                headers=[(b"retry-after", b"5")],
            )
        if outcome == "shutdown":
            return shutdown_refused()
        return Refused(
            503,
            f"no engine became ready within {self.timeout:g} s (scale from zero); retry later",
            "service_unavailable",
            code="no_ready_engine",
            headers=[(b"retry-after", b"10")],
        )

    def cancel_all(self) -> None:
        """The drain timed out: every held request gets a 503 now."""
        for h in list(self._held):
            h.go.cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _release_loop(self) -> None:
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
                        except TimeoutError:
                            pass
                    continue
                await asyncio.sleep(0.05)
        finally:
            self.metrics.held.set(len(self._held))

    async def signal_demand(self) -> None:
        """Set the model's demand key (the current unix time, TTL DEMAND_TTL_S)."""
        if self.redis is None:
            return
        try:
            await self.redis.set(
                rl.demand_key(self.model), f"{time.time():.3f}", ex=rl.DEMAND_TTL_S
            )
            self.metrics.demand_signals.inc()
        except Exception as exc:  # noqa: BLE001 - the request still waits; the next second tries again
            self.metrics.redis_errors.labels("demand").inc()
            now = time.monotonic()
            if now - self._demand_warned > 30:  # once per 30 s, not every second
                self._demand_warned = now
                log.warning(
                    "could not signal demand in Redis (requests are held for lack of an engine): %s",
                    exc,
                )
