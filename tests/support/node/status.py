"""Pod status as the kubelet reports it: phase, conditions, container statuses."""

from __future__ import annotations

import datetime as dt
from typing import Any

OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def phase(
    restart_policy: str, init_failed: bool, initialized: bool, statuses: list[dict[str, Any]]
) -> str:
    """kubelet's getPhase over the main containers' statuses."""
    if init_failed:
        return "Failed"
    if not initialized:
        return "Pending"
    running = waiting = succeeded = failed = 0
    for s in statuses:
        state = s["state"]
        if "running" in state:
            running += 1
        elif "terminated" in state:
            if state["terminated"]["exitCode"] == 0:
                succeeded += 1
            else:
                failed += 1
        elif s.get("lastState", {}).get("terminated"):
            # waiting to restart after a run: counts as the run it last had
            running += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if restart_policy == "Always":
        return "Running"
    if restart_policy == "OnFailure" and failed:
        return "Running"
    return "Failed" if failed else "Succeeded"


class Conditions:
    """The pod conditions the node owns, with their transition times."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[str, str]] = {}

    def set(self, kind: str, value: bool, reason: str = "") -> None:
        status = "True" if value else "False"
        old = self.values.get(kind)
        if old is None or old[0] != status:
            self.values[kind] = (status, now())
        self.reasons = getattr(self, "reasons", {})
        self.reasons[kind] = reason

    def merged(self, existing: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [c for c in existing if c["type"] not in self.values]
        for kind in OWNED_CONDITIONS:
            if kind in self.values:
                status, since = self.values[kind]
                cond = {
                    "type": kind,
                    "status": status,
                    "lastProbeTime": None,
                    "lastTransitionTime": since,
                }
                if status == "False" and self.reasons.get(kind):
                    cond["reason"] = self.reasons[kind]
                out.append(cond)
        return out
