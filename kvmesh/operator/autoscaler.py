"""KV-utilisation autoscaling: a pure decision function and a small stateful wrapper.

The same code drives the Kubernetes operator (one loop per ModelDeployment) and
``kvmesh up``'s local autoscaling::

    from kvmesh.operator.autoscaler import Autoscaler, Observation, ScalingPolicy

    scaler = Autoscaler(ScalingPolicy(min_replicas=1, max_replicas=4))
    decision = scaler.step(Observation(now=time.time(), current_replicas=2,
                                       ready_replicas=2, kv_utilization=0.9))
    if decision.changed: ...start or stop engines to reach decision.desired_replicas...

Policy (all of it is in :func:`decide`):

1. *load* = ready replicas x their mean KV utilisation (the heartbeats of ready pods).
   Utilisation over the *requested* capacity is load / current, so replicas that are
   still starting count as capacity already requested (with no load): new pods that
   are loading the model never trigger another scale-up (no cascade).
2. recommendation = ceil(current x utilisation / target) = ceil(load / target), or
   ``current`` while |utilisation / target - 1| <= tolerance; never below current
   while pods are starting; clamped to [min, max].
3. Stabilisation: scale up to the *lowest* recommendation of the scale-up window,
   scale down to the *highest* recommendation of the scale-down window, and remove
   at most ``max_scale_down_step`` replicas per decision. A scaler that has not yet
   watched a full scale-down window (fresh start, operator restart) does not scale
   down, so a restart never causes flapping.
4. Missing metrics (no ready replica, no heartbeat): hold the current count (only
   the [min, max] bounds are enforced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

SCALE_UP = "scale-up"
SCALE_DOWN = "scale-down"
HOLD = "hold"   # no change because something prevents a decision (missing metrics, starting pods)
NONE = "none"   # no change needed


@dataclass(frozen=True)
class ScalingPolicy:
    """The knobs of ``spec.autoscaling`` (seconds and fractions)."""
    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_utilization: float = 0.7
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_scale_down_step: int = 1

    @classmethod
    def from_spec(cls, autoscaling: dict[str, Any]) -> "ScalingPolicy":
        """From a (defaulted) ``spec.autoscaling`` dict."""
        return cls(
            min_replicas=int(autoscaling.get("minReplicas", 1)),
            max_replicas=int(autoscaling["maxReplicas"]),
            target_kv_utilization=float(autoscaling.get("targetKVUtilization", 0.7)),
            tolerance=float(autoscaling.get("tolerance", 0.1)),
            scale_up_stabilization_s=float(autoscaling.get("scaleUpStabilizationSeconds", 0)),
            scale_down_stabilization_s=float(autoscaling.get("scaleDownStabilizationSeconds", 300)),
            max_scale_down_step=int(autoscaling.get("maxScaleDownStep", 1)),
        )


@dataclass(frozen=True)
class Observation:
    """What the autoscaler sees at one instant."""
    now: float                      # seconds (any monotonic-ish clock; the same for every step)
    current_replicas: int           # replicas currently requested (ready + starting)
    ready_replicas: int             # replicas with a live `ready` heartbeat
    kv_utilization: float | None    # mean KV utilisation (0..1) of the ready replicas; None if unknown


@dataclass(frozen=True)
class ScalerState:
    """Carried from one decision to the next (returned in :class:`Decision`)."""
    since: float | None = None                               # first observation with metrics
    history: tuple[tuple[float, int], ...] = ()              # (time, recommendation)
    last_scale_time: float | None = None


@dataclass(frozen=True)
class Decision:
    desired_replicas: int
    current_replicas: int
    action: str                     # SCALE_UP, SCALE_DOWN, HOLD or NONE
    recommendation: int             # before stabilisation and step bounds
    kv_utilization: float | None
    reason: str
    state: ScalerState = field(repr=False, default_factory=ScalerState)

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas


def _clamp(n: int, policy: ScalingPolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def decide(policy: ScalingPolicy, obs: Observation, state: ScalerState | None = None) -> Decision:
    """One autoscaling decision. Pure: the same inputs always give the same output."""
    state = state or ScalerState()
    current = obs.current_replicas
    starting = max(current - obs.ready_replicas, 0)

    def done(desired: int, action: str, rec: int, reason: str, new_state: ScalerState) -> Decision:
        if desired != current:
            new_state = replace(new_state, last_scale_time=obs.now)
            action = SCALE_UP if desired > current else SCALE_DOWN
        return Decision(desired, current, action, rec, obs.kv_utilization, reason, new_state)

    # Bounds first: a spec change of min/max applies at once, metrics or not.
    if current != _clamp(current, policy):
        bounded = _clamp(current, policy)
        return done(bounded, NONE, bounded, f"replicas {current} outside [{policy.min_replicas}, "
                    f"{policy.max_replicas}]", state)

    if obs.kv_utilization is None or obs.ready_replicas <= 0:
        return done(current, HOLD, current, "no KV-utilisation metrics from ready replicas; holding", state)

    load = obs.ready_replicas * max(0.0, obs.kv_utilization)
    utilisation = load / current if current else math.inf
    target = policy.target_kv_utilization
    if current and abs(utilisation / target - 1.0) <= policy.tolerance:
        rec, why = current, f"utilisation {utilisation:.2f} within tolerance of target {target:.2f}"
    else:
        rec = math.ceil(round(load / target, 9))
        why = f"utilisation {utilisation:.2f} vs target {target:.2f} -> {rec}"
    if rec < current and starting:
        rec, why = current, f"{starting} replica(s) still starting; not scaling down"
    rec = _clamp(rec, policy)

    since = state.since if state.since is not None else obs.now
    horizon = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    history = tuple((t, r) for t, r in state.history if t >= obs.now - horizon) + ((obs.now, rec),)
    new_state = replace(state, since=since, history=history)

    up_rec = min(r for t, r in history if t >= obs.now - policy.scale_up_stabilization_s)
    down_rec = max(r for t, r in history if t >= obs.now - policy.scale_down_stabilization_s)
    if up_rec > current:
        return done(up_rec, SCALE_UP, rec, why, new_state)
    if down_rec < current:
        if obs.now - since < policy.scale_down_stabilization_s:
            return done(current, HOLD, rec, why + "; scale-down window not yet observed in full", new_state)
        desired = max(down_rec, current - policy.max_scale_down_step)
        return done(desired, SCALE_DOWN, rec, why, new_state)
    if rec != current:
        return done(current, HOLD, rec, why + "; stabilising", new_state)
    return done(current, NONE, rec, why, new_state)


class Autoscaler:
    """Keeps the :class:`ScalerState` between calls of :func:`decide`."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self.state = ScalerState()

    def step(self, obs: Observation) -> Decision:
        decision = decide(self.policy, obs, self.state)
        self.state = decision.state
        return decision
