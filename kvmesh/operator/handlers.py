"""kopf handlers for ModelDeployment.

* create / update(spec) / resume -> :func:`reconcile`: default + validate the spec,
  render the children, server-side apply them, prune children no longer rendered,
  write status. An invalid spec gives ``Ready=False`` (reason ``InvalidSpec``) and an
  Event, never an exception loop; transient API errors are retried by kopf with backoff.
* one daemon per ModelDeployment -> :func:`tick` every ``intervalSeconds``: status from
  the children and, with ``spec.autoscaling``, one autoscaler decision from the Redis
  heartbeats (recorded in status and as an Event).

The handlers are registered in :data:`registry` (not kopf's global one), and share
state through kopf's ``memo`` (:class:`Memo`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

from kvmesh.operator import crd, render, spec as specs, status as st
from kvmesh.operator.apply import ApiError, Connection, KubeClient, object_path
from kvmesh.operator.autoscaler import HOLD, NONE, Autoscaler, Observation, ScalingPolicy
from kvmesh.operator.metrics_source import RedisHeartbeats

registry = kopf.OperatorRegistry()
ANNOTATION_PREFIX = "kvmesh.io"
PRUNED_KINDS = ("Deployment", "Service", "Secret", "NetworkPolicy")


@dataclass
class OperatorConfig:
    images: render.Images = field(default_factory=render.Images)
    connection: Connection | None = None          # None: in-cluster service account, else kubeconfig
    status_interval: float = 10.0                 # status refresh when not autoscaling
    managed_redis_url: str | None = None          # reach managed Redis here instead of its in-cluster
                                                  # Service name (operator outside the cluster, tests)
    clock: Callable[[], float] = time.time        # the autoscaler's clock (tests fast-forward it)
    api_retries: int = 4
    rejected_retry_delay: float = 60.0            # slow retry after the API server rejected a child


@dataclass
class Shared:
    """Operator-wide mutable state. kopf hands each resource a shallow copy of the memo,
    so anything that must be seen everywhere after startup lives in this one object."""
    client: KubeClient | None = None
    stopping: bool = False


@dataclass
class Memo:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    shared: Shared = field(default_factory=Shared)
    scalers: dict[str, Autoscaler] = field(default_factory=dict)
    redis: dict[str, RedisHeartbeats] = field(default_factory=dict)
    last_actions: dict[str, str] = field(default_factory=dict)

    @property
    def client(self) -> KubeClient | None:
        return self.shared.client

    @property
    def stopping(self) -> bool:
        return self.shared.stopping


def _md_ref(body: Any) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    settings.posting.level = logging.WARNING      # our own Events are explicit (decisions, invalid specs)
    settings.execution.max_workers = 4
    # No namespace/CRD watching: the operator serves a fixed namespace list (or all) and
    # its one CRD, so RBAC needs no cluster-wide list/watch of namespaces and CRDs.
    settings.scanning.disabled = True
    settings.networking.error_backoffs = [1, 2, 5, 10]


@kopf.on.login(registry=registry)
def login(memo: Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    conn = memo.config.connection
    if conn is not None:
        info = kopf.ConnectionInfo(server=conn.server, token=conn.token, ca_path=conn.ca_path,
                                   insecure=conn.insecure or None, certificate_path=conn.certificate_path,
                                   private_key_path=conn.private_key_path)
    else:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        memo.shared.client = KubeClient(Connection.from_kopf(info), retries=memo.config.api_retries)
    return info


@kopf.on.cleanup(registry=registry)
async def cleanup(memo: Memo, **_: Any) -> None:
    memo.shared.stopping = True   # daemons spawned late in a shutdown exit on their next wake-up
    for source in memo.redis.values():
        await source.close()
    if memo.client is not None:
        await memo.client.close()


@kopf.on.probe(id="modeldeployments", registry=registry)
def probe(memo: Memo, **_: Any) -> int:
    return len(memo.scalers)


async def _write_status(memo: Memo, md: dict[str, Any], patch: dict[str, Any]) -> None:
    meta = md["metadata"]
    assert memo.client is not None
    await memo.client.patch_status(crd.KIND, meta["namespace"], meta["name"], patch)


async def _mark_invalid(memo: Memo, md: dict[str, Any], errors: list[str], reason: str = "InvalidSpec") -> None:
    previous = (md.get("status") or {}).get("conditions")
    gen = md["metadata"].get("generation")
    already = any(c.get("type") == "Ready" and c.get("reason") == reason and c.get("observedGeneration") == gen
                  and c.get("message") == "; ".join(errors) for c in previous or [])
    await _write_status(memo, md, {"observedGeneration": gen,
                                   "conditions": st.invalid_conditions(errors, gen, previous, st.now_iso(), reason)})
    if not already:
        kopf.warn(_md_ref(md), reason=reason, message="; ".join(errors)[:1000])


async def reconcile(memo: Memo, md: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Make the children match the spec (idempotent)."""
    assert memo.client is not None, "not logged in"
    meta = md["metadata"]
    spec = specs.apply_defaults(dict(md.get("spec") or {}))
    errors = specs.validate(meta["name"], spec)
    if errors:
        logger.warning(f"invalid spec: {errors}")
        await _mark_invalid(memo, md, errors)
        return
    children = render.render_children(md, spec, memo.config.images)
    try:
        for child in children:
            await memo.client.apply(child)
        await _prune(memo, md, children)
    except ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"applying children: {exc}", delay=5)
        # Rejected by the API server (e.g. a webhook or quota): report it, retry slowly (no hot loop).
        await _mark_invalid(memo, md, [f"the API server rejected a child: {exc.message}"], "ApplyFailed")
        raise kopf.TemporaryError(f"child rejected: {exc}", delay=memo.config.rejected_retry_delay)
    await refresh_status(memo, md, spec, observed=True)
    logger.info(f"reconciled {len(children)} children")


async def _prune(memo: Memo, md: dict[str, Any], children: list[dict[str, Any]]) -> None:
    """Delete children this ModelDeployment owns that are no longer rendered
    (e.g. the managed Redis after switching to an external one)."""
    assert memo.client is not None
    meta = md["metadata"]
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    selector = f"{render.LABEL_MD}={meta['name']}"
    for kind in PRUNED_KINDS:
        for obj in await memo.client.list(kind, meta["namespace"], selector):
            ometa = obj.get("metadata") or {}
            owned = any(ref.get("uid") == meta["uid"] for ref in ometa.get("ownerReferences") or [])
            if owned and (kind, ometa.get("name")) not in wanted:
                await memo.client.request("DELETE", object_path(kind, meta["namespace"], ometa["name"]))


async def refresh_status(memo: Memo, md: dict[str, Any], spec: dict[str, Any], *, observed: bool = False,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Derive status from the children and write it."""
    assert memo.client is not None
    meta = md["metadata"]
    ns, name = meta["namespace"], meta["name"]
    n = render.names(name)
    engine = await memo.client.get("Deployment", ns, n[render.ENGINE])
    router = await memo.client.get("Deployment", ns, n[render.ROUTER]) if spec["router"]["replicas"] > 0 else None
    redis = await memo.client.get("Deployment", ns, n[render.REDIS]) if spec["redis"]["mode"] == "managed" else None
    e = st.deployment_summary(engine)
    old = md.get("status") or {}
    gen = meta.get("generation") if observed else old.get("observedGeneration", meta.get("generation"))
    patch: dict[str, Any] = {
        "model": specs.served_model_name(spec),
        "replicas": e["replicas"],
        "readyReplicas": e["ready"],
        "selector": render.selector_string(name),
        "routerEndpoint": render.router_endpoint(name, ns),
        "conditions": st.derive_conditions(
            generation=gen, previous=old.get("conditions"), now=st.now_iso(), engine=e,
            router=st.deployment_summary(router) if spec["router"]["replicas"] > 0 else None,
            redis=st.deployment_summary(redis) if spec["redis"]["mode"] == "managed" else None),
    }
    sticky = [c for c in old.get("conditions") or [] if c.get("type") == "Ready"
              and c.get("reason") in ("ApplyFailed", "InvalidSpec")
              and c.get("observedGeneration") == meta.get("generation")]
    if sticky and not observed:
        del patch["conditions"]   # only a successful reconcile of this generation clears these
    if "autoscaling" not in spec or "desiredReplicas" not in old:
        # The autoscaler owns desiredReplicas once it exists (only tick() writes it then).
        patch["desiredReplicas"] = render.engine_replicas(spec, old)
    if observed:
        patch["observedGeneration"] = gen
    patch.update(extra or {})
    await _write_status(memo, md, patch)
    return patch


@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL, field="spec", registry=registry)
async def reconcile_handler(body: kopf.Body, memo: Memo, logger: Any, **_: Any) -> None:
    md = await memo.client.get(crd.KIND, body.metadata.namespace, body.metadata.name) if memo.client else None
    if md is None or md["metadata"].get("deletionTimestamp"):
        return
    await reconcile(memo, md, logger)


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


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry, cancellation_timeout=5.0)
async def autoscaler_daemon(stopped: kopf.DaemonStopped, meta: kopf.Meta, memo: Memo, logger: Any,
                            **_: Any) -> None:
    """One loop per ModelDeployment: status refresh and autoscaling."""
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
