"""Flow control's asyncio side: a request passes at once while some replica has room, else waits in its band's queue until the dispatcher releases it, or is refused.

A request passes straight through when nothing waits and some routable replica is not
saturated. Otherwise it is queued (queue.py): the dispatcher releases the next one (highest
band, least-served tenant) each time a replica has room. A request let through counts against
the replicas' room until it is on an engine's socket (the hold queue's `sent`), so one look's
worth of room is not handed out many times over. A request refused here never reached an engine:
429 with Retry-After (no room, shed for a higher band or a smaller tenant, or its deadline
passed: the replicas are busy, not down). A request already sent is never touched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from kvmesh.router.flow import queue as fq
from kvmesh.router.flow.fairness import OTHER, VirtualCounters
from kvmesh.router.flow.identity import Identity, identify
from kvmesh.router.flow.queue import FlowQueue, Ticket
from kvmesh.router.flow.saturation import all_saturated, headroom
from kvmesh.router.flow.settings import FlowSettings
from kvmesh.router.flow.shared_counters import SharedCounters
from kvmesh.router.hold_queue import Held
from kvmesh.router.request_checks import Refused
from kvmesh.router.responses import shutdown_refused

log = logging.getLogger("kvmesh.router")

DISPATCHED = "dispatched"
DISCONNECT = "disconnect"
SHUTDOWN = "shutdown"
POLL_S = 0.02  # how often the dispatcher looks at saturation while requests wait


@dataclass
class Flow:
    """A request's place in flow control (Call.flow)."""

    identity: Identity
    tenant: str  # its flow in the tenant table (the identity's tenant, or OTHER)
    held: Held | None = None  # its `sent` is set once it is on an engine's socket
    waited: bool = False  # it waited in the queue


class FlowControl:
    """`discovery`, `redis` are set by the router's startup (attach)."""

    def __init__(self, s: FlowSettings, model: str, metrics, traffic, clock=time.monotonic):
        self.s = s
        self.model = model
        self.metrics = metrics
        self.traffic = traffic
        self.clock = clock
        self.queue = FlowQueue(s)
        self.counters = VirtualCounters(
            s.max_tenants, s.half_life, clock, busy=lambda t: self.queue.queued(t) > 0
        )
        self.counters.on_evict = self._forget_tenant
        self.router_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.discovery = None
        self.shared: SharedCounters | None = None
        self._dispatcher: asyncio.Task | None = None
        self._sync: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._launching: list[Held] = []  # let through, not yet on an engine's socket
        self._last: str | None = None  # the tenant let through last (VTC's lift)
        for band in s.bands:
            metrics.flow_queue_depth.labels(band.name).set(0)

    @property
    def enabled(self) -> bool:
        return self.s.enabled

    def attach(self, discovery, redis) -> None:
        self.discovery = discovery
        if redis is not None and self.enabled:
            self.shared = SharedCounters(
                redis,
                self.model,
                self.router_id,
                self.counters,
                lambda: len(self.queue),
                self.metrics.redis_errors.labels("flow_sync").inc,
            )
            self._sync = asyncio.ensure_future(self.shared.run(self.s.sync_interval))

    async def stop(self) -> None:
        for task in (self._sync, self._dispatcher):
            if task is not None:
                task.cancel()
        if self.shared is not None:
            await self.shared.forget()

    # -- the request's side ---------------------------------------------------------------------
    async def wait(self, call, watcher: asyncio.Future) -> bool:
        """Returns once the request may go to an engine (True) or its client left (False);
        Refused when flow control refuses it. Charges its prompt to its tenant on the way out."""
        if not self.enabled or not call.generate:
            return True
        ident = identify(self.s, call.headers, call.key_info)
        flow = call.flow = Flow(ident, self.counters.tenant(ident.tenant))
        self.metrics.flow_tenants.set(len(self.counters))
        self._lift(flow)
        if not len(self.queue) and not self.saturated():
            self._let_through(flow, len(call.tokens))
            self.metrics.flow_dispatched.labels(ident.band.name, "no").inc()
            return True
        flow.waited = True
        outcome, waited = await self._queued(flow, watcher)
        band = ident.band.name
        self.metrics.flow_queued_seconds.labels(band, outcome).observe(waited)
        if outcome == DISCONNECT or watcher.done():
            return False
        if outcome != DISPATCHED:
            self.metrics.flow_shed.labels(band, outcome).inc()
            raise refusal(outcome, ident)
        self._let_through(flow, len(call.tokens))
        self.metrics.flow_dispatched.labels(band, "yes").inc()
        return True

    def _let_through(self, flow: Flow, prompt_tokens: int) -> None:
        """Charged its prompt; counted as launching until it is on an engine's socket."""
        if flow.held is None:  # (one the dispatcher released is counted already)
            flow.held = Held()
            self._launching.append(flow.held)
        self._charge(flow, prompt_tokens, self.s.prompt_weight)
        self._last = flow.tenant

    def _lift(self, flow: Flow) -> None:
        """VTC's lift, for a tenant with nothing waiting: to the least service among the tenants
        waiting in its band, or (none waits) to the service of the tenant let through last, less
        the newcomer credit. Time idle, or served while there was room for everyone, earns no
        more credit than that and costs none. The credit is a head start, never a debt: a lift
        only raises, so a tenant is at most `newcomer_credit` behind the least-served waiting one,
        and a light tenant's burst is served at the full dispatch rate for that much instead of
        taking turns with the flood from its first request."""
        if self.queue.queued(flow.tenant):
            return
        floor = self.queue.lowest_service(flow.identity.band.name, self.counters.value)
        if floor is None and self._last is not None:
            floor = self.counters.value(self._last)
        if floor is not None:
            self.counters.lift(flow.tenant, floor - self.s.newcomer_credit)

    async def _queued(self, flow: Flow, watcher: asyncio.Future) -> tuple[str, float]:
        ident, now = flow.identity, self.clock()
        t = Ticket(flow.tenant, ident.band, now, now + ident.deadline_s)
        for victim in self.queue.push(t):
            if not victim.go.go.done():
                victim.go.go.set_result(victim.outcome)
        if t.outcome is not None:
            return t.outcome, 0.0
        t.go = flow.held = Held()
        self._gauges()
        self._kick()
        try:
            await asyncio.wait(
                {t.go.go, watcher}, timeout=ident.deadline_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if (
                not t.go.go.done()
            ):  # the deadline (the dispatcher's look may lag), or the client left
                self.queue.remove(t)
                t.go.go.set_result(DISCONNECT if watcher.done() else fq.DEADLINE)
            self._gauges()
        return t.go.go.result(), self.clock() - t.enqueued_at

    def done(self, call, usage: dict | None) -> None:
        """The request ended: its output tokens are charged to its tenant, the dispatcher looks again."""
        flow = getattr(call, "flow", None)
        if flow is None:
            return
        out = (usage or {}).get("completion_tokens")
        if isinstance(out, int) and out > 0:
            self._charge(flow, out, self.s.output_weight)
        self._kick()

    # -- the dispatcher ---------------------------------------------------------------------------
    def saturated(self) -> bool:
        pods = self.discovery.routable() if self.discovery is not None else []
        self._launching = [h for h in self._launching if not h.sent.is_set()]
        full = all_saturated(pods, self.traffic.inflight, self.s, len(self._launching))
        self.metrics.flow_saturated.set(1 if full else 0)
        return full

    def with_room(self, pods: list) -> list:
        """The pods that take this request without queueing it in their engine (all of them when
        none does): the policy chooses among these, so a request let through for one replica's
        room does not wait in another's queue."""
        if not self.enabled:
            return pods
        inflight = self.traffic.inflight
        roomy = [p for p in pods if headroom(p, inflight.get(p.name, 0), self.s) > 0]
        return roomy or pods

    def _kick(self) -> None:
        if not len(self.queue):
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.ensure_future(self._dispatch_loop())

    async def _dispatch_loop(self) -> None:
        while len(self.queue):
            for t in self.queue.expire(self.clock()):
                if not t.go.go.done():
                    t.go.go.set_result(t.outcome)
            if len(self.queue) and not self.saturated():
                t = self.queue.pop(self.counters.value)
                self._gauges()
                if t is None or t.go.go.done():
                    continue
                t.go.go.set_result(DISPATCHED)
                self._launching.append(t.go)  # counted until it is on an engine's socket
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass
        self._gauges()

    def cancel_all(self) -> None:
        """The drain timed out: every waiting request gets a 503 now."""
        for bq in self.queue.bands:
            for q in list(bq.tenants.values()):
                for t in list(q):
                    self.queue.remove(t)
                    if not t.go.go.done():
                        t.go.go.set_result(SHUTDOWN)
        self._gauges()

    # -- bookkeeping ------------------------------------------------------------------------------
    def _charge(self, flow: Flow, tokens: int, per_token: float) -> None:
        amount = tokens * per_token / flow.identity.weight
        if amount > 0 and flow.tenant in self.counters:
            self.counters.charge(flow.tenant, amount)
            self.metrics.flow_tenant_service.labels(flow.tenant).inc(amount)

    def _forget_tenant(self, tenant: str) -> None:
        if tenant != OTHER:
            try:
                self.metrics.flow_tenant_service.remove(tenant)
            except KeyError:
                pass

    def _gauges(self) -> None:
        for bq in self.queue.bands:
            self.metrics.flow_queue_depth.labels(bq.band.name).set(bq.count)


def refusal(outcome: str, ident: Identity) -> Refused:
    """What a request flow control did not let through gets (it never reached an engine)."""
    band = ident.band.name
    if outcome == fq.DEADLINE:  # backpressure, as a full queue (llm-d answers TTL evictions so)
        return Refused(
            429,
            f"every replica is saturated and the request waited its deadline "
            f"({ident.deadline_s:g} s) in the {band} band; retry later",
            "rate_limit_error",
            code="flow_deadline",
            headers=[(b"retry-after", b"2")],
        )
    if outcome == SHUTDOWN:
        return shutdown_refused()
    why = {
        fq.QUEUE_FULL: f"the {band} band's queue is full",
        fq.SHED: "it made room for a request of a higher band",
        fq.TENANT_SHARE: "it made room for a tenant holding less of the queue",
    }.get(outcome, outcome)
    return Refused(
        429,
        f"every replica is saturated and the request was not queued: {why}; retry later",
        "rate_limit_error",
        code="flow_shed" if outcome != fq.QUEUE_FULL else "flow_queue_full",
        headers=[(b"retry-after", b"1")],
    )
