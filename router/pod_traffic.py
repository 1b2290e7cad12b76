"""What this router learns of each pod from its own traffic: requests in flight, "full" (429) until when, and the circuit breaker."""

from __future__ import annotations

import logging
import time

from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router")


class Breaker:
    """Per-pod circuit breaker: `eject_after` consecutive failures eject a pod for `eject_seconds`;
    after that it is tried again (one failure re-ejects it, one success closes the breaker)."""

    def __init__(self, eject_after: int, eject_seconds: float, metrics: RouterMetrics):
        self.eject_after = eject_after
        self.eject_seconds = eject_seconds
        self.metrics = metrics
        self.failures: dict[str, int] = {}
        self.until: dict[str, float] = {}

    def ejected(self, name: str, now: float) -> bool:
        return self.until.get(name, 0.0) > now

    def failure(self, name: str) -> None:
        n = self.failures.get(name, 0) + 1
        self.failures[name] = n
        now = time.monotonic()
        if n >= self.eject_after and not self.ejected(name, now):
            self.until[name] = now + self.eject_seconds
            self.metrics.ejections.labels(name).inc()
            log.warning(
                "ejecting pod %s for %.0fs after %d consecutive failures",
                name,
                self.eject_seconds,
                n,
            )

    def success(self, name: str) -> None:
        if self.failures.get(name):
            self.failures[name] = 0
            self.until.pop(name, None)


class PodTraffic:
    def __init__(self, breaker: Breaker):
        self.breaker = breaker
        self.inflight: dict[str, int] = {}
        self.full_until: dict[str, float] = {}  # pods that answered 429, until when

    def full(self, name: str, now: float) -> bool:
        return self.full_until.get(name, 0.0) > now
