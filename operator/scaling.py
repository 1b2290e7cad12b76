"""The per-ModelDeployment loop: status refresh and one autoscaling decision per tick.

:func:`run_loop` is the body of the kopf daemon registered in ``handlers.py``; each
:func:`tick`:

1. takes the engine pods from the API (label selector ``render.selector_string``):
   Ready pods serve; the others are pending, with their creation time (the startup
   deadline);
2. reads their load from the Redis heartbeats (KV utilisation, running and waiting
   requests; heartbeats only add load, they never add a replica), the requests waiting at
   the routers (flow control: counted as waiting) and the routers' scale-from-zero demand key;
3. with ``autoscaling.mode: builtin``, asks the pure
   :func:`kvmesh.operator.autoscaler.decide` for a replica count, records the
   decision in status, annotates the engine pods with their deletion cost before a
   scale-down, writes ``spec.replicas`` through the ModelDeployment's ``/scale``
   subresource and applies the engine Deployment; with ``mode: external`` (an HPA or
   KEDA owns ``spec.replicas``) it only refreshes status;
4. reports pods not Ready within ``startupTimeoutSeconds`` in the ``Degraded``
   condition (reason ``ReplicasNotStarting``) and a Warning Event.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvmesh.common.redis_layout import Heartbeat
from kvmesh.operator import crd, render
from kvmesh.operator import spec as specs
from kvmesh.operator import status as st
from kvmesh.operator.apply import ApiError
from kvmesh.operator.autoscaler import (
    HOLD,
    NONE,
    Autoscaler,
    Decision,
    Observation,
    ScalingPolicy,
    split_pending,
)
from kvmesh.operator.generated_secrets import ensure_generated_secrets
from kvmesh.operator.memo import Memo
from kvmesh.operator.metrics_source import RedisHeartbeats
from kvmesh.operator.status_write import refresh_status, write_status

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
NOT_STARTING = "ReplicasNotStarting"
# Deletion costs (the ReplicaSet controller removes the lowest first, among pods of equal
# readiness): stuck < starting < ready; a ready pod's cost grows with its cached blocks and
# more steeply with the requests it runs or queues (a request outweighs this many blocks).
COST_STUCK, COST_STARTING = -1000, -100
COST_PER_REQUEST = 1000
COST_MAX = 2**31 - 1


@dataclass(frozen=True)
class EnginePod:
    name: str
    ready: bool
    created: float  # unix time of metadata.creationTimestamp
    annotations: dict[str, str] = field(default_factory=dict)
    ip: str = ""  # status.podIP ("" until the kubelet reports one)


@dataclass
class Load:
    """What the heartbeats and the demand key say; ``known`` is False when Redis could not be read."""

    known: bool = False
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)  # live `ready` heartbeats by pod
    busy: int = 0  # requests running or waiting on any live replica (draining ones too)
    demand: bool = False
    queued: int = 0  # requests waiting at the routers (flow control): waiting, as an engine's


@dataclass
class LoopState:
    """Per-ModelDeployment bookkeeping of the loop, kept in ``memo.scalers[uid]``."""

    scaler: Autoscaler
    last_action: str | None = None
    reported_stuck: tuple[str, ...] = ()
    warned_pods: bool = False


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value).timestamp()  # reads "Z" since Python 3.11
    except ValueError:
        return None


async def engine_pods(
    memo: Memo, namespace: str, name: str, loop: LoopState | None = None, logger: Any = None
) -> list[EnginePod] | None:
    """This deployment's live engine pods from the API (terminating and finished pods
    left out); None when the operator may not list pods (an older ClusterRole)."""
    assert memo.client is not None
    try:
        items = await memo.client.list("Pod", namespace, render.selector_string(name))
    except ApiError as exc:
        if exc.status not in (403, 404):
            raise
        if loop is not None and not loop.warned_pods and logger is not None:
            logger.warning(
                f"cannot list engine pods ({exc}); counting replicas from heartbeats, without "
                "the startup deadline (grant pods list/patch: manifests/rbac.yaml)"
            )
            loop.warned_pods = True
        return None
    pods = []
    for pod in items:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        created = _parse_time(meta.get("creationTimestamp"))
        pods.append(
            EnginePod(
                meta["name"],
                ready,
                created if created is not None else memo.config.clock(),
                dict(meta.get("annotations") or {}),
                status.get("podIP") or "",
            )
        )
    return sorted(pods, key=lambda p: p.name)


async def _redis_source(
    memo: Memo, md: dict[str, Any], spec: dict[str, Any]
) -> RedisHeartbeats | None:
    """The heartbeat reader for this deployment's Redis."""
    ns, name = md["metadata"]["namespace"], md["metadata"]["name"]
    redis = spec["redis"]
    if redis["mode"] == "managed" and memo.config.managed_redis_url:
        url = memo.config.managed_redis_url
    elif "url" in redis or (redis["mode"] == "managed" and not redis.get("requirePassword", True)):
        url = redis.get("url") or render.managed_redis_url(name, ns)
    else:
        # The URL is in a Secret: the user's, or the generated one with the managed Redis' password.
        assert memo.client is not None
        secret_name, key = render.redis_secret_ref(name, spec)
        secret = await memo.client.get("Secret", ns, secret_name)
        raw = ((secret or {}).get("data") or {}).get(key)
        if raw is None:
            return None
        url = base64.b64decode(raw).decode()
    if url not in memo.redis:
        memo.redis[url] = RedisHeartbeats(url)
    return memo.redis[url]


async def read_load(
    memo: Memo,
    md: dict[str, Any],
    spec: dict[str, Any],
    logger: Any,
    pods: list[EnginePod] | None = None,
) -> Load:
    name = md["metadata"]["name"]
    model = specs.served_model_name(spec)
    try:
        source = await _redis_source(memo, md, spec)
        if source is None:
            return Load()
        # The listed pods are read by name, whatever else the pods set holds.
        snap = await source.snapshot(
            model, f"{render.names(name)[render.ENGINE]}-", [p.name for p in pods or ()]
        )
        demand = await source.demand(model)
        queued = await source.queued_at_routers(model)
    except Exception as exc:  # Redis down: missing metrics -> hold
        logger.warning(f"reading heartbeats failed: {exc!r}")
        return Load()
    return Load(
        known=True,
        heartbeats={h.pod: h for h in snap.ready},
        demand=demand is not None,
        busy=sum(h.running + h.waiting for h in snap.ready + snap.draining) + queued,
        queued=queued,
    )


def observe(now: float, current: int, pods: list[EnginePod] | None, load: Load) -> Observation:
    """The autoscaler's view: replica counts from the pods, load from their heartbeats.
    Without pods (no permission to list them), the heartbeats count the ready replicas."""
    if pods is None:
        beats = serving = list(load.heartbeats.values())
        ready, pending = len(beats), None
    else:
        beats = [load.heartbeats[p.name] for p in pods if p.name in load.heartbeats]
        serving = [load.heartbeats[p.name] for p in pods if p.ready and p.name in load.heartbeats]
        ready = sum(p.ready for p in pods)
        pending = tuple((p.name, p.created) for p in pods if not p.ready)
    # KV: the mean over the Ready pods (one without a heartbeat adds none); the queue: every
    # listed engine pod's heartbeat. Idleness is judged on every heartbeat of the deployment: a
    # request on a draining or not yet listed replica still keeps it from going to zero.
    kv = sum(h.kv_usage for h in serving) / ready if serving and ready else None
    # A request waiting at a router (flow control) is demand, as one in an engine's queue is.
    waiting = sum(h.waiting for h in beats) + load.queued
    return Observation(
        now=now,
        current_replicas=current,
        ready_replicas=ready,
        kv_utilization=kv,
        waiting=waiting if load.known else None,
        running=max(0, load.busy - waiting),
        pending=pending,
        demand=load.demand,
    )


def deletion_costs(pods: list[EnginePod], load: Load, stuck: tuple[str, ...]) -> dict[str, int]:
    """pod -> controller.kubernetes.io/pod-deletion-cost: the ReplicaSet removes the cheapest."""
    costs = {}
    for pod in pods:
        if not pod.ready:
            costs[pod.name] = COST_STUCK if pod.name in stuck else COST_STARTING
            continue
        hb = load.heartbeats.get(pod.name)
        value = 0 if hb is None else hb.cached_blocks + COST_PER_REQUEST * (hb.running + hb.waiting)
        costs[pod.name] = min(COST_MAX, value)
    return costs


async def annotate_deletion_costs(
    memo: Memo, namespace: str, pods: list[EnginePod], costs: dict[str, int], logger: Any
) -> None:
    assert memo.client is not None
    for pod in pods:
        value = str(costs[pod.name])
        if pod.annotations.get(DELETION_COST) == value:
            continue
        try:
            await memo.client.patch(
                "Pod", namespace, pod.name, {"metadata": {"annotations": {DELETION_COST: value}}}
            )
        except ApiError as exc:  # gone meanwhile, or no permission: scale down anyway
            if exc.status != 404:
                logger.warning(f"annotating {pod.name} with its deletion cost failed: {exc}")


async def _refresh(
    memo: Memo,
    md: dict[str, Any],
    spec: dict[str, Any],
    extra: dict[str, Any],
    stuck: tuple[str, ...],
    policy: ScalingPolicy,
    loop: LoopState,
) -> None:
    """Status from the children, then the stuck pods in the Degraded condition."""
    patch = await refresh_status(memo, md, spec, extra=extra)
    if stuck != loop.reported_stuck:
        if stuck:
            kopf.warn(
                crd.object_ref(md),
                reason=NOT_STARTING,
                message=f"not Ready within startupTimeoutSeconds ({policy.startup_timeout_s:g}s), no longer "
                f"counted as coming capacity: {', '.join(stuck)}",
            )
        loop.reported_stuck = stuck
    if not stuck or "conditions" not in patch:
        return  # no stuck pod, or a sticky InvalidSpec/ApplyFailed condition stays as it is
    message = (
        f"{len(stuck)} engine pod(s) not Ready within {policy.startup_timeout_s:g}s of their creation: "
        f"{', '.join(stuck)}"
    )
    conditions = []
    for c in patch["conditions"]:
        if c.get("type") == st.DEGRADED:
            if (
                c.get("status") == "True"
                and c.get("reason") not in (NOT_STARTING, None)
                and c.get("message")
            ):
                message += f"; {c['message']}"
            c = st.condition(
                st.DEGRADED,
                True,
                NOT_STARTING,
                message,
                c.get("observedGeneration"),
                (md.get("status") or {}).get("conditions"),
                st.now_iso(),
            )
        conditions.append(c)
    await write_status(memo, md, {"conditions": conditions})


async def tick(memo: Memo, namespace: str, name: str, logger: Any) -> float:
    """One status refresh + autoscaling decision. Returns seconds until the next one."""
    assert memo.client is not None
    md = await memo.client.get(crd.KIND, namespace, name)
    if md is None or md["metadata"].get("deletionTimestamp"):
        return memo.config.status_interval
    spec = specs.apply_defaults(dict(md.get("spec") or {}))
    if specs.validate(name, spec):
        return memo.config.status_interval  # reconcile already reported it
    uid = md["metadata"]["uid"]
    if "autoscaling" not in spec:
        memo.scalers.pop(uid, None)
        await refresh_status(memo, md, spec)
        return memo.config.status_interval

    auto = spec["autoscaling"]
    interval = float(auto["intervalSeconds"])
    policy = ScalingPolicy.from_spec(auto)
    loop = memo.scalers.get(uid)
    if not isinstance(loop, LoopState):
        loop = memo.scalers[uid] = LoopState(Autoscaler(policy))
    loop.scaler.policy = policy
    engine = await memo.client.get("Deployment", namespace, render.names(name)[render.ENGINE])
    if engine is None:
        await refresh_status(memo, md, spec)
        return interval
    pods = await engine_pods(memo, namespace, name, loop, logger)
    load = await read_load(memo, md, spec, logger, pods)
    now = memo.config.clock()
    external = auto.get("mode") == "external"
    # builtin: spec.replicas is ours (the /scale target); external: what the HPA/KEDA asked for.
    current = (
        int((engine.get("spec") or {}).get("replicas", 1))
        if external
        else int(spec.get("replicas", 1))
    )
    obs = observe(now, current, pods, load)
    kv = obs.kv_utilization
    extra: dict[str, Any] = {
        "kvUtilization": kv,
        "kvPercent": None if kv is None else round(kv * 100),
    }
    if external:
        loop.scaler = Autoscaler(policy)  # a switch back to builtin starts with a fresh window
        stuck, _ = split_pending(policy, obs)
        await _refresh(memo, md, spec, extra, stuck, policy, loop)
        return interval

    decision = loop.scaler.step(obs)
    extra["lastDecision"] = {
        "time": st.now_iso(now),
        "action": decision.action,
        "currentReplicas": current,
        "desiredReplicas": decision.desired_replicas,
        "recommendation": decision.recommendation,
        "kvUtilization": kv,
        "readyReplicas": obs.ready_replicas,
        "waitingRequests": obs.waiting,
        "runningRequests": obs.running,
        "stuckPods": list(decision.stuck),
        "demand": obs.demand,
        "reason": decision.reason,
    }
    if decision.changed:
        await _scale(memo, md, spec, decision, pods, load, now, extra, logger)
    elif decision.action != loop.last_action and decision.action in (HOLD, NONE):
        kopf.event(
            crd.object_ref(md),
            type="Normal",
            reason="AutoscalerHold" if decision.action == HOLD else "AutoscalerSteady",
            message=f"{current} replicas: {decision.reason}",
        )
    loop.last_action = decision.action
    if decision.changed:
        md = dict(md, spec={**(md.get("spec") or {}), "replicas": decision.desired_replicas})
    await _refresh(memo, md, spec, extra, decision.stuck, policy, loop)
    return interval


async def _scale(
    memo: Memo,
    md: dict[str, Any],
    spec: dict[str, Any],
    decision: Decision,
    pods: list[EnginePod] | None,
    load: Load,
    now: float,
    extra: dict[str, Any],
    logger: Any,
) -> None:
    """Act on a changed decision: status first, deletion costs, /scale, engine Deployment."""
    assert memo.client is not None
    ns, name = md["metadata"]["namespace"], md["metadata"]["name"]
    current, desired = decision.current_replicas, decision.desired_replicas
    extra["desiredReplicas"] = desired
    extra["lastScaleTime"] = st.now_iso(now)
    # Record the decision before acting on it: a restart in between re-renders the same count.
    await write_status(
        memo,
        md,
        {
            "desiredReplicas": desired,
            "lastScaleTime": extra["lastScaleTime"],
            "lastDecision": extra["lastDecision"],
        },
    )
    if pods and 0 < desired < current:
        await annotate_deletion_costs(
            memo, ns, pods, deletion_costs(pods, load, decision.stuck), logger
        )
    await memo.client.scale(crd.KIND, ns, name, desired)
    scaled = dict(
        md,
        spec={**(md.get("spec") or {}), "replicas": desired},
        status={**(md.get("status") or {}), "desiredReplicas": desired},
    )
    # The same Deployment a reconcile renders (credentials included), or the pods would roll.
    credentials = await ensure_generated_secrets(memo, scaled, spec)
    await memo.client.apply(
        render.render_engine_deployment(
            scaled, dict(spec, replicas=desired), memo.config.images, credentials
        )
    )
    verb = "ScaledUp" if desired > current else "ScaledDown"
    kopf.event(
        crd.object_ref(md),
        type="Normal",
        reason=verb,
        message=f"{current} -> {desired} replicas: {decision.reason}",
    )
    logger.info(f"autoscaler: {current} -> {desired}: {decision.reason}")


async def pause(stopped: Any, memo: Memo, seconds: float) -> None:
    """A daemon's wait between passes, in short sleeps: a stopped daemon (or a stopping operator)
    ends it within a fraction of a second. Plain sleeps, not ``stopped.wait(timeout)``: that is
    ``asyncio.wait_for`` inside, which on Python 3.11 raises TimeoutError, not the cancellation,
    when the daemon is cancelled as its timeout fires, and kopf re-raises that at shutdown."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stopped and not memo.stopping and loop.time() < deadline:
        await asyncio.sleep(min(0.25, max(deadline - loop.time(), 0.01)))


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Until the event is set (True) or the seconds pass (False). ``asyncio.timeout``, not
    ``asyncio.wait_for``: a cancellation that lands as the timeout fires stays a cancellation."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def run_loop(stopped: Any, meta: Any, memo: Memo, logger: Any) -> None:
    """One loop per ModelDeployment (kopf daemon in handlers.py): status refresh and autoscaling."""
    namespace, name = meta["namespace"], meta["name"]
    delay = 1.0
    while not stopped and not memo.stopping:
        try:
            interval = await tick(memo, namespace, name, logger)
            delay = 1.0
        except Exception as exc:
            if memo.stopping:
                break  # the operator is shutting down under a late-spawned daemon
            if not isinstance(exc, (ApiError, OSError, asyncio.TimeoutError)):
                raise
            logger.warning(f"autoscaler tick failed, retrying in {delay:.0f}s: {exc}")
            interval, delay = delay, min(delay * 2, 30.0)
        await pause(stopped, memo, interval)
    uid = meta.get("uid")
    memo.scalers.pop(uid, None)
    memo.last_actions.pop(uid, None)
