"""Autoscaling on KV utilisation and queue depth: a pure decision function and a small
stateful wrapper.

The same code drives the Kubernetes operator (one loop per ModelDeployment,
``operator/scaling.py``) and ``kvmesh up --autoscale``::

    from kvmesh.operator.autoscaler import Autoscaler, Observation, ScalingPolicy

    scaler = Autoscaler(ScalingPolicy(min_replicas=1, max_replicas=4))
    decision = scaler.step(Observation(now=time.time(), current_replicas=2, ready_replicas=2,
                                       kv_utilization=0.9, waiting=3, running=5))
    if decision.changed: ...start or stop engines to reach decision.desired_replicas...

Policy (all of it is in :func:`decide`; docs/operator.md "Autoscaling policy" has the
same in prose):

1. *Replicas*. ``current`` is the count asked for; ``ready`` the replicas that serve.
   The others are *pending*: a pending replica younger than ``startup_timeout_s`` is
   *starting* and counts as capacity already requested; an older one is *stuck* and
   does not (it is reported in :attr:`Decision.stuck`). ``effective = current - stuck``
   (never below ``ready``).
2. *Signals*. KV: ``load = ready x kv_utilization``; utilisation over the effective
   replicas is ``load / effective``; ``kv_rec = ceil(load / target_kv)``, or
   ``effective`` while ``|utilisation / target_kv - 1| <= tolerance``. Queue (off when
   ``target_queue_per_replica`` is 0): ``queue_rec = ceil(waiting / target_queue)``, or
   ``effective`` within the same tolerance of the target per replica. The need is
   ``max(kv_rec, queue_rec)``; never below ``effective`` while replicas are starting
   (no scale-down under them, and no cascade: they already count as capacity).
3. *Recommendation* (total replicas) = need, plus the stuck replicas when the need
   exceeds the effective capacity (they hold a slot and serve nothing); clamped to
   ``[max(1, min), max]``: the load never recommends 0.
4. *Stabilisation*: scale up to the lowest recommendation of the scale-up window,
   capped per ``scale_up_period_s`` at ``max(ceil(base x (1 + percent/100)), base +
   pods)`` where ``base`` is the count at the start of the period (HPA's default
   policy); scale down to the highest recommendation of the scale-down window, at
   most ``max_scale_down_step`` per decision, never before a full window has been
   watched (fresh start, operator restart).
5. *Zero* (``min_replicas == 0``): after ``scale_to_zero_idle_s`` with nothing
   running, waiting or held by a router (``demand``), go to 0; at 0 replicas a
   demand scales to ``max(1, min_replicas)`` at once (no window, no cap).
6. *Missing metrics* (no live heartbeat of a ready replica): hold the current count
   (only the bounds, zero and demand rules apply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

SCALE_UP = "scale-up"
SCALE_DOWN = "scale-down"
HOLD = "hold"  # no change because something prevents a decision (missing metrics, starting pods, windows)
NONE = "none"  # no change needed


@dataclass(frozen=True)
class ScalingPolicy:
    """The knobs of ``spec.autoscaling`` (seconds and fractions); defaults = the CRD's."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_utilization: float = 0.7
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_scale_down_step: int = 1
    target_queue_per_replica: float = (
        4.0  # waiting requests per replica; 0 disables the queue signal
    )
    scale_up_percent: float = 100.0  # scale-up cap per period, in percent of the replicas ...
    scale_up_pods: int = 4  # ... or in pods, whichever allows more
    scale_up_period_s: float = 15.0
    startup_timeout_s: float = 600.0  # a pending replica older than this is stuck
    scale_to_zero_idle_s: float = 300.0  # min_replicas 0: idle this long -> 0

    @classmethod
    def from_spec(cls, autoscaling: dict[str, Any]) -> ScalingPolicy:
        """From a (defaulted) ``spec.autoscaling`` dict."""
        d = cls()
        return cls(
            min_replicas=int(autoscaling.get("minReplicas", d.min_replicas)),
            max_replicas=int(autoscaling["maxReplicas"]),
            target_kv_utilization=float(
                autoscaling.get("targetKVUtilization", d.target_kv_utilization)
            ),
            tolerance=float(autoscaling.get("tolerance", d.tolerance)),
            scale_up_stabilization_s=float(
                autoscaling.get("scaleUpStabilizationSeconds", d.scale_up_stabilization_s)
            ),
            scale_down_stabilization_s=float(
                autoscaling.get("scaleDownStabilizationSeconds", d.scale_down_stabilization_s)
            ),
            max_scale_down_step=int(autoscaling.get("maxScaleDownStep", d.max_scale_down_step)),
            target_queue_per_replica=float(
                autoscaling.get("targetQueuePerReplica", d.target_queue_per_replica)
            ),
            scale_up_percent=float(autoscaling.get("scaleUpPercent", d.scale_up_percent)),
            scale_up_pods=int(autoscaling.get("scaleUpPods", d.scale_up_pods)),
            scale_up_period_s=float(autoscaling.get("scaleUpPeriodSeconds", d.scale_up_period_s)),
            startup_timeout_s=float(autoscaling.get("startupTimeoutSeconds", d.startup_timeout_s)),
            scale_to_zero_idle_s=float(
                autoscaling.get("scaleToZeroIdleSeconds", d.scale_to_zero_idle_s)
            ),
        )


@dataclass(frozen=True)
class Observation:
    """What the autoscaler sees at one instant."""

    now: float  # seconds (any clock; the same for every step and for `pending`)
    current_replicas: int  # replicas currently requested (ready + pending)
    ready_replicas: int  # replicas that serve (Ready pods; locally: a live `ready` heartbeat)
    kv_utilization: (
        float | None
    )  # mean KV utilisation (0..1) of the ready replicas; None if unknown
    waiting: int | None = (
        None  # waiting requests summed over the replicas' heartbeats; None: unknown
    )
    running: int = 0  # other requests in flight (running anywhere, or waiting on a
    # replica `waiting` leaves out, e.g. a draining one)
    # Replicas that exist but are not ready, as (name, created at) on the `now` clock; None when
    # unknown (then all current - ready count as starting, without a deadline).
    pending: tuple[tuple[str, float], ...] | None = None
    demand: bool = False  # a router holds requests for lack of a ready replica


@dataclass(frozen=True)
class ScalerState:
    """Carried from one decision to the next (returned in :class:`Decision`)."""

    since: float | None = None  # first observation with metrics
    history: tuple[tuple[float, int], ...] = ()  # (time, recommendation)
    last_scale_time: float | None = None
    scale_ups: tuple[tuple[float, int], ...] = ()  # (time, replicas added), for the rate cap
    idle_since: float | None = None  # nothing running, waiting or held since


@dataclass(frozen=True)
class Decision:
    desired_replicas: int
    current_replicas: int
    action: str  # SCALE_UP, SCALE_DOWN, HOLD or NONE
    recommendation: int  # before stabilisation, rate cap and step bounds
    kv_utilization: float | None
    reason: str
    state: ScalerState = field(repr=False, default_factory=ScalerState)
    stuck: tuple[
        str, ...
    ] = ()  # pending replicas past the startup timeout (not counted as capacity)
    starting: int = 0  # pending replicas within the startup timeout

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def split_pending(policy: ScalingPolicy, obs: Observation) -> tuple[tuple[str, ...], int]:
    """(names of the stuck replicas, number of starting replicas)."""
    stuck = tuple(
        sorted(
            name
            for name, created in obs.pending or ()
            if obs.now - created > policy.startup_timeout_s
        )
    )
    effective = max(obs.ready_replicas, obs.current_replicas - len(stuck))
    return stuck, max(0, effective - obs.ready_replicas)


def scale_up_cap(policy: ScalingPolicy, state: ScalerState, now: float, current: int) -> int:
    """The most replicas allowed now: HPA's policy over the last period, from the count at its start."""
    added = sum(n for t, n in state.scale_ups if t > now - policy.scale_up_period_s)
    base = max(0, current - added)
    return max(
        math.ceil(round(base * (1 + policy.scale_up_percent / 100.0), 9)),
        base + policy.scale_up_pods,
    )


def decide(policy: ScalingPolicy, obs: Observation, state: ScalerState | None = None) -> Decision:
    """One autoscaling decision. Pure: the same inputs always give the same output. Kept whole: its
    rules apply in this order (the spec's bounds, scale from and to zero, missing metrics, the KV and
    queue recommendation, the stabilization windows and rate limits, as Kubernetes' HPA applies
    them), and one reading top to bottom is the decision's explanation."""
    state = state or ScalerState()
    current = obs.current_replicas
    stuck, starting = split_pending(policy, obs)
    effective = (
        current - len(stuck) if current - len(stuck) >= obs.ready_replicas else obs.ready_replicas
    )
    floor = max(1, policy.min_replicas)  # the load never recommends fewer; only idleness goes to 0

    # Idleness (scale to zero): known metrics, nothing running or waiting, no router holding requests.
    idle = obs.waiting is not None and obs.waiting <= 0 and obs.running <= 0 and not obs.demand
    idle_since = (state.idle_since if state.idle_since is not None else obs.now) if idle else None
    state = replace(state, idle_since=idle_since)

    def done(desired: int, action: str, rec: int, reason: str, new_state: ScalerState) -> Decision:
        if desired != current:
            new_state = replace(new_state, last_scale_time=obs.now)
            action = SCALE_UP if desired > current else SCALE_DOWN
            if desired > current:
                keep = tuple(
                    (t, n) for t, n in new_state.scale_ups if t > obs.now - policy.scale_up_period_s
                )
                new_state = replace(new_state, scale_ups=keep + ((obs.now, desired - current),))
        if stuck:
            reason += f"; not starting within {policy.startup_timeout_s:g}s: {', '.join(stuck)}"
        return Decision(
            desired, current, action, rec, obs.kv_utilization, reason, new_state, stuck, starting
        )

    # Bounds first: a spec change of min/max applies at once, metrics or not.
    bounded = _clamp(current, policy.min_replicas, policy.max_replicas)
    if current != bounded:
        return done(
            bounded,
            NONE,
            bounded,
            f"replicas {current} outside [{policy.min_replicas}, {policy.max_replicas}]",
            state,
        )

    # Zero: wait for a router's demand, then come back at once.
    if current == 0:
        if obs.demand:
            up = min(floor, policy.max_replicas)
            return done(
                up, SCALE_UP, up, "a router holds requests at 0 replicas: scaling from zero", state
            )
        return done(0, NONE, 0, "scaled to zero; waiting for a router's demand", state)
    if (
        policy.min_replicas == 0
        and idle_since is not None
        and obs.now - idle_since >= policy.scale_to_zero_idle_s
    ):
        return done(
            0,
            SCALE_DOWN,
            0,
            f"idle for {obs.now - idle_since:.0f}s (nothing running, waiting or "
            "held by a router): scaling to zero",
            replace(state, history=()),
        )

    if obs.kv_utilization is None or obs.ready_replicas <= 0:
        return done(
            current, HOLD, current, "no KV-utilisation metrics from ready replicas; holding", state
        )

    # The signals, over the replicas that serve or are coming (stuck ones excluded).
    tol = policy.tolerance
    load = obs.ready_replicas * max(0.0, obs.kv_utilization)
    utilisation = load / effective
    target = policy.target_kv_utilization
    if abs(utilisation / target - 1.0) <= tol:
        kv_rec, why = (
            effective,
            f"KV utilisation {utilisation:.2f} within tolerance of target {target:.2f}",
        )
    else:
        kv_rec = math.ceil(round(load / target, 9))
        why = f"KV utilisation {utilisation:.2f} vs target {target:.2f} -> {kv_rec}"
    need = kv_rec
    tq = policy.target_queue_per_replica
    if tq > 0 and obs.waiting is not None:
        per = obs.waiting / effective
        if obs.waiting <= 0:
            q_rec = 0
        elif abs(per / tq - 1.0) <= tol:
            q_rec = effective
        else:
            q_rec = math.ceil(round(obs.waiting / tq, 9))
        why += f"; queue {per:.1f}/replica vs target {tq:g} -> {q_rec}"
        need = max(need, q_rec)
    if need < effective and starting:
        need, why = effective, why + f"; {starting} replica(s) still starting: not scaling down"
    rec = need + (current - effective) if need > effective else need
    rec = _clamp(rec, floor, policy.max_replicas)

    since = state.since if state.since is not None else obs.now
    horizon = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    history = tuple((t, r) for t, r in state.history if t >= obs.now - horizon) + ((obs.now, rec),)
    new_state = replace(state, since=since, history=history)

    up_rec = min(r for t, r in history if t >= obs.now - policy.scale_up_stabilization_s)
    down_rec = max(r for t, r in history if t >= obs.now - policy.scale_down_stabilization_s)
    if up_rec > current:
        cap = scale_up_cap(policy, new_state, obs.now, current)
        if up_rec > cap:
            if cap <= current:
                return done(
                    current,
                    HOLD,
                    rec,
                    why + f"; scale-up rate limit reached ({policy.scale_up_percent:g}% "
                    f"or {policy.scale_up_pods} pods per {policy.scale_up_period_s:g}s)",
                    new_state,
                )
            return done(
                cap, SCALE_UP, rec, why + f"; capped at {cap} by the scale-up rate limit", new_state
            )
        return done(up_rec, SCALE_UP, rec, why, new_state)
    if down_rec < current:
        if obs.now - since < policy.scale_down_stabilization_s:
            return done(
                current, HOLD, rec, why + "; scale-down window not yet observed in full", new_state
            )
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
