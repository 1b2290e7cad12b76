"""Engine pods in every state a kubelet reports, as the API returns them; shared by the emulator
and the real-API-server tests of how the operator counts them."""

from __future__ import annotations

from typing import Any


def _cond(ctype: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
    c = {"type": ctype, "status": "True" if ok else "False"}
    if reason:
        c["reason"] = reason
    return c


def _waiting(reason: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "engine",
            "ready": False,
            "restartCount": 0,
            "state": {"waiting": {"reason": reason}},
        }
    ]


def _running(ready: bool) -> list[dict[str, Any]]:
    return [
        {
            "name": "engine",
            "ready": ready,
            "restartCount": 0,
            "started": True,
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
        }
    ]


def _terminated(code: int, reason: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "engine",
            "ready": False,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": reason}},
        }
    ]


# name suffix -> (status, terminating): what a kubelet (or the node controller) writes.
PHASES: dict[str, tuple[dict[str, Any], bool]] = {
    "pending-unscheduled": (
        {"phase": "Pending", "conditions": [_cond("PodScheduled", False, "Unschedulable")]},
        False,
    ),
    "pending-waiting": (
        {
            "phase": "Pending",
            "conditions": [
                _cond("PodScheduled", True),
                _cond("Initialized", True),
                _cond("ContainersReady", False, "ContainersNotReady"),
                _cond("Ready", False, "ContainersNotReady"),
            ],
            "containerStatuses": _waiting("ContainerCreating"),
        },
        False,
    ),
    "running-not-ready": (
        {
            "phase": "Running",
            "conditions": [
                _cond("PodScheduled", True),
                _cond("Initialized", True),
                _cond("ContainersReady", False, "ContainersNotReady"),
                _cond("Ready", False, "ContainersNotReady"),
            ],
            "containerStatuses": _running(False),
        },
        False,
    ),
    "running-ready": (
        {
            "phase": "Running",
            "conditions": [
                _cond("PodScheduled", True),
                _cond("Initialized", True),
                _cond("ContainersReady", True),
                _cond("Ready", True),
            ],
            "containerStatuses": _running(True),
        },
        False,
    ),
    # Deleted, still running out its grace period (and still Ready until the kubelet says not).
    "terminating": (
        {
            "phase": "Running",
            "conditions": [
                _cond("PodScheduled", True),
                _cond("Initialized", True),
                _cond("ContainersReady", True),
                _cond("Ready", True),
            ],
            "containerStatuses": _running(True),
        },
        True,
    ),
    # A finished pod keeps a stale Ready=True only if nobody updated it: count it out either way.
    "succeeded": (
        {
            "phase": "Succeeded",
            "conditions": [_cond("PodScheduled", True), _cond("Ready", True)],
            "containerStatuses": _terminated(0, "Completed"),
        },
        False,
    ),
    "failed": (
        {
            "phase": "Failed",
            "conditions": [_cond("PodScheduled", True), _cond("Ready", True)],
            "containerStatuses": _terminated(137, "Error"),
        },
        False,
    ),
    # The node stopped reporting: the node controller marks its pods not Ready.
    "unknown": (
        {
            "phase": "Unknown",
            "conditions": [_cond("PodScheduled", True), _cond("Ready", False, "NodeLost")],
        },
        False,
    ),
}

# How the operator's autoscaling loop sees them: live engine pods and their readiness.
LISTED = {
    "pending-unscheduled": False,
    "pending-waiting": False,
    "running-not-ready": False,
    "running-ready": True,
    "unknown": False,
}
LEFT_OUT = ("terminating", "succeeded", "failed")
