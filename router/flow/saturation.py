"""When the replicas are saturated: from the heartbeats discovery already reads (KV usage, waiting) and this router's own in-flight counts.

A replica is saturated when its KV cache is at or above the threshold, when its engine queues
`queue_threshold` requests or more, or (with `pod_max_inflight`) when this router has that
many requests on it (the one signal for a replica without a heartbeat). Between two heartbeats the router's own count also says what was sent
since: requests in flight beyond what the last heartbeat counted are taken as waiting.
Requests wait at the router only while every routable replica is saturated (no replica:
the scale-from-zero hold queue's business, not this one's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvmesh.router.discovery import Pod
from kvmesh.router.flow.settings import FlowSettings


def pod_saturated(pod: Pod, inflight: int, s: FlowSettings) -> bool:
    if s.pod_max_inflight and inflight >= s.pod_max_inflight:
        return True
    if pod.kv_usage >= s.kv_threshold:
        return True
    if not pod.ts:  # no heartbeat (static backends without Redis): only the in-flight cap says
        return False
    waiting = pod.waiting + max(0, inflight - pod.running - pod.waiting)
    return waiting >= s.queue_threshold


def all_saturated(pods: Iterable[Pod], inflight: Mapping[str, int], s: FlowSettings) -> bool:
    pods = list(pods)
    return bool(pods) and all(pod_saturated(p, inflight.get(p.name, 0), s) for p in pods)
