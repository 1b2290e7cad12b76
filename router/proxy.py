"""The proxy: send a request to its ordered pods, retry only what no engine ran, and pass the answer through.

Retried on the next pod: a connect error (the request never left), a 502/503 (the engine says
"not me"), a 429 while another pod has room. Not retried, and not counted against the pod's
breaker: a disconnect after the request was sent, a timeout, any other 5xx (caused by the
request). A generation is never run twice on its own: a request that may be resumed
(router/resume.py) and whose engine failed after it was sent comes back unanswered (its
Outcome's `broken`), for the pipeline to go on with another replica or answer the failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvmesh.common.logging_setup import redact_url
from kvmesh.router import upstream_failure as uf
from kvmesh.router.client_stream import ClientStream
from kvmesh.router.config import RouterConfig
from kvmesh.router.drain import Drain
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.pod_traffic import PodTraffic
from kvmesh.router.request_state import Call
from kvmesh.router.responses import SHUTDOWN_MSG, refuse_shutdown, send_error
from kvmesh.router.resume import stream_body
from kvmesh.router.scoring import Candidate

log = logging.getLogger("kvmesh.router")

_PASS_HEADERS = {"content-type", "content-encoding", "cache-control", "retry-after"}
UNREACHED = "unreached"  # Outcome.error: no engine accepted the connection; nothing was sent


READY_PROBE_TIMEOUT_S = 1.0  # an engine asked whether it is back answers /ready at once, or is not


@dataclass(frozen=True)
class Broken:
    """An engine failed after the request reached it, and the client has not been told: the
    request may go on with another replica (Proxy.answer_broken answers it otherwise)."""

    failure: uf.UpstreamFailure | None  # None: mid-stream, after the client's stream started
    exc: BaseException | str | None
    pod: str
    headers: list  # on the answer, if one comes before the client's stream started
    rid: str
    hopeless: bool = False  # the engine refused the continuation itself: another replica would too

    @property
    def phase(self) -> str:
        return self.failure.stage if self.failure is not None else "mid_stream"


@dataclass
class Outcome:
    status: int
    pod: str
    usage: dict | None = None
    attempts: int = 1
    error: str | None = None  # what went wrong upstream (logged)
    broken: Broken | None = None  # set when not answered: the engine failed after it was sent


@dataclass(frozen=True)
class ProxyRequest:
    """What the proxy needs of one request."""

    target: str  # the path and query string on the engine
    body: bytes
    headers: dict[str, str]  # to the engine
    rid: str  # X-Request-Id
    ordered: list[Candidate]  # the pods to try, best first
    t0: float  # when the router received the request (the overhead metric)
    extra: list  # headers on every answer to the client
    on_sent: Callable[[], None] | None = None  # called as the body goes to the engine's socket
    answer_unreached: bool = (
        True  # when no pod took the connection: answer 502 (else leave it to the caller)
    )
    resumable: bool = (
        False  # an engine's failure after sending is left to the caller (Outcome.broken)
    )
    stream: ClientStream | None = (
        None  # a resumable stream's client side (its events pass through it)
    )
    continuation: bool = (
        False  # sent again after an engine failed (not counted in the overhead metric)
    )


@dataclass
class _Tries:
    queue: list[Candidate]
    budget: int
    tried: int = 0
    last_err: str = "no attempt"
    all_unreached: bool = True  # every try so far failed to connect: no engine has seen the request


class Proxy:
    """`session` is set by the router's startup."""

    def __init__(
        self,
        cfg: RouterConfig,
        pass_client_auth: bool,
        metrics: RouterMetrics,
        traffic: PodTraffic,
        drain: Drain,
    ):
        self.cfg = cfg
        self.pass_client_auth = (
            pass_client_auth  # no API keys of our own: the client's goes to the engine
        )
        self.metrics = metrics
        self.traffic = traffic
        self.drain = drain
        self.session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout, sock_connect=cfg.connect_timeout, sock_read=cfg.read_timeout
        )
        self._upstream: set[aiohttp.ClientResponse] = (
            set()
        )  # engines' responses being passed through
        # Tasks waiting for an engine's status line (a non-streamed answer being generated), and
        # those of them that cut() cancelled: they answer a 503, not the client's disconnect.
        self._awaiting: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()

    def request(
        self,
        call: Call,
        on_sent=None,
        answer_unreached: bool = True,
        body: bytes | None = None,
        continuation: bool = False,
        path: str | None = None,
    ) -> ProxyRequest:
        """`body`: a continuation's (default: the client's, with the token ids asked for when the
        stream may be resumed); `path`: a continuation's on another API (vLLM's completions)."""
        if body is None:
            body = stream_body(call.body, call.req) if call.stream is not None else call.body
        headers = call.headers
        fwd = {
            "Content-Type": headers.get("content-type", "application/json"),
            "X-Request-Id": call.rid,
            "Accept-Encoding": "identity",
        }
        if "accept" in headers:
            fwd["Accept"] = headers["accept"]
        if self.cfg.upstream_api_key:
            fwd["Authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        elif self.pass_client_auth and "authorization" in headers:
            fwd["Authorization"] = headers["authorization"]
        target = (path or call.path) + ("?" + call.query.decode("latin-1") if call.query else "")
        return ProxyRequest(
            target,
            body,
            fwd,
            call.rid,
            call.ordered,
            call.t0,
            call.extra,
            on_sent,
            answer_unreached,
            call.resumable,
            call.stream,
            continuation,
        )

    async def ready(self, pod) -> bool:
        """Whether the pod's engine answers /ready (vLLM: /health) with 200 now (a replica that
        failed a request, asked whether it is back)."""
        headers = (
            {"Authorization": f"Bearer {self.cfg.upstream_api_key}"}
            if self.cfg.upstream_api_key
            else None
        )
        try:
            async with self.session.get(
                pod.url + ("/health" if self.cfg.engine == "vllm" else "/ready"),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=READY_PROBE_TIMEOUT_S),
            ) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def cut(self) -> None:
        """The drain timed out: close every engine response still being passed through, and cancel
        every request still waiting for its engine's status line (either cancels its work in the
        engine: the connection closes)."""
        for resp in list(self._upstream):
            resp.close()
        for task in list(self._awaiting):
            self._cut.add(task)
            task.cancel()

    async def send(self, send, req: ProxyRequest) -> Outcome:
        """Send to the candidates in order (see the module's docstring for what is retried).
        When every try was a connect error and not ``answer_unreached``, nothing is sent to the
        client: the Outcome's error is UNREACHED and the caller may route the request again."""
        tries = _Tries(list(req.ordered), self.cfg.max_retries + 1)
        while tries.queue and tries.tried < tries.budget:
            cand = tries.queue.pop(0)
            tries.tried += 1
            if self.drain.cutting:  # the drain timed out between two tries: no next one
                await refuse_shutdown(send, req.extra)
                return Outcome(503, cand.name, None, tries.tried - 1, "router_shutdown")
            if tries.tried > 1:
                self.metrics.retries.labels(tries.last_err).inc()
            out = await self._attempt(send, req, cand, tries)
            if out is not None:
                return out
        last = req.ordered[-1].name if req.ordered else ""
        if tries.last_err == "connect" and tries.all_unreached and not req.answer_unreached:
            return Outcome(502, last, None, tries.tried, UNREACHED)
        await send_error(
            send,
            502,
            f"no engine could take the request ({tries.last_err})",
            "upstream_error",
            req.extra,
            code="no_engine_reachable",
        )
        return Outcome(502, last, None, tries.tried, tries.last_err)

    async def _attempt(
        self, send, req: ProxyRequest, cand: Candidate, tries: _Tries
    ) -> Outcome | None:
        """One try on one pod: its Outcome, or None to try the next (tries.last_err says why)."""
        name = cand.name
        headers = req.extra + [(b"x-kvmesh-pod", name.encode())]
        inflight = self.traffic.inflight
        inflight[name] = inflight.get(name, 0) + 1
        resp = None
        try:
            if tries.tried == 1 and not req.continuation:
                self.metrics.overhead.observe(time.perf_counter() - req.t0)
            resp, out = await self._post(send, req, cand, tries, headers)
            if resp is None:
                return out
            if self._another_pod(resp, name, tries):
                await drain_body(resp)
                return None
            return await self._answer(send, resp, req, name, tries.tried, headers)
        finally:
            self._cut.discard(asyncio.current_task())
            inflight[name] -= 1
            if resp is not None:
                self._upstream.discard(resp)
                resp.close()  # a half-read response closes its connection (cancels the engine's work)

    async def _post(
        self, send, req: ProxyRequest, cand: Candidate, tries: _Tries, headers: list
    ) -> tuple[aiohttp.ClientResponse | None, Outcome | None]:
        """The request to one pod: (its response, None); or (None, the Outcome already answered);
        or (None, None): no connection was made, the next pod may take it."""
        me = asyncio.current_task()
        t_send = time.perf_counter()
        self._awaiting.add(me)
        try:
            resp = await self.session.post(
                cand.url + req.target,
                data=req.body,
                headers=req.headers,
                timeout=self.timeout,
                trace_request_ctx={"on_sent": req.on_sent} if req.on_sent else None,
            )
        except asyncio.CancelledError:
            if me not in self._cut:  # the client went away, or the server is cancelling us
                raise
            me.uncancel()  # our drain's cut: answered here, the task goes on to its end
            await refuse_shutdown(send, headers)
            return None, Outcome(503, cand.name, None, tries.tried, "router_shutdown")
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # The connection was never made: the engine never saw the request.
            self.traffic.breaker.failure(cand.name)
            self.metrics.upstream_failures.labels("connect").inc()
            tries.last_err = "connect"
            log.info(
                "could not connect to %s: %s",
                redact_url(cand.name),
                exc,
                extra={"fields": {"request_id": req.rid}},
            )
            return None, None
        except TimeoutError as exc:  # sent, no answer in time: the engine may still run it
            return None, await self.upstream_failed(
                send, uf.TIMEOUT, exc, cand.name, req.rid, tries.tried, headers
            )
        except (aiohttp.ClientError, OSError) as exc:
            # Sent, then the connection failed: the engine may be running it. Never twice, unless
            # resumable: then the caller may send it on (the connection's end cancelled the work).
            if req.resumable:
                return None, self._broken(
                    uf.DISCONNECTED, exc, cand.name, req, tries.tried, headers
                )
            return None, await self.upstream_failed(
                send, uf.DISCONNECTED, exc, cand.name, req.rid, tries.tried, headers
            )
        finally:
            self._awaiting.discard(me)
        tries.all_unreached = False
        self.metrics.ttfb.observe(time.perf_counter() - t_send)
        self._upstream.add(resp)
        return resp, None

    def _another_pod(self, resp: aiohttp.ClientResponse, name: str, tries: _Tries) -> bool:
        """Whether the engine said "not me" (429 full, 502/503) and another pod may take the
        request (tries.last_err then says why). Also feeds the breaker and the 429 memory."""
        st = resp.status
        traffic = self.traffic
        if st == 429:  # the engine's queue is full: another pod with room may take it
            traffic.full_until[name] = time.monotonic() + retry_after(resp, 1.0, 10.0)
            now = time.monotonic()
            tries.queue = [c for c in tries.queue if not traffic.full(c.name, now)]
        elif st in (502, 503):  # "not me": draining, loading, or a proxy in front of a dead engine
            traffic.breaker.failure(name)
        else:
            if st < 500:
                traffic.breaker.success(name)
                traffic.full_until.pop(name, None)
            return False
        if tries.queue and tries.tried < tries.budget:
            tries.last_err = f"status_{st}"
            return True
        return False

    async def _answer(
        self,
        send,
        resp: aiohttp.ClientResponse,
        req: ProxyRequest,
        pod: str,
        tried: int,
        headers: list,
    ) -> Outcome:
        """Pass the engine's answer through: a body whole, a stream event by event."""
        self.metrics.routed.labels(pod).inc()
        st = resp.status
        out_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in resp.headers.items()
            if k.lower() in _PASS_HEADERS
        ]
        start = {"type": "http.response.start", "status": st, "headers": out_headers + headers}
        streamed = "event-stream" in resp.headers.get("content-type", "")
        if req.stream is not None and req.stream.started and (st != 200 or not streamed):
            # A continuation the engine refused: the client's stream is open, no status line to give.
            await drain_body(resp)
            return self._broken(None, f"status {st}", pod, req, tried, headers, hopeless=st < 500)
        if streamed:
            if req.stream is not None:
                return await self._relay(resp, start, pod, req, tried, headers)
            return await self._stream(send, resp, start, pod, req.rid, tried, headers)
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if req.resumable and not self.drain.cutting:
                return self._broken(uf.BODY, exc, pod, req, tried, headers)
            return await self.upstream_failed(send, uf.BODY, exc, pod, req.rid, tried, headers)
        await send(start)
        await send({"type": "http.response.body", "body": data})
        return Outcome(st, pod, usage_of(data, False) if st == 200 else None, tried)

    async def upstream_failed(
        self,
        send,
        failure: uf.UpstreamFailure,
        exc: BaseException,
        pod: str,
        rid: str,
        tried: int,
        headers: list,
    ) -> Outcome:
        """Answer an engine's failure before anything reached the client (see router/upstream_failure.py)."""
        if failure.shutdown_first and self.drain.cutting:  # our own drain timed out, not the engine
            await refuse_shutdown(send, headers)
            return Outcome(503, pod, None, tried, "router_shutdown")
        self.metrics.upstream_failures.labels(failure.stage).inc()
        uf.log_failure(failure, pod, exc, rid)
        return await self._answer_failure(send, failure, pod, tried, headers)

    async def _answer_failure(
        self, send, failure: uf.UpstreamFailure, pod: str, tried: int, headers: list
    ) -> Outcome:
        await send_error(
            send, failure.status, failure.message, failure.etype, headers, code=failure.code
        )
        return Outcome(failure.status, pod, None, tried, failure.error)

    def _broken(
        self,
        failure: uf.UpstreamFailure | None,
        exc,
        pod: str,
        req: ProxyRequest,
        tried: int,
        headers: list,
        hopeless: bool = False,
    ) -> Outcome:
        """An engine's failure after sending, counted and logged, left unanswered for the caller."""
        broken = Broken(failure, exc, pod, headers, req.rid, hopeless)
        self.metrics.upstream_failures.labels(broken.phase).inc()
        if failure is not None:
            uf.log_failure(failure, pod, exc, req.rid)
        else:
            log.warning(
                "%s failed mid-stream: %s",
                redact_url(pod),
                exc or type(exc).__name__,
                extra={"fields": {"request_id": req.rid}},
            )
        return Outcome(502, pod, None, tried, broken.phase, broken)

    async def answer_broken(self, send, out: Outcome, stream: ClientStream | None) -> Outcome:
        """The client gets the failure no replica went on with, as if it had not been resumed: the
        answer to the failure (nothing was sent yet), or its stream ends with an error event and [DONE]."""
        b = out.broken
        if stream is None or not stream.started:
            if b.failure.shutdown_first and self.drain.cutting:
                await refuse_shutdown(send, b.headers)
                return Outcome(503, b.pod, None, out.attempts, "router_shutdown")
            return await self._answer_failure(send, b.failure, b.pod, out.attempts, b.headers)
        await stream.fail(MID_STREAM_EVENT)
        return Outcome(200, b.pod, None, out.attempts, "mid_stream")

    async def _relay(
        self, resp, start, pod: str, req: ProxyRequest, tried: int, headers: list
    ) -> Outcome:
        """A resumable stream, event by event through its ClientStream. The status line waits for
        the first event; the engine's failure before or after it comes back unanswered (Broken),
        except during the router's own cut (then the client's answer is given here)."""
        stream = req.stream
        it = resp.content.iter_any()
        try:
            chunk = await it.__anext__()
        except StopAsyncIteration:
            chunk = b""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if stream.started:
                return await self._stream_cut(stream, pod, req, tried, headers, exc)
            if self.drain.cutting:
                return await self.upstream_failed(
                    stream.send, uf.FIRST_EVENT, exc, pod, req.rid, tried, headers
                )
            return self._broken(uf.FIRST_EVENT, exc, pod, req, tried, headers)
        await stream.start(start)
        while chunk:
            failed = await stream.feed(chunk)
            if failed:  # the engine's own error event, or its drain aborted the generation
                return self._broken(None, failed, pod, req, tried, headers)
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return await self._stream_cut(stream, pod, req, tried, headers, exc)
        if (
            not stream.done and stream.engine_sends_ids and not stream.finished
        ):  # ended short of its end
            return self._broken(None, "the stream ended before [DONE]", pod, req, tried, headers)
        await stream.end()
        status = start["status"]
        return Outcome(status, pod, stream.usage if status == 200 else None, tried)

    async def _stream_cut(
        self,
        stream: ClientStream,
        pod: str,
        req: ProxyRequest,
        tried: int,
        headers: list,
        exc: BaseException,
    ) -> Outcome:
        """A resumable stream broke after it started: Broken, or our own drain's error event."""
        if not self.drain.cutting:
            return self._broken(None, exc, pod, req, tried, headers)
        error, event = self._mid_stream_error(pod, req.rid, exc)
        await stream.fail(event)
        return Outcome(200, pod, None, tried, error)

    async def _stream(self, send, resp, start, pod, rid, tried, err_headers) -> Outcome:
        """Pass an SSE stream through. The status line waits for the first event, so an engine
        that dies before it gives a clean 502; one that dies later ends the stream with an error
        event and [DONE] (the client never sees a silently truncated stream)."""
        it = resp.content.iter_any()
        keep = b""
        error = None
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return await self.upstream_failed(
                send, uf.FIRST_EVENT, exc, pod, rid, tried, err_headers
            )
        await send(start)
        chunk = first
        while chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            keep = (keep + chunk)[-8192:]
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                error, event = self._mid_stream_error(pod, rid, exc)
                lead = b"" if not keep or keep.endswith(b"\n\n") else b"\n\n"
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": lead
                        + b"data: "
                        + json.dumps(event).encode()
                        + b"\n\ndata: [DONE]\n\n",
                    }
                )
                break
        await send({"type": "http.response.body", "body": b""})
        usage = usage_of(keep, True) if start["status"] == 200 and error is None else None
        return Outcome(start["status"], pod, usage, tried, error)

    def _mid_stream_error(self, pod: str, rid: str, exc: BaseException) -> tuple[str, dict]:
        """The Outcome's error and the error event a stream that broke after its first event ends with."""
        if self.drain.cutting:  # our own drain timed out, not the engine
            return "router_shutdown", {
                "error": {
                    "message": SHUTDOWN_MSG,
                    "type": "service_unavailable",
                    "param": None,
                    "code": "router_shutdown",
                }
            }
        self.metrics.upstream_failures.labels("mid_stream").inc()
        log.warning(
            "%s failed mid-stream: %s",
            redact_url(pod),
            exc or type(exc).__name__,
            extra={"fields": {"request_id": rid}},
        )
        return "mid_stream", MID_STREAM_EVENT


# What a client's stream ends with when its engine failed and no replica went on with it.
MID_STREAM_EVENT = {
    "error": {
        "message": "the engine failed mid-stream; the response is incomplete",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_failed",
    }
}


async def drain_body(resp: aiohttp.ClientResponse) -> None:
    """Read a refusal's body before the next try (so its connection can be reused); a body that
    fails to arrive does not matter: the next pod is tried all the same."""
    try:
        await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass


def retry_after(resp, lo: float, hi: float) -> float:
    try:
        v = float(resp.headers.get("Retry-After", lo))
    except ValueError:
        v = lo
    return min(max(v, lo), hi) if math.isfinite(v) else lo


def usage_of(data: bytes, stream: bool) -> dict | None:
    """The usage object of a body, or of the last event of a stream's tail that has one."""
    try:
        if not stream:
            return json.loads(data).get("usage")
        at = data.rfind(b'"usage"')
        if at < 0:
            return None
        start = data.rfind(b"data: ", 0, at)
        end = data.find(b"\n", at)
        return json.loads(data[start + 6 : end if end >= 0 else None]).get("usage")
    except Exception:  # noqa: BLE001
        return None
