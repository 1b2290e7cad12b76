"""How the operator's autoscaling loop counts engine pods in every phase a kubelet reports, against
the API emulator: which are listed, which serve (capacity), which are coming (pending, starting
or stuck), their load and their deletion costs. Exact values throughout."""

from __future__ import annotations

import datetime

import pytest

from kvmesh.common.redis_layout import Heartbeat
from kvmesh.operator import render
from kvmesh.operator.apply import Connection, KubeClient
from kvmesh.operator.autoscaler import ScalingPolicy, split_pending
from kvmesh.operator.memo import Memo, OperatorConfig
from kvmesh.operator.scaling import (
    COST_STARTING,
    COST_STUCK,
    Load,
    deletion_costs,
    engine_pods,
    observe,
)
from tests.operator.conftest import PODS
from tests.operator.pod_phases import LEFT_OUT, LISTED, PHASES

STARTUP_S = 60
# Age of each pod at the decision, in seconds: one exactly at the startup deadline (not stuck yet).
AGES = {
    "pending-unscheduled": 120.0,
    "pending-waiting": 60.0,
    "running-not-ready": 61.0,
    "running-ready": 300.0,
    "terminating": 300.0,
    "succeeded": 300.0,
    "failed": 300.0,
    "unknown": 10.0,
}


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(md: str, suffix: str, now: float) -> dict:
    status, terminating = PHASES[suffix]
    meta = {
        "name": f"{md}-engine-{suffix}",
        "namespace": "ns",
        "labels": render.labels(md, render.ENGINE),
        "creationTimestamp": _iso(now - AGES[suffix]),
    }
    if terminating:
        meta["deletionTimestamp"] = _iso(now - 5)
        meta["deletionGracePeriodSeconds"] = 30
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {}, "status": status}


def hb(name: str, kv: float, running: int = 0, waiting: int = 0, state: str = "ready") -> Heartbeat:
    return Heartbeat(
        pod=name,
        url=f"http://{name}",
        kv_usage=kv,
        running=running,
        waiting=waiting,
        total_blocks=1000,
        state=state,
        ts=0.0,
        num_keys=100,
    )


@pytest.fixture()
async def memo(k8s, clock):
    client = KubeClient(Connection(server=str(k8s.url).rstrip("/")), retries=3, backoff=0.01)
    m = Memo(config=OperatorConfig(clock=clock))
    m.shared.client = client
    yield m
    await client.close()


@pytest.fixture()
async def listed(k8s, memo, clock):
    for suffix in reversed(PHASES):  # not in name order: the list comes back sorted
        await k8s.put_object(PODS, pod("demo", suffix, clock.now))
    await k8s.put_object(PODS, pod("other", "running-ready", clock.now))  # another deployment's
    return await engine_pods(memo, "ns", "demo")


def name(suffix: str) -> str:
    return f"demo-engine-{suffix}"


async def test_live_pods_are_listed_with_their_readiness_finished_and_terminating_left_out(
    listed, clock
):
    assert [(p.name, p.ready) for p in listed] == sorted(
        (name(s), ready) for s, ready in LISTED.items()
    )
    assert not {p.name for p in listed} & {name(s) for s in LEFT_OUT}
    assert {p.name: p.created for p in listed} == {name(s): clock.now - AGES[s] for s in LISTED}


async def test_one_ready_pod_is_capacity_the_other_live_ones_are_pending(listed, clock):
    load = Load(
        known=True,
        heartbeats={
            name("running-ready"): hb(name("running-ready"), 0.6, running=1, waiting=2),
            name("running-not-ready"): hb(name("running-not-ready"), 0.9, waiting=1),
        },
        busy=1 + 2 + 1 + 5,  # the terminating pod's draining heartbeat: 5 running
    )
    obs = observe(clock.now, 6, listed, load)
    assert obs.ready_replicas == 1 and obs.current_replicas == 6
    assert obs.kv_utilization == pytest.approx(0.6)  # the Ready pod's alone
    assert obs.waiting == 3 and obs.running == 9 - 3
    assert obs.pending == tuple(
        (name(s), clock.now - AGES[s]) for s in sorted(LISTED) if not LISTED[s]
    )
    policy = ScalingPolicy(min_replicas=1, max_replicas=10, startup_timeout_s=STARTUP_S)
    stuck, starting = split_pending(policy, obs)
    assert stuck == (name("pending-unscheduled"), name("running-not-ready"))
    assert starting == 6 - 2 - 1  # requested, less the stuck ones, less the one serving
    costs = deletion_costs(listed, load, stuck)
    assert costs == {
        name("pending-unscheduled"): COST_STUCK,
        name("pending-waiting"): COST_STARTING,
        name("running-not-ready"): COST_STUCK,
        name("running-ready"): 100 + 1000 * 3,  # its cached blocks, its 3 requests
        name("unknown"): COST_STARTING,
    }


async def test_without_the_terminating_and_finished_pods_nothing_changes(k8s, memo, clock):
    for suffix in LISTED:
        await k8s.put_object(PODS, pod("demo", suffix, clock.now))
    only_live = await engine_pods(memo, "ns", "demo")
    for suffix in LEFT_OUT:
        await k8s.put_object(PODS, pod("demo", suffix, clock.now))
    assert await engine_pods(memo, "ns", "demo") == only_live


async def test_the_loop_reports_exactly_the_ready_and_the_stuck_pods(
    k8s, operator, redis_url, clock
):
    """The whole loop (kopf runtime, emulator, real Redis): the decision in status counts the one
    Ready pod as capacity, the two live pods past their deadline as stuck, and the load of every
    listed pod; Degraded names the stuck ones, once."""
    from tests.operator.conftest import MD, eventually, md_body
    from tests.operator.test_operator_runtime import Heartbeats, after_ticks, auto, cond, events

    await k8s.put_object(MD, md_body(replicas=4, autoscaling=auto(startupTimeoutSeconds=STARTUP_S)))
    for suffix in PHASES:
        await k8s.put_object(PODS, pod("demo", suffix, clock.now))
    beats = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        await beats.beat(name("running-ready"), 0.5, running=1, waiting=2)
        await beats.beat(name("running-not-ready"), 0.9, running=0, waiting=1)
        await beats.beat(name("terminating"), 0.2, state="draining", running=5, waiting=0)
        stuck = [name("pending-unscheduled"), name("running-not-ready")]
        md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
        decision = await eventually(
            lambda: (d := md()["status"]["lastDecision"])["stuckPods"] == stuck and d
        )
        assert decision["readyReplicas"] == 1 and decision["kvUtilization"] == 0.5
        assert decision["waitingRequests"] == 3 and decision["runningRequests"] == 9 - 3
        degraded = await eventually(
            lambda: (c := cond(md(), "Degraded"))["reason"] == "ReplicasNotStarting" and c
        )
        assert degraded["status"] == "True"
        assert degraded["message"] == (
            f"2 engine pod(s) not Ready within 60s of their creation: {', '.join(stuck)}"
        )
        await after_ticks(k8s)
        (warning,) = events(k8s, "ReplicasNotStarting")  # one Warning per change of the set
        assert warning["message"].endswith(f"counted as coming capacity: {', '.join(stuck)}")
    finally:
        await beats.close()
