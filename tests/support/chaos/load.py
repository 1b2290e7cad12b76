"""The client load: requests through a mesh's router, each one's outcome classified (`Result`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvmesh_testing.chaos.lifecycle import LoopbackMesh
from kvmesh_testing.chaos.mesh import Engine

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education"
).split()


@dataclass(eq=False)
class Result:
    """One client request, classified by `kind`:

    * ``ok``: a 200 whose stream ended with a finish reason and ``data: [DONE]`` (or a complete
      JSON answer);
    * ``error_event``: a 200 stream that ended with the router's SSE error event and ``[DONE]``;
    * ``http``: any other status (``status``), e.g. the 502 before the first byte, a 429;
    * ``truncated``: a 200 whose body ended (or broke) without ``[DONE]``: never allowed;
    * ``reset``: the connection closed before any status line; ``refused``: no connection at all
      (nothing listening: the router is restarting);
    * ``hang``: no end within the request's deadline: never allowed.
    """

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
        return (
            f"{self.kind}(status={self.status}, pod={self.pod}, stream={self.stream}, tokens={self.tokens}, "
            f"{self.detail[:160]})"
        )


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    deadline: float,
    headers: dict[str, str] | None = None,
    expected_tokens: int | None = None,
    track: set | None = None,
) -> Result:
    """One request, classified; never raises, never waits longer than `deadline` seconds. While it
    runs, its Result is in `track` (its pod and tokens are filled in as they arrive)."""
    r = Result(time.monotonic(), bool(body.get("stream")), expected_tokens=expected_tokens)
    if track is not None:
        track.add(r)
    try:
        await asyncio.wait_for(_exchange(client, url, body, headers or {}, r), deadline)
    except TimeoutError:
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


async def _exchange(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], r: Result
) -> None:
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
                text = (
                    obj["choices"][0].get("text")
                    or (obj["choices"][0].get("message") or {}).get("content")
                    or ""
                )
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
            r.kind, r.detail = (
                "truncated",
                f"stream ended without {'[DONE]' if not done else 'a finish reason'}",
            )


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    """`workers` clients, each sending one request after another until stopped or until
    `max_requests` have been sent in all; every result is kept."""

    def __init__(
        self,
        mesh: LoopbackMesh,
        workers: int,
        *,
        stream_share: float = 0.75,
        chat_share: float = 0.3,
        deadline: float = 20.0,
        max_requests: int = 10_000,
        headers: dict[str, str] | None = None,
        backoff_429: float = 0.0,
        prompt_words: int = 40,
        seed: int = 0,
    ):
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
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(deadline, connect=2.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def start(self) -> Load:
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
                route, body["messages"] = (
                    "/v1/chat/completions",
                    [{"role": "user", "content": text}],
                )
            else:
                route, body["prompt"] = "/v1/completions", text
            r = await send_one(
                self._client,
                self.mesh.url + route,
                body,
                self.deadline,
                self.headers,
                expected_tokens=max_tokens,
                track=self.active,
            )
            self.results.append(r)
            if r.kind in ("refused", "reset"):
                await asyncio.sleep(0.2)  # nothing listening (the router restarts): do not spin
            elif r.status == 429 and self.backoff_429:
                await asyncio.sleep(self.backoff_429 * (0.5 + self.rng.random()))
