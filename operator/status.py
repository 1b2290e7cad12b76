"""Status of a ModelDeployment, derived from its children (pure functions)."""

from __future__ import annotations

import datetime
from typing import Any

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
CONFLICT = "ApplyConflict"  # a rendered field is owned by another manager (e.g. an HPA's replicas)


def now_iso(ts: float | None = None) -> str:
    dt = (
        datetime.datetime.now(tz=datetime.UTC)
        if ts is None
        else datetime.datetime.fromtimestamp(ts, datetime.UTC)
    )
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: list[dict[str, Any]] | None,
    now: str,
) -> dict[str, Any]:
    """A condition; lastTransitionTime moves only when the status flips."""
    status = "True" if ok else "False"
    last = now
    for c in previous or []:
        if c.get("type") == ctype and c.get("status") == status and c.get("lastTransitionTime"):
            last = c["lastTransitionTime"]
    out = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": last,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def deployment_summary(dep: dict[str, Any] | None) -> dict[str, Any]:
    """(desired, ready, updated, available, rolled-out, stuck) of a Deployment."""
    if dep is None:
        return {
            "exists": False,
            "desired": 0,
            "replicas": 0,
            "ready": 0,
            "available": False,
            "rolled_out": False,
            "stuck": False,
        }
    spec, st = dep.get("spec") or {}, dep.get("status") or {}
    desired = int(spec.get("replicas", 1))
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    observed = st.get("observedGeneration", 0) >= (dep.get("metadata") or {}).get("generation", 0)
    ready = int(st.get("readyReplicas", 0) or 0)
    available = conds.get("Available", {}).get("status") == "True" and (ready > 0 or desired == 0)
    rolled_out = observed and int(st.get("updatedReplicas", 0) or 0) >= desired and ready >= desired
    stuck = (
        conds.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
        or "ReplicaFailure" in conds
    )
    return {
        "exists": True,
        "desired": desired,
        "replicas": int(st.get("replicas", 0) or 0),
        "ready": ready,
        "available": available,
        "rolled_out": rolled_out,
        "stuck": stuck,
    }


def derive_conditions(
    *,
    generation: int | None,
    previous: list[dict[str, Any]] | None,
    now: str,
    engine: dict[str, Any],
    router: dict[str, Any] | None,
    redis: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """Ready / Progressing / Degraded from the children's summaries (router/redis None when not expected)."""
    parts = [("engine", engine)] + [
        (n, s) for n, s in (("router", router), ("redis", redis)) if s is not None
    ]
    missing = [n for n, s in parts if not s["exists"]]
    unavailable = [n for n, s in parts if s["exists"] and not s["available"]]
    rolling = [n for n, s in parts if s["exists"] and not s["rolled_out"]]
    stuck = [n for n, s in parts if s["stuck"]]
    if missing:
        ready = (False, "ChildrenMissing", f"not created yet: {', '.join(missing)}")
    elif unavailable:
        ready = (False, "NotAvailable", f"no ready replicas yet: {', '.join(unavailable)}")
    else:
        ready = (True, "Available", f"{engine['ready']}/{engine['desired']} engine replicas ready")
    progressing = (
        (True, "RollingOut", f"rolling out: {', '.join(rolling + missing)}")
        if rolling or missing
        else (False, "Complete", "all replicas are up to date and ready")
    )
    if stuck:
        degraded = (True, "RolloutStuck", f"rollout not progressing: {', '.join(stuck)}")
    elif not missing and not unavailable and engine["ready"] < engine["desired"]:
        degraded = (
            True,
            "BelowDesired",
            f"{engine['ready']}/{engine['desired']} engine replicas ready",
        )
    else:
        degraded = (False, "AsExpected", "")
    return [
        condition("Ready", *ready, generation, previous, now),
        condition("Progressing", *progressing, generation, previous, now),
        condition("Degraded", *degraded, generation, previous, now),
    ]


def invalid_conditions(
    errors: list[str],
    generation: int | None,
    previous: list[dict[str, Any]] | None,
    now: str,
    reason: str = "InvalidSpec",
) -> list[dict[str, Any]]:
    message = "; ".join(errors)
    return [
        condition("Ready", False, reason, message, generation, previous, now),
        condition(
            "Progressing",
            False,
            reason,
            "not reconciling until the spec is fixed",
            generation,
            previous,
            now,
        ),
        condition("Degraded", True, reason, message, generation, previous, now),
    ]
