"""When the replicas are saturated: from the heartbeats discovery already reads (KV usage, waiting) and this router's own in-flight counts.

A replica is saturated when its KV cache is at or above the threshold, when its engine queues
`queue_threshold` requests or more, or (with `pod_max_inflight`) when this router has that
many requests on it (the one signal for a replica without a heartbeat). Between two heartbeats
the router's own count also says what was sent since: requests in flight beyond what the last
heartbeat counted are taken as waiting. A replica's *headroom* is how many more requests it
takes before it is saturated; the replicas are all saturated when their headroom together is
no more than the requests let through and not yet on an engine's socket (`launching`), so a
burst is not let through many times over on one look. No replica: the scale-from-zero hold
queue's business, not this one's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from kvmesh.router.discovery import Pod
from kvmesh.router.flow.settings import FlowSettings


def headroom(pod: Pod, inflight: int, s: FlowSettings) -> float:
    """Requests the replica takes before it is saturated (0: saturated; inf: no bound known)."""
    room = math.inf
    if s.pod_max_inflight:
        room = max(0, s.pod_max_inflight - inflight)
    if pod.ts:  # a heartbeat (static backends without Redis have none)
        if pod.kv_usage >= s.kv_threshold:
            return 0
        waiting = pod.waiting + max(0, inflight - pod.running - pod.waiting)
        room = min(room, max(0, s.queue_threshold - waiting))
    return room


def pod_saturated(pod: Pod, inflight: int, s: FlowSettings) -> bool:
    return headroom(pod, inflight, s) <= 0


def all_saturated(
    pods: Iterable[Pod], inflight: Mapping[str, int], s: FlowSettings, launching: int = 0
) -> bool:
    pods = list(pods)
    if not pods:
        return False
    return sum(headroom(p, inflight.get(p.name, 0), s) for p in pods) <= launching
