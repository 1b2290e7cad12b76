"""The operator loop's pure parts: how pods and heartbeats become an Observation, and the
pods' deletion costs (the runtime tests drive the whole loop)."""

from __future__ import annotations

import pytest

from kvmesh.common.redis_layout import Heartbeat
from kvmesh.operator.scaling import (
    COST_STARTING,
    COST_STUCK,
    EnginePod,
    Load,
    deletion_costs,
    observe,
)


def hb(pod, kv=0.5, running=0, waiting=0, num_keys=None, total=1000):
    return Heartbeat(
        pod=pod,
        url=f"http://{pod}",
        kv_usage=kv,
        running=running,
        waiting=waiting,
        total_blocks=total,
        state="ready",
        ts=0.0,
        num_keys=num_keys,
    )


PODS = [EnginePod("e-a", True, 10.0), EnginePod("e-b", True, 20.0), EnginePod("e-c", False, 30.0)]


def test_counts_come_from_the_api_and_heartbeats_only_add_load():
    load = Load(
        known=True,
        busy=1 + 2 + 3 + 4 + 7,
        heartbeats={
            "e-a": hb("e-a", 0.8, running=1, waiting=2),
            "e-c": hb("e-c", 0.9, waiting=3),
            "e-ghost": hb("e-ghost", 1.0, waiting=4),
        },
    )
    obs = observe(100.0, 3, PODS, load)
    assert (obs.current_replicas, obs.ready_replicas) == (3, 2)
    assert obs.kv_utilization == pytest.approx(0.4)  # (0.8 + no heartbeat for e-b) / 2 Ready pods
    assert obs.waiting == 5  # e-a and the starting e-c; not the unlisted ghost
    assert obs.running == 17 - 5  # anything else in flight keeps it from zero
    assert obs.pending == (("e-c", 30.0),)


def test_requests_waiting_at_the_routers_count_as_waiting():
    load = Load(known=True, busy=2 + 9, heartbeats={"e-a": hb("e-a", 0.5, waiting=2)}, queued=9)
    obs = observe(100.0, 3, PODS, load)
    assert obs.waiting == 2 + 9 and obs.running == 0


def test_unknown_load_and_no_pod_permission():
    obs = observe(0.0, 2, PODS, Load())
    assert obs.kv_utilization is None and obs.waiting is None and not obs.demand
    load = Load(
        known=True, heartbeats={"x": hb("x", 0.2, waiting=1), "y": hb("y", 0.4)}, demand=True
    )
    obs = observe(0.0, 2, None, load)  # pods cannot be listed: heartbeats count replicas
    assert (obs.ready_replicas, obs.pending, obs.waiting, obs.demand) == (2, None, 1, True)
    assert obs.kv_utilization == pytest.approx(0.3)


def test_deletion_costs_rank_stuck_starting_then_cached_value_and_load():
    pods = PODS + [EnginePod("e-d", False, 0.0), EnginePod("e-e", True, 0.0)]
    load = Load(
        known=True,
        heartbeats={"e-a": hb("e-a", num_keys=700), "e-b": hb("e-b", kv=0.25, running=1)},
    )
    costs = deletion_costs(pods, load, stuck=("e-d",))
    assert costs == {
        "e-a": 700,
        "e-b": 250 + 1000,
        "e-c": COST_STARTING,
        "e-d": COST_STUCK,
        "e-e": 0,
    }
    assert sorted(costs, key=costs.get) == ["e-d", "e-c", "e-e", "e-a", "e-b"]


def test_a_daemons_waits_end_on_their_event_and_a_cancellation_stays_a_cancellation():
    """The daemons' waits (scaling.pause between passes, wait_event for the healer's dirty flag):
    a stopping operator ends a pause within a short sleep, a set event ends wait_event at once,
    and a daemon cancelled mid-wait ends cancelled, never with a TimeoutError (which kopf would
    re-raise from the operator at shutdown)."""
    import asyncio

    from kvmesh.operator.memo import Memo
    from kvmesh.operator.scaling import pause, wait_event

    async def main():
        loop = asyncio.get_running_loop()
        memo = Memo()
        event = asyncio.Event()
        assert await wait_event(event, 0.01) is False
        loop.call_later(0.02, event.set)
        t0 = loop.time()
        assert await wait_event(event, 5.0) is True and loop.time() - t0 < 1.0
        loop.call_later(0.05, setattr, memo.shared, "stopping", True)
        t0 = loop.time()
        await pause(False, memo, 30.0)
        assert loop.time() - t0 < 1.0
        for wait in (wait_event(asyncio.Event(), 10.0), pause(False, Memo(), 10.0)):
            task = asyncio.create_task(wait)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
