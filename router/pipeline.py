"""One generation (or tokenize) request from its first byte to its settlement: admit -> route -> proxy (-> resume) -> settle.

A stage that refuses the request raises :class:`Refused`: answered here with an OpenAI error,
counted by route and status (a refusal after admission refunds the rate-limit charge). A client
gone before its answer ends the pipeline with nothing sent, and cancels the upstream request.
An engine that fails after the request reached it: the request goes on with another replica
(router/resume.py), at most `max_resumes` times.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvmesh.router import resume, vllm_resume
from kvmesh.router.admission import Admission
from kvmesh.router.auth import RateLimiter
from kvmesh.router.client_stream import ClientStream
from kvmesh.router.drain import Drain
from kvmesh.router.metrics import RouterMetrics, status_label
from kvmesh.router.off_loop import OFF_LOOP_BODY_BYTES, off_loop
from kvmesh.router.proxy import UNREACHED, Outcome, Proxy
from kvmesh.router.request_checks import Refused
from kvmesh.router.request_state import Call
from kvmesh.router.responses import send_refused, wait_disconnect
from kvmesh.router.routing import Routing
from kvmesh.router.settle import settle

log = logging.getLogger("kvmesh.router")


class Pipeline:
    def __init__(
        self,
        admission: Admission,
        routing: Routing,
        proxy: Proxy,
        limiter: RateLimiter,
        metrics: RouterMetrics,
        drain: Drain,
        policy: str,
        holds: bool,
        hold_bound_s: float,
        max_resumes: int,
        resume_timeout: float,
        engine: str = "kvmesh",
    ):
        self.admission = admission
        self.routing = routing
        self.proxy = proxy
        self.limiter = limiter
        self.metrics = metrics
        self.drain = drain
        self.policy = policy
        self.holds = holds  # scale from zero is on
        self.hold_bound_s = (
            hold_bound_s  # how long a request that reached no engine is routed again
        )
        self.max_resumes = max_resumes
        self.resume_timeout = (
            resume_timeout  # how long a failed request waits for a replica to go on with
        )
        self.flow = None  # flow control (router/flow), set by the router when it is on
        self.vllm = engine == "vllm"  # streams go on through vLLM's completions API

    async def handle(self, scope, receive, send) -> None:
        call = self.admission.begin(scope)
        try:  # the cheap checks first: key, body size, JSON, the fields the router reads, rate limit
            self.admission.authenticate(call)
            if not await self.admission.read_body(call, receive):
                return  # the client went away while sending its body
            if (
                len(call.body) >= OFF_LOOP_BODY_BYTES
            ):  # a large body's JSON and checks: off the loop
                await off_loop(self.admission.parse, call)
            else:
                self.admission.parse(call)
            self.admission.admit(call)
        except Refused as r:
            return await self._refuse(send, call, r)
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        out = None
        try:
            try:
                if not await self.routing.route(call, watcher):
                    return  # the client went away (counted as a 499)
            except Refused as r:
                self.admission.refund(call)  # never reached an engine
                return await self._refuse(send, call, r)
            self._resumable(call, send)
            out = await self._proxy_rerouting(call, send, watcher)
            if out is not None and out.broken is not None:
                out = await self._resume(call, send, watcher, out)
        finally:
            watcher.cancel()
            for held in call.holds():
                held.sent.set()
            if self.flow is not None:
                self.flow.done(call, out.usage if out is not None else None)
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
            last_chance = (
                not self.holds or time.monotonic() + pause >= deadline or self.drain.cutting
            )
            out = await self._proxy(call, send, watcher, answer_unreached=last_chance)
            if out.error != UNREACHED or last_chance:
                return out
            self.metrics.retries.labels("unreached").inc()
            await asyncio.wait({watcher}, timeout=pause)
            if watcher.done():
                self.metrics.client_disconnects.inc()
                return Outcome(499, out.pod)  # settle counts it
            pause = min(pause * 2, 2.0)
            try:
                pods = await self.routing.routable_pods(call, watcher)
            except Refused as r:  # held, and no pod came back in time
                await send_refused(send, r, call.extra)
                return Outcome(r.status, out.pod, attempts=out.attempts, error=r.code)
            if pods is None:  # the client left while held: routable_pods settled it
                return None
            await self.routing.order(call, pods)

    def _resumable(self, call: Call, send) -> None:
        call.resumable = resume.resumable(call, self.max_resumes)
        if call.resumable and call.req.get("stream") is True:
            num_choices, n = resume.choices(call)
            call.stream = ClientStream(
                send,
                resume.wants_ids(call.req),
                call.path == "/v1/chat/completions",
                num_choices,
                n,
            )
            call.stream.on_resumed = self.metrics.resume_seconds.observe

    async def _resume(
        self, call: Call, send, watcher: asyncio.Future, out: Outcome
    ) -> Outcome | None:
        """While the engine failed after the request reached it: go on with another replica (the
        policy's order, minus the pods that failed it), at most max_resumes times. Then, or with
        no replica left (none came back within resume_timeout), the client gets the failure as it
        would have without resuming."""
        failed = {out.broken.pod}
        while out.broken is not None:
            t_fail = time.perf_counter()
            given_up = self._cannot_resume(call, out)
            if given_up is not None:
                self.metrics.resume_given_up.labels(given_up).inc()
                return await self.proxy.answer_broken(send, out, call.stream)
            ended = await self._ended_already(call, out)
            if ended is not None:
                return ended
            pods = self.routing.resume_pods(failed)
            if not pods and self.resume_timeout > 0:
                pods = await self._wait_for_replica(call, failed, watcher)
                if pods is None:  # the client went away while it waited
                    self.metrics.client_disconnects.inc()
                    return Outcome(499, out.broken.pod, attempts=out.attempts)
            if not pods:
                self.metrics.resume_given_up.labels("no_replica").inc()
                return await self.proxy.answer_broken(send, out, call.stream)
            await self.routing.order(call, pods)
            new = await self._continue(call, send, watcher, out, t_fail)
            if (
                new.error == UNREACHED
            ):  # no pod took the connection: the same failure, those pods out too
                failed.update(c.name for c in call.ordered)
                out.attempts = new.attempts + out.attempts
                continue
            failed.add(new.pod)
            new.attempts += out.attempts
            out = new
        return out

    def _cannot_resume(self, call: Call, out: Outcome) -> str | None:
        stream = call.stream
        if out.broken.hopeless:
            return "refused"
        if self.drain.cutting:
            return "shutdown"
        if call.resumes >= self.max_resumes:
            return "limit"
        if stream is not None and stream.events_out and not stream.engine_sends_ids:
            return (
                "no_token_ids"  # the engine does not say what it generated: nothing to go on from
            )
        if self.vllm and stream is not None and (stream.output_ids or stream.finish_reasons):
            why = vllm_resume.inexact(call.req, stream.num_choices)
            if why is not None:
                log.info(
                    "not resumed on vLLM: %s",
                    why,
                    extra={"fields": {"request_id": call.rid}},
                )
                return "inexact"
        return None

    async def _ended_already(self, call: Call, out: Outcome) -> Outcome | None:
        """A stream whose engine failed once its output was complete (every choice with a finish
        reason out, or its whole budget generated) is ended here, as the engine would have ended
        it. A choice that generated its whole budget is ended here too (no engine goes on with it)."""
        stream = call.stream
        if stream is None or not stream.engine_sends_ids:
            return None
        spent = {i: "length" for i in stream.spent(resume.max_tokens(call.req, stream.chat))}
        if len(spent) == len(stream.running()):
            usage = None  # none asked for, or its chunk went out already (the engine failed before [DONE])
            if resume.include_usage(call.req) and stream.usage is None:
                usage = stream.whole_usage(len(call.tokens))
            await stream.finish(spent, usage)
            return Outcome(200, out.broken.pod, usage or stream.usage, out.attempts)
        await stream.close_choices(spent)
        return None

    async def _wait_for_replica(self, call: Call, failed: set[str], watcher: asyncio.Future):
        """No other replica is routable: wait for one (a restarted engine counts), a stream kept
        alive meanwhile. The pods, [] if none came, None if the client left."""
        stream = call.stream
        keep_alive = stream.keep_alive if stream is not None else _nothing
        self.metrics.resume_waiting.inc()
        try:
            return await self.routing.resume_pods_waiting(
                failed,
                watcher,
                self.resume_timeout,
                lambda: self.drain.cutting,
                keep_alive,
                self.proxy.ready,
            )
        finally:
            self.metrics.resume_waiting.dec()

    async def _continue(
        self, call: Call, send, watcher: asyncio.Future, out: Outcome, t_fail: float
    ) -> Outcome:
        """The request sent on to call.ordered: a stream from the ids its client has received, or
        (nothing generated yet, or not a stream) the request again from the start."""
        stream = call.stream
        call.resumes += 1
        ids = stream.output_ids if stream is not None else []
        self.metrics.resumed.labels(out.broken.phase).inc()
        self.metrics.resumed_tokens.inc(
            len(call.tokens) if stream is None else stream.resume_tokens(len(call.tokens))
        )
        # nothing received yet (no id, no choice finished): the request again from the start
        restart = stream is None or not (ids or stream.finish_reasons)
        path = None
        if restart:
            body = None
        elif self.vllm:
            prompt_ids = stream.prompt_ids.get(0) or call.tokens
            body = vllm_resume.continuation_body(call.req, stream.chat, prompt_ids, ids)
            path = "/v1/completions"
        else:
            body = resume.continuation_body(call.req, stream.continuation())
        if stream is not None:
            stream.resuming(restart=restart, since=t_fail, completions=self.vllm)
        new = await self._proxy(
            call, send, watcher, answer_unreached=False, body=body, continuation=True, path=path
        )
        if stream is None and new.broken is None and new.status < 500:
            self.metrics.resume_seconds.observe(time.perf_counter() - t_fail)
        return new

    async def _proxy(
        self,
        call: Call,
        send,
        watcher: asyncio.Future,
        answer_unreached: bool,
        body: bytes | None = None,
        continuation: bool = False,
        path: str | None = None,
    ) -> Outcome:
        """The proxy to the ordered pods; a client that goes away cancels the upstream request."""
        holds = call.holds() if not continuation else []
        on_sent = (lambda: [h.sent.set() for h in holds]) if holds else None
        req = self.proxy.request(call, on_sent, answer_unreached, body, continuation, path)
        task = asyncio.ensure_future(self.proxy.send(send, req))
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


async def _nothing() -> None:
    return None
