"""The sidecar: the events loop, the index writer, the heartbeat and the health server, composed.

One engine's KV-cache events and load -> Redis (DESIGN.md contract 3). Each piece is a module of
its own (docs/sidecar.md has the table); this one builds them around one counter set, starts
them, and stops them: a clean stop deletes the pod's keys.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis
from prometheus_client import generate_latest

from kvmesh.sidecar.config import SidecarConfig
from kvmesh.sidecar.health import HealthServer, metrics_registry
from kvmesh.sidecar.heartbeat import Heartbeat
from kvmesh.sidecar.index_writer import IndexWriter
from kvmesh.sidecar.subscriber import EventsLoop

log = logging.getLogger("kvmesh.sidecar")


class Sidecar:
    def __init__(self, cfg: SidecarConfig):
        self.cfg = cfg
        self.stats: Counter = Counter()  # every piece's counters (the /metrics SERVICE_COUNTERS)
        self.writer = IndexWriter(cfg, self.stats)
        self.events = EventsLoop(cfg, self.writer, self.stats)
        self.heartbeat = Heartbeat(cfg, self.writer, self.events, self.stats)
        self.health_server: HealthServer | None = None
        self.health_port: int | None = None

    def start(self) -> Sidecar:
        self.events.start()
        self.heartbeat.start()
        if self.cfg.health_port is not None:
            self.health_server = HealthServer(
                self, self.cfg.health_host, self.cfg.health_port
            ).start()
            self.health_port = self.health_server.port
            log.info(
                "health on %s:%d (/health, /ready, /metrics)",
                self.cfg.health_host,
                self.health_port,
            )
        return self

    def stop(self, clean: bool = True) -> None:
        """Stop; with `clean`, delete this pod's heartbeat, block and host sets and membership from Redis."""
        self.heartbeat.stop()  # first: a heartbeat must not see the events loop stopping as dead
        self.events.stop()
        if self.health_server is not None:
            self.health_server.stop()
        if clean:
            try:
                pipe = self.writer.redis.pipeline(transaction=True)
                self.writer.delete_pod_keys(pipe)
                pipe.delete(self.heartbeat.hb_key)
                pipe.srem(self.heartbeat.pods_key, self.cfg.pod_name)
                pipe.execute()
                log.info("removed %s from Redis", self.cfg.pod_name)
            except redis.RedisError as exc:
                log.warning("could not remove this pod's keys from Redis: %s", exc)
        self.events.close()
        self.writer.close()
        self.heartbeat.close()

    def mark_draining(self) -> None:
        """This sidecar is shutting down: every heartbeat from now on says `draining`."""
        self.heartbeat.mark_draining()

    @property
    def indexed_seq(self) -> int | None:
        """Every KV event before this sequence number is in Redis (None while the set is dirty)."""
        return self.writer.indexed_seq

    def metrics_text(self) -> str:
        """The /metrics exposition (Prometheus text), also without a health server."""
        return generate_latest(metrics_registry(self)).decode()
