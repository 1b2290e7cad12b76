"""Discovery's own metrics, and the heartbeats its sweep of the pods set ignored (counted and logged)."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from kvmesh.router.metrics import RouterMetrics

log = logging.getLogger("kvmesh.router.discovery")

IGNORE_REASONS = ("unknown_pod", "url_mismatch", "duplicate_url")
IGNORED_TRACKED = (
    10_000  # ignored heartbeats remembered (for the counter and /ready); more are only counted
)
IGNORED_LOGGED = 20  # new ignored heartbeats logged one by one per pass over the pods set


class DiscoveryMetrics:
    """Discovery's own series, registered on the router's registry."""

    def __init__(self, metrics: RouterMetrics):
        r = metrics.registry
        self.ignored = Counter(
            "kvmesh_router_ignored_heartbeats",
            "Heartbeats ignored because they name a pod or URL the platform does not know "
            "(counted once each time one appears)",
            ["reason"],
            registry=r,
        )
        self.ignored_now = Gauge(
            "kvmesh_router_ignored_heartbeats_current",
            "Heartbeats ignored now (the last pass over the pods set)",
            ["reason"],
            registry=r,
        )
        self.known = Gauge(
            "kvmesh_router_known_pods",
            "Pods known from the endpoint sources (platform)",
            registry=r,
        )
        self.fallback = Gauge(
            "kvmesh_router_discovery_fallback",
            "1 while routing to the platform's pods by load only because the Redis view expired",
            registry=r,
        )
        self.view_age = Gauge(
            "kvmesh_router_redis_view_age_seconds",
            "Seconds since heartbeats were last read from Redis (-1: never)",
            registry=r,
        )
        self.orphans = Counter(
            "kvmesh_router_orphans_removed",
            "Pod names without a heartbeat removed from the pods set (with their block sets)",
            registry=r,
        )
        self.sweep_passes = Counter(
            "kvmesh_router_pods_set_passes",
            "Full passes over the pods set (one page per refresh)",
            registry=r,
        )
        for reason in IGNORE_REASONS:
            self.ignored.labels(reason)
            self.ignored_now.labels(reason).set(0)
        self.view_age.set(-1)


def discovery_metrics(metrics: RouterMetrics) -> DiscoveryMetrics:
    dm = getattr(metrics, "_discovery", None)
    if dm is None:
        dm = metrics._discovery = DiscoveryMetrics(metrics)
    return dm


class SweptIgnored:
    """Heartbeats the pods-set sweep ignored: those of the current pass and the last complete
    one, at most IGNORED_TRACKED remembered (and counted once each); how many the last complete
    pass saw, all of them; and a log line for at most IGNORED_LOGGED new ones per pass."""

    def __init__(self, dm: DiscoveryMetrics):
        self.dm = dm
        self.items: dict[tuple[str, str], str] = {}  # (pod, reason) -> the URL its heartbeat named
        self.by_reason = {reason: 0 for reason in IGNORE_REASONS}
        self.last_pass: dict[str, int] | None = (
            None  # reason -> heartbeats ignored in the last full pass
        )
        self._this_pass: set[tuple[str, str]] = set()
        self._counts = {reason: 0 for reason in IGNORE_REASONS}
        self._logged = 0
        self._not_logged = 0

    def current(self) -> dict[str, int]:
        """reason -> heartbeats ignored now: the last full pass, or what this first one has seen."""
        return self.last_pass if self.last_pass is not None else self.by_reason

    def add(self, key: tuple[str, str], url: str, where: str) -> None:
        self._counts[key[1]] += 1
        if key in self.items:
            self._this_pass.add(key)
            return
        if len(self.items) >= IGNORED_TRACKED:
            return
        self._this_pass.add(key)
        self.items[key] = url
        self.by_reason[key[1]] += 1
        self.dm.ignored.labels(key[1]).inc()
        if self._logged >= IGNORED_LOGGED:
            self._not_logged += 1
            return
        self._logged += 1
        log.warning(
            "ignoring the heartbeat of pod %r (%s): it names %r, which is not a pod this router "
            "knows from %s",
            key[0][:100],
            key[1],
            url[:200],
            where,
        )

    def end_pass(self) -> None:
        """Forget what this pass did not see again (the heartbeat is gone, or the pod is known now)."""
        for key in [k for k in self.items if k not in self._this_pass]:
            del self.items[key]
            self.by_reason[key[1]] -= 1
        if self._not_logged:
            log.warning(
                "ignoring %d more heartbeats of pods this router does not know (not logged one by one)",
                self._not_logged,
            )
        self.last_pass = self._counts
        self._this_pass, self._logged, self._not_logged = set(), 0, 0
        self._counts = {reason: 0 for reason in IGNORE_REASONS}
