"""Probe a server's cheap GET routes while heavy requests run: the latencies say whether its event
loop stalled (tests/engine/server/test_loop_stays_free.py, tests/router/test_loop_stays_free.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx

MB4 = 4_000_000
# p99 of the probes: a few ms idle, seconds with a 4 MB prompt's work on the loop. A busy CI
# machine (shared cores) stretches the first, never to a stall of this size.
P99_LIMIT_S = 0.4


def big_bodies() -> list[tuple[str, bytes]]:
    """Four ~4 MB requests: a text completion, a chat, a token-id list, a /tokenize."""
    text = ("The quick brown fox jumps over the lazy dog. " * (MB4 // 45 + 1))[:MB4]
    return [
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}).encode()),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode(),
        ),
        ("/v1/completions", json.dumps({"prompt": [5] * (MB4 // 3), "max_tokens": 1}).encode()),
        ("/tokenize", json.dumps({"prompt": text}).encode()),
    ]


def probe_during(
    url: str, probes: tuple[str, ...], bodies: list[tuple[str, bytes]]
) -> tuple[list[float], list[str], list[tuple[str, int, str]]]:
    """Send ``bodies`` at once while GETting ``probes`` in turn (10 ms apart). Returns the probe
    latencies (sorted), the probes that did not answer 200, and (path, status, text) per body."""
    latencies: list[float] = []
    failures: list[str] = []
    answers: list[tuple[str, int, str]] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            i = 0
            while not done.is_set():
                path = probes[i % len(probes)]
                t = time.perf_counter()
                r = c.get(path)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    failures.append(f"{path}: {r.status_code}")
                i += 1
                time.sleep(0.01)

    def send(path: str, body: bytes) -> None:
        r = httpx.post(
            url + path, content=body, headers={"content-type": "application/json"}, timeout=300
        )
        answers.append((path, r.status_code, r.text[:200]))

    prober = threading.Thread(target=probe)
    prober.start()
    senders = [threading.Thread(target=send, args=pb) for pb in bodies]
    try:
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    finally:
        done.set()
        prober.join()
    return sorted(latencies), failures, answers


def check_latencies(latencies: list[float]) -> None:
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"probes {len(latencies)}: p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    assert p99 < P99_LIMIT_S, (
        f"p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms over {len(latencies)} probes"
    )
    # probed throughout: the load lasts ~0.5-1 s here, each probe ~17 ms (10 ms apart); a faster
    # server shortens the window, so the floor is what shows probes ran while the load did
    assert len(latencies) >= 20, latencies
