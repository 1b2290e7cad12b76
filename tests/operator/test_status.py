"""A ModelDeployment's status from its children (operator/status.py, pure): the engine Deployment's
counts as the controller reports them for its pods, and the Ready / Progressing / Degraded
conditions they give. Exact values for each state a rollout goes through."""

from __future__ import annotations

import pytest

from kvmesh.operator import status as st

NOW, EARLIER = "2026-01-02T00:00:00Z", "2026-01-01T00:00:00Z"


def dep(
    desired=3, ready=None, updated=None, replicas=None, available=True, gen=2, observed=2, **conds
):
    """An engine Deployment as the controller reports it (``ready`` of ``desired`` pods Ready)."""
    ready = desired if ready is None else ready
    conditions = [{"type": "Available", "status": "True" if available else "False"}]
    conditions += [{"type": t, **c} for t, c in conds.items()]
    status = {
        "observedGeneration": observed,
        "replicas": desired if replicas is None else replicas,
        "updatedReplicas": desired if updated is None else updated,
        "conditions": conditions,
    }
    if ready:
        status["readyReplicas"] = ready  # the API server leaves zero counts out
    return {"metadata": {"generation": gen}, "spec": {"replicas": desired}, "status": status}


def summary(d):
    s = st.deployment_summary(d)
    return (s["desired"], s["replicas"], s["ready"], s["available"], s["rolled_out"], s["stuck"])


@pytest.mark.parametrize(
    "d, expected",
    [
        (dep(), (3, 3, 3, True, True, False)),
        (dep(ready=2), (3, 3, 2, True, False, False)),  # one pod not Ready
        (dep(ready=0, available=False), (3, 3, 0, False, False, False)),  # all pending
        (dep(ready=0, available=True), (3, 3, 0, False, False, False)),  # Available, none Ready
        (dep(replicas=4, updated=2), (3, 4, 3, True, False, False)),  # a surge mid-rollout
        (dep(observed=1), (3, 3, 3, True, False, False)),  # a spec change not seen yet
        (dep(desired=0, ready=0, available=True), (0, 0, 0, True, True, False)),
        (dep(desired=0, ready=0, available=False), (0, 0, 0, False, True, False)),
        (
            dep(ready=1, Progressing={"status": "False", "reason": "ProgressDeadlineExceeded"}),
            (3, 3, 1, True, False, True),
        ),
        (
            dep(ready=1, ReplicaFailure={"status": "True", "reason": "FailedCreate"}),
            (3, 3, 1, True, False, True),
        ),
        (
            dep(Progressing={"status": "True", "reason": "NewReplicaSetAvailable"}),
            (3, 3, 3, True, True, False),
        ),
        (None, (0, 0, 0, False, False, False)),
    ],
)
def test_deployment_summary(d, expected):
    assert summary(d) == expected
    assert st.deployment_summary(d)["exists"] is (d is not None)


def test_an_empty_status_counts_nothing():
    s = st.deployment_summary({"metadata": {"generation": 1}, "spec": {"replicas": 2}})
    assert (s["desired"], s["replicas"], s["ready"], s["available"], s["rolled_out"]) == (
        2,
        0,
        0,
        False,
        False,
    )


def conds(engine, router=None, redis=None, previous=None):
    out = st.derive_conditions(
        generation=2,
        previous=previous,
        now=NOW,
        engine=st.deployment_summary(engine),
        router=None if router is None else st.deployment_summary(router),
        redis=None if redis is None else st.deployment_summary(redis),
    )
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in out}


def test_all_ready():
    assert conds(dep(), router=dep(desired=1), redis=dep(desired=1)) == {
        "Ready": ("True", "Available", "3/3 engine replicas ready"),
        "Progressing": ("False", "Complete", "all replicas are up to date and ready"),
        "Degraded": ("False", "AsExpected", ""),
    }


def test_some_engine_pods_not_ready_is_below_desired():
    assert conds(dep(ready=2), router=dep(desired=1)) == {
        "Ready": ("True", "Available", "2/3 engine replicas ready"),
        "Progressing": ("True", "RollingOut", "rolling out: engine"),
        "Degraded": ("True", "BelowDesired", "2/3 engine replicas ready"),
    }


def test_no_engine_pod_ready_is_not_available_not_degraded():
    assert conds(dep(ready=0, available=False), router=dep(desired=1)) == {
        "Ready": ("False", "NotAvailable", "no ready replicas yet: engine"),
        "Progressing": ("True", "RollingOut", "rolling out: engine"),
        "Degraded": ("False", "AsExpected", ""),
    }


def test_a_missing_child_and_a_stuck_rollout():
    stuck = dep(ready=1, Progressing={"status": "False", "reason": "ProgressDeadlineExceeded"})
    assert conds(stuck, router=None, redis=dep(desired=1, ready=0, available=False)) == {
        "Ready": ("False", "NotAvailable", "no ready replicas yet: redis"),
        "Progressing": ("True", "RollingOut", "rolling out: engine, redis"),
        "Degraded": ("True", "RolloutStuck", "rollout not progressing: engine"),
    }
    assert conds(None, router=dep(desired=1)) == {
        "Ready": ("False", "ChildrenMissing", "not created yet: engine"),
        "Progressing": ("True", "RollingOut", "rolling out: engine"),
        "Degraded": ("False", "AsExpected", ""),
    }


def test_scaled_to_zero_is_ready_and_complete():
    assert conds(dep(desired=0, ready=0, available=True)) == {
        "Ready": ("True", "Available", "0/0 engine replicas ready"),
        "Progressing": ("False", "Complete", "all replicas are up to date and ready"),
        "Degraded": ("False", "AsExpected", ""),
    }


def test_last_transition_time_moves_only_when_the_status_flips():
    previous = [
        {"type": "Ready", "status": "True", "lastTransitionTime": EARLIER},
        {"type": "Degraded", "status": "True", "lastTransitionTime": EARLIER},
    ]
    out = st.derive_conditions(
        generation=5,
        previous=previous,
        now=NOW,
        engine=st.deployment_summary(dep()),
        router=None,
        redis=None,
    )
    times = {c["type"]: c["lastTransitionTime"] for c in out}
    assert times == {"Ready": EARLIER, "Progressing": NOW, "Degraded": NOW}
    assert {c["observedGeneration"] for c in out} == {5}
    assert "observedGeneration" not in st.condition("Ready", True, "r", "m", None, None, NOW)
