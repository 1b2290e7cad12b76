"""The per-ModelDeployment loop: status refresh and one autoscaling decision per tick.

:func:`run_loop` is the body of the kopf daemon registered in ``handlers.py``; each
:func:`tick` reads the replicas' load (Redis heartbeats), asks the pure
:func:`kvmesh.operator.autoscaler.decide` for a replica count, records the decision in
status and applies it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import kopf

from kvmesh.operator import crd, render, spec as specs, status as st
from kvmesh.operator.apply import ApiError
from kvmesh.operator.autoscaler import HOLD, NONE, Autoscaler, Observation, ScalingPolicy
from kvmesh.operator.handlers import Memo, _md_ref, _write_status, refresh_status
from kvmesh.operator.metrics_source import RedisHeartbeats


async def _redis_source(memo: Memo, md: dict[str, Any], spec: dict[str, Any]) -> RedisHeartbeats | None:
    """The heartbeat reader for this deployment's Redis."""
    ns, name = md["metadata"]["namespace"], md["metadata"]["name"]
    redis = spec["redis"]
    if redis["mode"] == "managed":
        url = memo.config.managed_redis_url or render.managed_redis_url(name, ns)
    else:
        if "url" in redis:
            url = redis["url"]
        else:
            assert memo.client is not None
            secret = await memo.client.get("Secret", ns, redis["secretRef"]["name"])
            raw = ((secret or {}).get("data") or {}).get(redis["secretRef"].get("key", "url"))
            if raw is None:
                return None
            url = base64.b64decode(raw).decode()
    if url not in memo.redis:
        memo.redis[url] = RedisHeartbeats(url)
    return memo.redis[url]


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

    policy = ScalingPolicy.from_spec(spec["autoscaling"])
    scaler = memo.scalers.setdefault(uid, Autoscaler(policy))
    scaler.policy = policy
    engine = await memo.client.get("Deployment", namespace, render.names(name)[render.ENGINE])
    if engine is None:
        await refresh_status(memo, md, spec)
        return float(spec["autoscaling"]["intervalSeconds"])
    current = int((engine.get("spec") or {}).get("replicas", 1))
    kv, ready = None, 0
    try:
        source = await _redis_source(memo, md, spec)
        if source is not None:
            snap = await source.snapshot(specs.served_model_name(spec), f"{render.names(name)[render.ENGINE]}-")
            kv, ready = snap.kv_utilization, len(snap.ready)
    except Exception as exc:  # Redis down: missing metrics -> hold
        logger.warning(f"reading heartbeats failed: {exc!r}")
    now = memo.config.clock()
    decision = scaler.step(Observation(now=now, current_replicas=current, ready_replicas=ready, kv_utilization=kv))
    extra: dict[str, Any] = {
        "lastDecision": {"time": st.now_iso(now), "action": decision.action, "currentReplicas": current,
                         "desiredReplicas": decision.desired_replicas, "recommendation": decision.recommendation,
                         "kvUtilization": kv, "reason": decision.reason},
        "kvUtilization": kv, "kvPercent": None if kv is None else round(kv * 100),
    }
    if decision.changed:
        extra["desiredReplicas"] = decision.desired_replicas
        extra["lastScaleTime"] = st.now_iso(now)
        # Record the decision before acting on it: a restart in between re-renders the same count.
        await _write_status(memo, md, {"desiredReplicas": decision.desired_replicas,
                                       "lastScaleTime": extra["lastScaleTime"],
                                       "lastDecision": extra["lastDecision"]})
        md = dict(md, status={**(md.get("status") or {}), "desiredReplicas": decision.desired_replicas})
        await memo.client.apply(render.render_engine_deployment(md, spec, memo.config.images))
        verb = "ScaledUp" if decision.desired_replicas > current else "ScaledDown"
        kopf.event(_md_ref(md), type="Normal", reason=verb,
                   message=f"{current} -> {decision.desired_replicas} replicas: {decision.reason}")
        logger.info(f"autoscaler: {current} -> {decision.desired_replicas}: {decision.reason}")
    elif decision.action != memo.last_actions.get(uid) and decision.action in (HOLD, NONE):
        kopf.event(_md_ref(md), type="Normal", reason="AutoscalerHold" if decision.action == HOLD else
                   "AutoscalerSteady", message=f"{current} replicas: {decision.reason}")
    memo.last_actions[uid] = decision.action
    await refresh_status(memo, md, spec, extra=extra)
    return float(spec["autoscaling"]["intervalSeconds"])


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
                break   # the operator is shutting down under a late-spawned daemon
            if not isinstance(exc, (ApiError, OSError, asyncio.TimeoutError)):
                raise
            logger.warning(f"autoscaler tick failed, retrying in {delay:.0f}s: {exc}")
            interval, delay = delay, min(delay * 2, 30.0)
        deadline = asyncio.get_running_loop().time() + interval
        while not stopped and not memo.stopping and asyncio.get_running_loop().time() < deadline:
            await stopped.wait(min(0.25, deadline - asyncio.get_running_loop().time()))
    uid = meta.get("uid")
    memo.scalers.pop(uid, None)
    memo.last_actions.pop(uid, None)
