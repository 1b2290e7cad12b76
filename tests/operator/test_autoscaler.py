"""The pure autoscaling decision function, on sequences of observations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvmesh.operator.autoscaler import (HOLD, NONE, SCALE_DOWN, SCALE_UP, Autoscaler, Observation, ScalerState,
                                        ScalingPolicy, decide)

POLICY = ScalingPolicy(min_replicas=1, max_replicas=8, target_kv_utilization=0.5, tolerance=0.1,
                       scale_up_stabilization_s=0, scale_down_stabilization_s=60, max_scale_down_step=1)


def run(policy, steps):
    """steps: (t, current, ready, kv) -> list of decisions, feeding desired back as current when None."""
    scaler, out, current = Autoscaler(policy), [], None
    for t, cur, ready, kv in steps:
        current = cur if cur is not None else current
        d = scaler.step(Observation(now=t, current_replicas=current, ready_replicas=ready, kv_utilization=kv))
        out.append(d)
        current = d.desired_replicas
    return out


def test_formula_scales_up_to_ceil_of_load_over_target():
    d = decide(POLICY, Observation(now=0, current_replicas=2, ready_replicas=2, kv_utilization=0.9))
    assert (d.action, d.desired_replicas, d.recommendation) == (SCALE_UP, 4, 4)   # ceil(2*0.9/0.5)
    assert d.changed and d.state.last_scale_time == 0


def test_tolerance_band_means_no_change():
    for kv in (0.46, 0.5, 0.54):
        d = decide(POLICY, Observation(now=0, current_replicas=3, ready_replicas=3, kv_utilization=kv))
        assert (d.action, d.desired_replicas) == (NONE, 3), kv
    d = decide(POLICY, Observation(now=0, current_replicas=3, ready_replicas=3, kv_utilization=0.6))
    assert d.action == SCALE_UP and d.desired_replicas == 4


def test_bounds_are_respected():
    d = decide(POLICY, Observation(now=0, current_replicas=4, ready_replicas=4, kv_utilization=1.0))
    assert d.desired_replicas == 8
    d = decide(ScalingPolicy(min_replicas=2, max_replicas=3), Observation(0, 5, 5, None))
    assert d.desired_replicas == 3 and d.action == SCALE_DOWN   # max lowered: applies even without metrics
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
    d = decide(POLICY, Observation(now=1000, current_replicas=3, ready_replicas=1, kv_utilization=0.1),
               ScalerState(since=0))
    assert d.desired_replicas == 3 and "starting" in d.reason


def test_scale_down_waits_for_window_then_steps_by_one():
    steps = [(t, 4 if t == 0 else None, 4 if t == 0 else None, 0.05) for t in range(0, 200, 10)]
    scaler, current, out = Autoscaler(POLICY), 4, []
    for t, *_ in steps:
        d = scaler.step(Observation(now=t, current_replicas=current, ready_replicas=current, kv_utilization=0.05))
        out.append((t, d.desired_replicas, d.action))
        current = d.desired_replicas
    # Recommendation is 1 from t=0, but nothing moves before a full 60 s window, then one step per decision.
    assert [x for x in out if x[0] < 60] == [(t, 4, HOLD) for t in range(0, 60, 10)]
    assert out[6] == (60, 3, SCALE_DOWN)
    assert out[7] == (70, 2, SCALE_DOWN) and out[8] == (80, 1, SCALE_DOWN)
    assert all(x[1] == 1 for x in out[8:])


def test_scale_down_uses_highest_recommendation_in_window():
    p = ScalingPolicy(min_replicas=1, max_replicas=8, target_kv_utilization=0.5, scale_down_stabilization_s=60,
                      max_scale_down_step=8)
    scaler = Autoscaler(p)
    scaler.step(Observation(0, 4, 4, 0.5))                   # rec 4, steady
    scaler.step(Observation(30, 4, 4, 0.3))                  # rec 3
    d = scaler.step(Observation(61, 4, 4, 0.05))             # rec 1, but 3 (t=30) still in the window
    assert d.desired_replicas == 3 and d.action == SCALE_DOWN
    d = scaler.step(Observation(95, 3, 3, 0.05))              # t=30 fell out: highest is now 1
    assert d.desired_replicas == 1


def test_scale_up_stabilisation_uses_lowest_recommendation():
    p = ScalingPolicy(min_replicas=1, max_replicas=8, target_kv_utilization=0.5, scale_up_stabilization_s=30)
    scaler = Autoscaler(p)
    assert scaler.step(Observation(0, 2, 2, 0.5)).desired_replicas == 2
    d = scaler.step(Observation(10, 2, 2, 1.0))               # rec 4, but 2 (t=0) is within 30 s
    assert (d.desired_replicas, d.action) == (2, HOLD)
    d = scaler.step(Observation(31, 2, 2, 1.0))               # window holds only 4s now
    assert (d.desired_replicas, d.action) == (4, SCALE_UP)


def test_fresh_scaler_after_restart_does_not_flap():
    # The old scaler had settled at 5; a restarted one sees low load but must not drop at once.
    scaler = Autoscaler(POLICY)
    ds = [scaler.step(Observation(t, 5, 5, 0.1)) for t in (0, 10, 20, 30)]
    assert all(d.desired_replicas == 5 for d in ds)


def test_from_spec_uses_crd_field_names():
    p = ScalingPolicy.from_spec({"minReplicas": 2, "maxReplicas": 9, "targetKVUtilization": 0.6,
                                 "tolerance": 0.05, "scaleUpStabilizationSeconds": 5,
                                 "scaleDownStabilizationSeconds": 100, "maxScaleDownStep": 3})
    assert p == ScalingPolicy(2, 9, 0.6, 0.05, 5.0, 100.0, 3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.floats(0, 1) | st.none()), min_size=1, max_size=30),
       st.integers(1, 8))
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


@pytest.mark.parametrize("kv,ready,expected", [(0.0, 4, 1), (0.25, 4, 2), (0.75, 2, 3), (1.0, 1, 2)])
def test_recommendation_table(kv, ready, expected):
    d = decide(POLICY, Observation(0, ready, ready, kv))
    assert d.recommendation == expected


def test_importable_without_kopf_or_redis():
    """`kvmesh up` imports the decision function; it must not pull in the operator runtime."""
    import subprocess
    import sys
    code = ("import sys; import kvmesh.operator.autoscaler as a; a.decide; "
            "assert not {'kopf', 'redis', 'aiohttp', 'torch'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
