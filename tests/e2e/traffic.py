"""Streaming chat traffic through the router, every request recorded: which pod served it (the
router's ``x-kvmesh-pod`` header), when it started and ended, and how it ended.

A stream ends one of three ways: ``ok`` (a finish_reason and ``[DONE]``), ``error`` (an HTTP
error status, an error event in the stream, or a broken connection: the client is told) or
``truncated`` (the stream just stopped: the client is not told, which is always a bug).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

OK, ERROR, TRUNCATED = "ok", "error", "truncated"


@dataclass
class Stream:
    id: int
    started: float
    ended: float = 0.0
    pod: str | None = None
    status: int | None = None
    outcome: str = ""
    detail: str = ""
    tokens: int = 0
    cached_tokens: int = 0

    def in_flight_at(self, t: float) -> bool:
        return self.started <= t <= (self.ended or float("inf"))

    def __str__(self) -> str:
        return (
            f"#{self.id} {self.outcome} pod={self.pod} status={self.status} tokens={self.tokens} "
            f"{self.started:.2f}..{self.ended:.2f} {self.detail[:200]}"
        )


def stream_chat(
    client: httpx.Client,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    stream_id: int = 0,
    on_routed: Callable[[Stream], None] | None = None,
) -> Stream:
    """One streamed chat completion, recorded; ``on_routed`` sees it once the router has answered
    (its pod known), long before a long stream ends."""
    rec = Stream(id=stream_id, started=time.time())
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    finished = done = False
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            rec.status, rec.pod = resp.status_code, resp.headers.get("x-kvmesh-pod")
            if on_routed is not None:
                on_routed(rec)
            if resp.status_code != 200:
                rec.outcome, rec.detail = ERROR, resp.read().decode(errors="replace")
                return rec
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    rec.outcome, rec.detail = ERROR, json.dumps(event["error"])
                    continue
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        rec.tokens += 1
                    finished = finished or bool(choice.get("finish_reason"))
                usage = event.get("usage") or {}
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or rec.cached_tokens
    except httpx.HTTPError as exc:
        rec.outcome, rec.detail = ERROR, f"{type(exc).__name__}: {exc}"
    finally:
        rec.ended = time.time()
    if not rec.outcome:
        rec.outcome = OK if finished and done else TRUNCATED
        if rec.outcome == TRUNCATED:
            rec.detail = f"finish_reason seen: {finished}, [DONE] seen: {done}"
    return rec


def prompt(n: int, words: int = 60) -> list[dict]:
    """A distinct conversation per n (no shared prefix beyond the chat template)."""
    return [
        {"role": "user", "content": f"Request {n}. " + " ".join(f"w{n}x{i}" for i in range(words))}
    ]


@dataclass
class Traffic:
    """``concurrency`` workers sending streamed requests back to back until stopped."""

    url: str
    model: str
    concurrency: int = 2
    max_tokens: int = 48
    messages: Callable[[int], list[dict]] = prompt
    pause: float = 0.05
    streams: list[Stream] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._in_flight: dict[int, Stream] = {}

    def __enter__(self) -> Traffic:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, name=f"traffic-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _worker(self) -> None:
        # Generous read timeout: a held request waits for a pod to become ready.
        with httpx.Client(timeout=httpx.Timeout(10.0, read=180.0), trust_env=False) as client:
            while not self._stop.is_set():
                n = next(self._ids)
                rec = stream_chat(
                    client,
                    self.url,
                    self.model,
                    self.messages(n),
                    self.max_tokens,
                    n,
                    on_routed=self._routed,
                )
                with self._lock:
                    self._in_flight.pop(rec.id, None)
                    self.streams.append(rec)
                time.sleep(self.pause)

    def stop_sending(self) -> None:
        """No new request from now on; the ones in flight go on."""
        self._stop.set()

    def stop(self, timeout: float = 240.0) -> list[Stream]:
        """Stop sending; wait for the streams in flight to end."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a stream did not end"
        self._threads.clear()
        return self.finished()

    def finished(self) -> list[Stream]:
        with self._lock:
            return list(self.streams)

    def _routed(self, rec: Stream) -> None:
        with self._lock:
            self._in_flight[rec.id] = rec

    def streaming_on(self, pod: str, since: float = 0.0) -> int:
        """Streams the router sent to ``pod`` (answered 200) since ``since``, ended or not: the pod
        takes traffic before its first long stream ends."""
        with self._lock:
            every = self.streams + list(self._in_flight.values())
        return sum(1 for s in every if s.pod == pod and s.status == 200 and s.started >= since)

    def mid_stream_on(self, pod: str, most_tokens: int) -> list[Stream]:
        """Streams on ``pod`` that have received tokens, at most ``most_tokens``, and not ended: the
        rest of each is still to come."""
        with self._lock:
            running = list(self._in_flight.values())
        return [
            s
            for s in running
            if s.pod == pod and s.status == 200 and 0 < s.tokens <= most_tokens and not s.ended
        ]

    def count_ok_on(self, pod: str, since: float = 0.0) -> int:
        return sum(
            1 for s in self.finished() if s.pod == pod and s.outcome == OK and s.started >= since
        )


def failures(streams: list[Stream]) -> list[Stream]:
    return [s for s in streams if s.outcome != OK]


def summary(streams: list[Stream]) -> str:
    return f"{len(streams)} sent, {len(failures(streams))} failed"
