"""The pure autoscaling decision function, on sequences of observations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.operator.autoscaler import (
    HOLD,
    NONE,
    SCALE_DOWN,
    SCALE_UP,
    Autoscaler,
    Observation,
    ScalerState,
    ScalingPolicy,
    decide,
    scale_up_cap,
    split_pending,
)

POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=8,
    target_kv_utilization=0.5,
    tolerance=0.1,
    scale_up_stabilization_s=0,
    scale_down_stabilization_s=60,
    max_scale_down_step=1,
)


def run(policy, steps):
    """steps: (t, current, ready, kv) -> list of decisions, feeding desired back as current when None."""
    scaler, out, current = Autoscaler(policy), [], None
    for t, cur, ready, kv in steps:
        current = cur if cur is not None else current
        d = scaler.step(
            Observation(now=t, current_replicas=current, ready_replicas=ready, kv_utilization=kv)
        )
        out.append(d)
        current = d.desired_replicas
    return out


def test_formula_scales_up_to_ceil_of_load_over_target():
    d = decide(POLICY, Observation(now=0, current_replicas=2, ready_replicas=2, kv_utilization=0.9))
    assert (d.action, d.desired_replicas, d.recommendation) == (SCALE_UP, 4, 4)  # ceil(2*0.9/0.5)
    assert d.changed and d.state.last_scale_time == 0


def test_tolerance_band_means_no_change():
    for kv in (0.46, 0.5, 0.54):
        d = decide(
            POLICY, Observation(now=0, current_replicas=3, ready_replicas=3, kv_utilization=kv)
        )
        assert (d.action, d.desired_replicas) == (NONE, 3), kv
    d = decide(POLICY, Observation(now=0, current_replicas=3, ready_replicas=3, kv_utilization=0.6))
    assert d.action == SCALE_UP and d.desired_replicas == 4


def test_bounds_are_respected():
    d = decide(POLICY, Observation(now=0, current_replicas=4, ready_replicas=4, kv_utilization=1.0))
    assert d.desired_replicas == 8
    d = decide(ScalingPolicy(min_replicas=2, max_replicas=3), Observation(0, 5, 5, None))
    assert (
        d.desired_replicas == 3 and d.action == SCALE_DOWN
    )  # max lowered: applies even without metrics
    d = decide(ScalingPolicy(min_replicas=2, max_replicas=3), Observation(0, 1, 1, None))
    assert d.desired_replicas == 2 and d.action == SCALE_UP


def test_missing_metrics_hold():
    for obs in (Observation(0, 3, 0, None), Observation(0, 3, 3, None), Observation(0, 3, 0, 0.9)):
        d = decide(POLICY, obs)
        assert (d.action, d.desired_replicas) == (HOLD, 3)
        assert "no KV-utilisation metrics" in d.reason


def test_starting_replicas_count_as_requested_capacity_no_cascade():
    # 1 ready pod at 100%: scale to 2. While pod 2 loads the model, pod 1 stays at 100%:
    # load 1.0 / target 0.5 = 2 = already requested -> no further scale-up.
    ds = run(POLICY, [(0, 1, 1, 1.0), (15, None, 1, 1.0), (30, None, 1, 1.0), (45, None, 1, 1.0)])
    assert [d.desired_replicas for d in ds] == [2, 2, 2, 2]
    assert ds[0].action == SCALE_UP and all(d.action != SCALE_UP for d in ds[1:])
    # ...and a starting pod never lets the scaler scale down.
    d = decide(
        POLICY,
        Observation(now=1000, current_replicas=3, ready_replicas=1, kv_utilization=0.1),
        ScalerState(since=0),
    )
    assert d.desired_replicas == 3 and "starting" in d.reason


def test_scale_down_waits_for_window_then_steps_by_one():
    steps = [(t, 4 if t == 0 else None, 4 if t == 0 else None, 0.05) for t in range(0, 200, 10)]
    scaler, current, out = Autoscaler(POLICY), 4, []
    for t, *_ in steps:
        d = scaler.step(
            Observation(
                now=t, current_replicas=current, ready_replicas=current, kv_utilization=0.05
            )
        )
        out.append((t, d.desired_replicas, d.action))
        current = d.desired_replicas
    # Recommendation is 1 from t=0, but nothing moves before a full 60 s window, then one step per decision.
    assert [x for x in out if x[0] < 60] == [(t, 4, HOLD) for t in range(0, 60, 10)]
    assert out[6] == (60, 3, SCALE_DOWN)
    assert out[7] == (70, 2, SCALE_DOWN) and out[8] == (80, 1, SCALE_DOWN)
    assert all(x[1] == 1 for x in out[8:])


def test_scale_down_uses_highest_recommendation_in_window():
    p = ScalingPolicy(
        min_replicas=1,
        max_replicas=8,
        target_kv_utilization=0.5,
        scale_down_stabilization_s=60,
        max_scale_down_step=8,
    )
    scaler = Autoscaler(p)
    scaler.step(Observation(0, 4, 4, 0.5))  # rec 4, steady
    scaler.step(Observation(30, 4, 4, 0.3))  # rec 3
    d = scaler.step(Observation(61, 4, 4, 0.05))  # rec 1, but 3 (t=30) still in the window
    assert d.desired_replicas == 3 and d.action == SCALE_DOWN
    d = scaler.step(Observation(95, 3, 3, 0.05))  # t=30 fell out: highest is now 1
    assert d.desired_replicas == 1


def test_scale_up_stabilisation_uses_lowest_recommendation():
    p = ScalingPolicy(
        min_replicas=1, max_replicas=8, target_kv_utilization=0.5, scale_up_stabilization_s=30
    )
    scaler = Autoscaler(p)
    assert scaler.step(Observation(0, 2, 2, 0.5)).desired_replicas == 2
    d = scaler.step(Observation(10, 2, 2, 1.0))  # rec 4, but 2 (t=0) is within 30 s
    assert (d.desired_replicas, d.action) == (2, HOLD)
    d = scaler.step(Observation(31, 2, 2, 1.0))  # window holds only 4s now
    assert (d.desired_replicas, d.action) == (4, SCALE_UP)


def test_fresh_scaler_after_restart_does_not_flap():
    # The old scaler had settled at 5; a restarted one sees low load but must not drop at once.
    scaler = Autoscaler(POLICY)
    ds = [scaler.step(Observation(t, 5, 5, 0.1)) for t in (0, 10, 20, 30)]
    assert all(d.desired_replicas == 5 for d in ds)


def test_from_spec_uses_crd_field_names():
    p = ScalingPolicy.from_spec(
        {
            "minReplicas": 2,
            "maxReplicas": 9,
            "targetKVUtilization": 0.6,
            "tolerance": 0.05,
            "scaleUpStabilizationSeconds": 5,
            "scaleDownStabilizationSeconds": 100,
            "maxScaleDownStep": 3,
        }
    )
    assert p == ScalingPolicy(2, 9, 0.6, 0.05, 5.0, 100.0, 3)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.floats(0, 1) | st.none()), min_size=1, max_size=30),
    st.integers(1, 8),
)
def test_invariants(seq, start):
    """Always within bounds; never drops more than the step; never scales while holding."""
    scaler, current, t = Autoscaler(POLICY), start, 0.0
    for ready, kv in seq:
        t += 7
        ready = min(ready, current)
        d = scaler.step(Observation(t, current, ready, kv))
        assert POLICY.min_replicas <= d.desired_replicas <= POLICY.max_replicas
        assert d.desired_replicas >= current - POLICY.max_scale_down_step
        if kv is None or ready == 0:
            assert d.desired_replicas == current
        assert d.changed == (d.action in (SCALE_UP, SCALE_DOWN))
        current = d.desired_replicas


@pytest.mark.parametrize(
    "kv,ready,expected", [(0.0, 4, 1), (0.25, 4, 2), (0.75, 2, 3), (1.0, 1, 2)]
)
def test_recommendation_table(kv, ready, expected):
    d = decide(POLICY, Observation(0, ready, ready, kv))
    assert d.recommendation == expected


def test_importable_without_kopf_or_redis():
    """`kvmesh up` imports the decision function; it must not pull in the operator runtime."""
    import subprocess
    import sys

    code = (
        "import sys; import kvmesh.operator.autoscaler as a; a.decide; "
        "assert not {'kopf', 'redis', 'aiohttp', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- scale-up rate cap (HPA's default policy) --------------------------------------------------

CAPPED = ScalingPolicy(
    min_replicas=1,
    max_replicas=100,
    target_kv_utilization=0.1,
    scale_up_percent=100,
    scale_up_pods=4,
    scale_up_period_s=15,
    scale_down_stabilization_s=600,
)


def test_scale_up_is_capped_per_period_at_percent_or_pods_whichever_is_larger():
    scaler = Autoscaler(CAPPED)
    d = scaler.step(Observation(0, 1, 1, 1.0))  # wants 10: +100% = 2, +4 pods = 5 -> 5
    assert (d.action, d.desired_replicas, d.recommendation) == (SCALE_UP, 5, 10)
    assert "capped at 5" in d.reason
    d = scaler.step(Observation(5, 5, 5, 1.0))  # same period: base is still 1 -> no more
    assert (d.action, d.desired_replicas, d.recommendation) == (HOLD, 5, 50)
    assert "rate limit" in d.reason
    d = scaler.step(Observation(16, 5, 5, 1.0))  # new period from 5: +100% = 10 > +4 = 9
    assert (d.action, d.desired_replicas) == (SCALE_UP, 10)
    d = scaler.step(Observation(32, 10, 10, 1.0))  # from 10: 20
    assert d.desired_replicas == 20
    d = scaler.step(Observation(40, 20, 20, 0.1))  # on target: no change, nothing capped
    assert (d.action, d.desired_replicas) == (NONE, 20)


def test_scale_up_cap_counts_every_step_of_the_period():
    p = replace(CAPPED, scale_up_percent=50, scale_up_pods=1, scale_up_period_s=60)
    scaler = Autoscaler(p)
    d = scaler.step(Observation(0, 10, 10, 0.12))  # wants 12; cap max(15, 11) = 15
    assert d.desired_replicas == 12
    d = scaler.step(Observation(10, 12, 12, 0.2))  # wants 24; base 10 -> cap still 15
    assert d.desired_replicas == 15 and "capped at 15" in d.reason
    d = scaler.step(Observation(20, 15, 15, 0.2))  # 5 added in this period: nothing more
    assert (d.action, d.desired_replicas) == (HOLD, 15)
    d = scaler.step(Observation(61, 15, 15, 0.2))  # t=0's step left the period: base 12 -> 18
    assert d.desired_replicas == 18


def test_scale_up_cap_helper_matches_hpa_formula():
    assert scale_up_cap(CAPPED, ScalerState(), 0, 0) == 4  # from 0: +4 pods
    assert scale_up_cap(CAPPED, ScalerState(), 0, 3) == 7  # 3 -> max(6, 7)
    assert scale_up_cap(CAPPED, ScalerState(), 0, 8) == 16  # 8 -> max(16, 12)
    state = ScalerState(scale_ups=((0.0, 4), (10.0, 2)))
    assert scale_up_cap(CAPPED, state, 12, 8) == 6  # base 2 -> max(4, 6)
    assert scale_up_cap(CAPPED, state, 15.5, 8) == 12  # t=0 left: base 6 -> max(12, 10)


# -- the queue signal ----------------------------------------------------------------------

QUEUE = replace(POLICY, target_queue_per_replica=4)


def test_queue_signal_scales_up_when_kv_is_low():
    obs = Observation(0, 2, 2, 0.1, waiting=20, running=8)
    d = decide(QUEUE, obs)  # kv says 1, queue says ceil(20 / 4) = 5
    assert (d.action, d.desired_replicas, d.recommendation) == (SCALE_UP, 5, 5)
    assert "queue 10.0/replica vs target 4 -> 5" in d.reason
    d = decide(replace(QUEUE, target_queue_per_replica=0), obs)  # 0 disables the queue signal
    assert d.desired_replicas == 2 and d.recommendation == 1 and "queue" not in d.reason


def test_queue_and_kv_take_the_larger_recommendation():
    assert (
        decide(QUEUE, Observation(0, 2, 2, 0.9, waiting=10)).recommendation == 4
    )  # kv 4 > queue 3
    assert (
        decide(QUEUE, Observation(0, 2, 2, 0.5, waiting=24)).recommendation == 6
    )  # queue 6 > kv 2
    assert decide(QUEUE, Observation(0, 2, 2, 0.5, waiting=8)).action == NONE  # both on target
    assert (
        decide(QUEUE, Observation(0, 2, 2, 0.5, waiting=0)).recommendation == 2
    )  # empty queue: kv


def test_queue_within_tolerance_keeps_the_count():
    d = decide(
        QUEUE, Observation(0, 3, 3, 0.1, waiting=13), ScalerState(since=-1000)
    )  # 4.33/replica ~ 4
    assert d.recommendation == 3 and (d.action, d.desired_replicas) == (NONE, 3)
    d = decide(
        QUEUE, Observation(0, 3, 3, 0.1, waiting=3), ScalerState(since=-1000)
    )  # 1/replica: kv wins
    assert d.recommendation == 1 and (d.action, d.desired_replicas) == (SCALE_DOWN, 2)


# -- scale to zero and back ---------------------------------------------------------------------

ZERO = replace(POLICY, min_replicas=0, scale_to_zero_idle_s=60, target_queue_per_replica=4)


def idle(t, current, ready=None, **kw):
    return Observation(
        t, current, current if ready is None else ready, 0.0, **{"waiting": 0, "running": 0, **kw}
    )


def test_scale_to_zero_after_the_idle_window_and_only_then():
    scaler = Autoscaler(ZERO)
    assert scaler.step(idle(0, 1)).desired_replicas == 1
    assert scaler.step(idle(30, 1, running=1)).desired_replicas == 1  # a request resets the window
    assert scaler.step(idle(40, 1)).desired_replicas == 1
    assert scaler.step(idle(99, 1)).desired_replicas == 1  # 59 s idle
    d = scaler.step(idle(100, 1))
    assert (d.action, d.desired_replicas) == (SCALE_DOWN, 0) and "idle for 60s" in d.reason
    d = scaler.step(idle(200, 0, ready=0))
    assert (d.action, d.desired_replicas) == (
        NONE,
        0,
    ) and "waiting for a router's demand" in d.reason


def test_nothing_goes_to_zero_while_requests_wait_are_held_or_metrics_are_unknown():
    for blocker in ({"waiting": 2}, {"demand": True}, {"waiting": None}):
        scaler = Autoscaler(ZERO)
        ds = [scaler.step(idle(t, 1, **blocker)) for t in range(0, 500, 20)]
        assert all(d.desired_replicas == 1 for d in ds), blocker
    # A policy with minReplicas 1 never goes to zero, idle or not.
    scaler = Autoscaler(replace(ZERO, min_replicas=1))
    assert all(scaler.step(idle(t, 1)).desired_replicas == 1 for t in range(0, 500, 20))


def test_load_never_recommends_zero_only_idleness_does():
    scaler = Autoscaler(ZERO)
    current, out = 3, []
    for t in range(0, 400, 10):  # one request running forever: never idle, KV load ~0
        d = scaler.step(Observation(t, current, current, 0.0, waiting=0, running=1))
        current = d.desired_replicas
        out.append(current)
    assert min(out) == 1 and out[-1] == 1


def test_demand_at_zero_scales_to_min_at_once():
    p = replace(ZERO, scale_up_stabilization_s=300)  # no window applies from zero
    d = decide(p, Observation(0, 0, 0, None, demand=True))
    assert (d.action, d.desired_replicas) == (SCALE_UP, 1) and "scaling from zero" in d.reason
    assert d.state.scale_ups == ((0, 1),)
    d = decide(p, Observation(0, 0, 0, None, demand=False))
    assert (d.action, d.desired_replicas) == (NONE, 0)
    # minReplicas > 0 at 0 replicas: the bounds bring it back, demand or not.
    d = decide(replace(p, min_replicas=2), Observation(0, 0, 0, None))
    assert (d.action, d.desired_replicas) == (SCALE_UP, 2)


def test_zero_round_trip():
    scaler = Autoscaler(ZERO)
    current, t, trace = 1, 0, []
    for step in ["idle"] * 8 + ["demand"] + ["starting"] * 3 + ["busy"] * 3 + ["idle"] * 8:
        ready = 0 if step in ("demand", "starting") or current == 0 else current
        obs = Observation(
            t,
            current,
            ready,
            None if ready == 0 else (0.3 if step == "busy" else 0.0),
            waiting=0,
            running=1 if step == "busy" else 0,
            demand=step in ("demand", "starting"),
        )
        current = scaler.step(obs).desired_replicas
        trace.append(current)
        t += 10
    assert trace[:8] == [1] * 6 + [0, 0]  # idle 60 s -> 0
    assert trace[8] == 1  # demand -> 1 at once
    assert trace[9:15] == [1] * 6
    assert trace[-1] == 0


# -- the startup deadline ---------------------------------------------------------------------

DEADLINE = replace(POLICY, startup_timeout_s=100)


def test_pending_replicas_split_into_starting_and_stuck():
    obs = Observation(120, 3, 1, 0.4, pending=(("b", 0.0), ("c", 50.0)))
    assert split_pending(DEADLINE, obs) == (("b",), 1)
    assert split_pending(DEADLINE, replace(obs, now=90)) == ((), 2)
    assert split_pending(DEADLINE, replace(obs, pending=None)) == (
        (),
        2,
    )  # unknown: all starting, no deadline


def test_a_stuck_replica_stops_counting_as_coming_capacity():
    # 1 ready at 90% (target 50%), 1 pending: while it starts it is capacity (no cascade) ...
    obs = Observation(50, 2, 1, 0.9, pending=(("engine-b", 0.0),))
    d = decide(DEADLINE, obs)
    assert (d.action, d.desired_replicas, d.stuck, d.starting) == (NONE, 2, (), 1)
    # ... past the deadline it is not: 2 serving replicas are needed, plus the stuck one's slot.
    d = decide(DEADLINE, replace(obs, now=101))
    assert (d.action, d.desired_replicas, d.stuck, d.starting) == (SCALE_UP, 3, ("engine-b",), 0)
    assert "not starting within 100s: engine-b" in d.reason


def test_a_stuck_replica_no_longer_blocks_scale_down():
    low = Observation(0, 3, 2, 0.1, pending=(("engine-c", 0.0),))
    settled = ScalerState(since=-1000)
    d = decide(DEADLINE, low, settled)  # starting: never scale down under it
    assert (d.desired_replicas, d.starting) == (3, 1) and "still starting" in d.reason
    d = decide(DEADLINE, replace(low, now=101), settled)  # stuck: the scale-down goes ahead
    assert (d.action, d.desired_replicas, d.stuck) == (SCALE_DOWN, 2, ("engine-c",))


def test_stuck_replicas_during_a_surge_leave_ready_capacity_alone():
    # A rollout surged a new pod that never starts: current 2, both old pods ready.
    d = decide(DEADLINE, Observation(500, 2, 2, 0.5, pending=(("new", 0.0),)), ScalerState(since=0))
    assert (d.action, d.desired_replicas, d.stuck) == (NONE, 2, ("new",))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 8),
            st.floats(0, 1) | st.none(),
            st.integers(0, 40) | st.none(),
            st.integers(0, 3),
            st.booleans(),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 8),
)
def test_invariants_with_queue_zero_and_deadline(seq, start):
    """Bounds, the scale-up cap, the step, and zero only through idleness or at zero."""
    policy = replace(
        POLICY, min_replicas=0, scale_to_zero_idle_s=30, startup_timeout_s=20, max_scale_down_step=2
    )
    scaler, current, t = Autoscaler(policy), start, 0.0
    for ready, kv, waiting, running, demand, pending in seq:
        t += 7
        ready = min(ready, current)
        pend = tuple((f"p{i}", t - 10 * i) for i in range(min(pending, current - ready)))
        before = scaler.state
        d = scaler.step(
            Observation(
                t, current, ready, kv, waiting=waiting, running=running, pending=pend, demand=demand
            )
        )
        assert 0 <= d.desired_replicas <= policy.max_replicas
        if current > 0 and d.desired_replicas > current:
            assert d.desired_replicas <= scale_up_cap(policy, before, t, current)
        if current == 0:
            assert d.desired_replicas == (1 if demand else 0)
        elif d.desired_replicas == 0:
            assert waiting == 0 and running == 0 and not demand
        else:
            assert d.desired_replicas >= current - policy.max_scale_down_step
        assert set(d.stuck) == {n for n, c in pend if t - c > policy.startup_timeout_s}
        current = d.desired_replicas
