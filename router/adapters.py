"""A LoRA adapter request among the replicas: which may serve it, under which model identity each
holds its blocks, how well placed each is for it (lora affinity), and its metrics label.

A request names an adapter by its ``model`` (any name but the served model's). Replicas list the
adapters they serve in their heartbeats (name -> digest). One that does not list the adapter
would answer 404, so it is not chosen while a routable one lists it; an adapter no replica lists
goes to all of them by load (the engine answers 404 itself).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvmesh.router.discovery import Pod

# Lora affinity (the score's lora term): the adapter in the replica's running batch, else a free
# adapter slot in its batch (len(active) < max_loras) to join the next step, else nothing.
AFFINITY_ACTIVE = 1.0
AFFINITY_FREE_SLOT = 0.5
OTHER_LABEL = "other"  # the metrics label of an adapter no replica lists


def serving(pods: list[Pod], adapter: str | None) -> list[Pod]:
    """The pods that list `adapter` (all of them for the base model, or when none does)."""
    if adapter is None:
        return pods
    return [p for p in pods if adapter in p.adapters] or pods


def affinity(pod: Pod, adapter: str | None) -> float:
    """How ready `pod` is to run `adapter` in its next step (0 for the base model)."""
    if adapter is None or adapter not in pod.adapters:
        return 0.0
    if adapter in pod.active_adapters:
        return AFFINITY_ACTIVE
    return AFFINITY_FREE_SLOT if len(pod.active_adapters) < pod.max_loras else 0.0


def usual_digest(pods: Iterable[Pod], adapter: str) -> str:
    """The digest most pods list for `adapter` (the smallest of equals; "" when none lists it)."""
    counts = Counter(p.adapters[adapter] for p in pods if adapter in p.adapters)
    if not counts:
        return ""
    return min(counts, key=lambda d: (-counts[d], d))


def label(pods: Iterable[Pod], adapter: str | None) -> str:
    """The metrics label: "" (base), the adapter when a pod lists it, else "other" (the label set
    stays bounded by what the replicas serve, whatever names clients send)."""
    if adapter is None:
        return ""
    return adapter if any(adapter in p.adapters for p in pods) else OTHER_LABEL


def listed(pods: Iterable[Pod], limit: int) -> list[str]:
    """The adapters the pods serve, sorted, at most `limit`."""
    names: set[str] = set()
    for p in pods:
        names.update(p.adapters)
    return sorted(names)[:limit]
