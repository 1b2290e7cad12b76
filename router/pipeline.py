"""One generation (or tokenize) request from its first byte to its settlement: admit -> route -> proxy -> settle.

A stage that refuses the request raises :class:`Refused`: answered here with an OpenAI error,
counted by route and status (a refusal after admission refunds the rate-limit charge). A client
gone before its answer ends the pipeline with nothing sent, and cancels the upstream request.
"""

from __future__ import annotations

import asyncio
import time

from kvmesh.router.admission import Admission
from kvmesh.router.auth import RateLimiter
from kvmesh.router.call import Call
from kvmesh.router.drain import Drain
from kvmesh.router.metrics import RouterMetrics, status_label
from kvmesh.router.off_loop import OFF_LOOP_BODY_BYTES, off_loop
from kvmesh.router.proxy import UNREACHED, Outcome, Proxy
from kvmesh.router.request_checks import Refused
from kvmesh.router.responses import send_refused, wait_disconnect
from kvmesh.router.routing import Routing
from kvmesh.router.settle import settle


class Pipeline:
    def __init__(self, admission: Admission, routing: Routing, proxy: Proxy, limiter: RateLimiter,
                 metrics: RouterMetrics, drain: Drain, policy: str, holds: bool, hold_bound_s: float):
        self.admission = admission
        self.routing = routing
        self.proxy = proxy
        self.limiter = limiter
        self.metrics = metrics
        self.drain = drain
        self.policy = policy
        self.holds = holds  # scale from zero is on
        self.hold_bound_s = hold_bound_s  # how long a request that reached no engine is routed again

    async def handle(self, scope, receive, send) -> None:
        call = self.admission.begin(scope)
        try:  # the cheap checks first: key, body size, JSON, the fields the router reads, rate limit
            self.admission.authenticate(call)
            if not await self.admission.read_body(call, receive):
                return  # the client went away while sending its body
            if len(call.body) >= OFF_LOOP_BODY_BYTES:  # a large body's JSON and checks: off the loop
                await off_loop(self.admission.parse, call)
            else:
                self.admission.parse(call)
            self.admission.admit(call)
        except Refused as r:
            return await self._refuse(send, call, r)
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            try:
                if not await self.routing.route(call, watcher):
                    return  # the client went away (counted as a 499)
            except Refused as r:
                self.admission.refund(call)  # never reached an engine
                return await self._refuse(send, call, r)
            out = await self._proxy_rerouting(call, send, watcher)
        finally:
            watcher.cancel()
            if call.held is not None:
                call.held.sent.set()
        if out is not None:  # None: settled where the client went away
            settle(call, out, self.metrics, self.limiter, self.policy)

    async def _refuse(self, send, call: Call, r: Refused) -> None:
        self.metrics.requests.labels(call.route, status_label(r.status)).inc()
        await send_refused(send, r, call.extra)

    async def _proxy_rerouting(self, call: Call, send, watcher: asyncio.Future) -> Outcome | None:
        """The proxy; when no candidate even accepted the connection (the request reached no engine:
        the pods believed ready died an instant ago), route it again, with back-off, until a pod
        takes it or the scale-from-zero bound passes: a request no engine saw is not lost to a
        fault. Without holding (scale from zero off) the first such failure is answered (502).
        None when the client left while held (already counted)."""
        deadline = time.monotonic() + self.hold_bound_s
        pause = 0.1
        while True:
            last_chance = not self.holds or time.monotonic() + pause >= deadline or self.drain.cutting
            out = await self._proxy(call, send, watcher, answer_unreached=last_chance)
            if out.error != UNREACHED or last_chance:
                return out
            self.metrics.retries.labels("unreached").inc()
            await asyncio.wait({watcher}, timeout=pause)
            if watcher.done():
                self.metrics.client_disconnects.inc()
                return Outcome(499, out.pod)   # settle counts it
            pause = min(pause * 2, 2.0)
            try:
                pods = await self.routing.routable_pods(call, watcher)
            except Refused as r:  # held, and no pod came back in time
                await send_refused(send, r, call.extra)
                return Outcome(r.status, out.pod, attempts=out.attempts, error=r.code)
            if pods is None:  # the client left while held: routable_pods settled it
                return None
            await self.routing.order(call, pods)

    async def _proxy(self, call: Call, send, watcher: asyncio.Future, answer_unreached: bool) -> Outcome:
        """The proxy to the ordered pods; a client that goes away cancels the upstream request."""
        on_sent = call.held.sent.set if call.held is not None else None
        task = asyncio.ensure_future(self.proxy.send(send, self.proxy.request(call, on_sent, answer_unreached)))
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
