"""The sidecar's probes and metrics: /health, /ready and /metrics (Prometheus text) from one small HTTP thread.

Liveness fails while the events loop is dead or stale (or the heartbeat loop is dead);
readiness also waits for the first catch-up. Neither depends on Redis or on the engine (the
engine's own probes take it out of service), but both bodies say why the engine
(``engine_problem``) or its KV events (``events_problem``: the replay socket) cannot be read. The
metrics are read from the sidecar at scrape time by a `prometheus_client` collector (the
figures live in the subscriber's and the sidecar's counters; nothing is copied between scrapes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

if TYPE_CHECKING:
    from kvmesh.sidecar.service import Sidecar

log = logging.getLogger("kvmesh.sidecar")

# kvmesh_sidecar_kv_event_<key>_total, from the subscriber's counters.
SUBSCRIBER_COUNTERS = (
    ("batches", "KV-event batches applied"),
    ("decode_errors", "undecodable KV-event batches or malformed messages"),
    ("lost_batches", "batches undecodable in the replay buffer too (the index was reset)"),
    (
        "gaps",
        "sequence gaps detected (live or in a replay answer), each healed by a replay unless counted as a "
        "snapshot or a gap reset",
    ),
    ("gap_batches", "batches found missing in sequence gaps"),
    ("snapshots", "gaps healed from the engine's block-set snapshot"),
    (
        "gap_resets",
        "gaps nothing could fill: the index was reset (a subset until the next full resync)",
    ),
    ("replay_failures", "full resyncs that failed because the replay socket did not answer"),
    ("replays", "replay requests sent"),
    ("resets", "index resets by the subscriber"),
)
# kvmesh_sidecar_<key>_total, from the service's own counters.
SERVICE_COUNTERS = (
    ("events_loop_errors", "events-loop iterations that failed (each followed by a resync)"),
    ("redis_errors", "Redis operations that failed"),
    ("full_rewrites", "block set rewrites"),
    ("heartbeats", "heartbeats written"),
    ("engine_restarts", "engine restarts detected (each followed by a full resync)"),
    ("index_withdrawals", "block set withdrawn because the events loop was dead or stale"),
    (
        "block_set_repairs",
        "block set found different from the index in Redis (lost by Redis) and rewritten",
    ),
    ("events_unknown_medium", "KV events naming a medium no tier has (ignored)"),
)


class SidecarCollector:
    """The sidecar's figures as Prometheus metrics, read at each scrape."""

    def __init__(self, sidecar: Sidecar):
        self.sidecar = sidecar

    def collect(self) -> Iterator[Metric]:
        sc = self.sidecar
        sub = sc.events.subscriber.stats if sc.events.subscriber else {}
        for key, help_ in SUBSCRIBER_COUNTERS:
            yield CounterMetricFamily(
                f"kvmesh_sidecar_kv_event_{key}_total", help_, value=sub.get(key, 0)
            )
        for key, help_ in SERVICE_COUNTERS:
            yield CounterMetricFamily(
                f"kvmesh_sidecar_{key}_total", help_, value=sc.stats.get(key, 0)
            )
        last = sc.events.last_ok
        yield GaugeMetricFamily(
            "kvmesh_sidecar_block_keys", "block keys in the index", value=len(sc.writer.index.refs)
        )
        yield GaugeMetricFamily(
            "kvmesh_sidecar_events_ok",
            "1 if the events loop is alive and current",
            value=int(sc.events.problem() is None),
        )
        yield GaugeMetricFamily(
            "kvmesh_sidecar_events_loop_age_seconds",
            "seconds since the last completed events iteration",
            value=-1 if last is None else round(time.monotonic() - last, 3),
        )


def liveness(sidecar: Sidecar) -> tuple[bool, dict[str, Any]]:
    """/health: the events loop is alive and current, and the heartbeat loop alive."""
    problem = sidecar.events.problem() or sidecar.heartbeat.problem()
    return problem is None, detail(sidecar, problem)


def readiness(sidecar: Sidecar) -> tuple[bool, dict[str, Any]]:
    """/ready: as /health, and the first catch-up (a replay from 0) has run."""
    ok, body = liveness(sidecar)
    if ok and not sidecar.events.caught_up:
        ok, body["problem"] = False, "catching up with the engine's KV events"
    return ok, body


def detail(sidecar: Sidecar, problem: str | None) -> dict[str, Any]:
    """The probes' JSON body: why (``problem``), and the figures that explain it."""
    sub, writer = sidecar.events.subscriber, sidecar.writer
    last = sidecar.events.last_ok
    return {
        "status": "ok" if problem is None else "unhealthy",
        "problem": problem,
        "pod": sidecar.cfg.pod_name,
        "events_loop_age_s": None if last is None else round(time.monotonic() - last, 3),
        "block_keys": len(writer.index.refs),
        "index_withdrawn": writer.withdrawn,
        "redis_dirty": writer.dirty,
        "indexed_seq": writer.indexed_seq,
        "engine_state": sidecar.heartbeat.state,
        "engine_problem": sidecar.heartbeat.engine_problem,
        "events_problem": sub.replay_problem if sub else None,
        "last_decode_error": sub.last_decode_error if sub else None,
        "last_events_error": sidecar.events.error,
        "stats": {**(sub.stats if sub else {}), **sidecar.stats},
    }


def metrics_registry(sidecar: Sidecar) -> CollectorRegistry:
    """A registry of the sidecar's metrics alone (not the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(sidecar))
    return registry


class HealthServer:
    """/health (liveness), /ready (readiness) and /metrics for one sidecar, on a thread of its own."""

    def __init__(self, sidecar: Sidecar, host: str, port: int):
        self.sidecar = sidecar
        self.registry = metrics_registry(sidecar)
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]

    def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()

    def start(self) -> HealthServer:
        threading.Thread(
            target=self.server.serve_forever, name="sidecar-health", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sidecar, health = self.sidecar, self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's API
                path = self.path.split("?", 1)[0]
                if path in ("/health", "/healthz", "/livez"):
                    ok, body = liveness(sidecar)
                    return self._send(
                        200 if ok else 503, json.dumps(body).encode(), "application/json"
                    )
                if path in ("/ready", "/readyz"):
                    ok, body = readiness(sidecar)
                    return self._send(
                        200 if ok else 503, json.dumps(body).encode(), "application/json"
                    )
                if path == "/metrics":
                    return self._send(200, health.metrics_text().encode(), CONTENT_TYPE_PLAIN_0_0_4)
                self._send(404, b'{"error": "not found"}', "application/json")

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # probes every few seconds: no access log
                pass

        return Handler
