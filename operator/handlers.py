"""kopf handlers for ModelDeployment.

* create / update(spec) / resume -> :func:`reconcile`: default + validate the spec,
  render the children, server-side apply them, prune children no longer rendered,
  write status. An invalid spec gives ``Ready=False`` (reason ``InvalidSpec``) and an
  Event, never an exception loop; transient API errors are retried by kopf with backoff.
* one daemon per ModelDeployment -> :func:`kvmesh.operator.scaling.tick` every
  ``intervalSeconds``: status from the children and, with ``spec.autoscaling``, one
  autoscaler decision (recorded in status and as an Event). The loop lives in
  ``scaling.py``; it is registered here, with every other handler.

The handlers are registered in :data:`registry` (not kopf's global one), and share
state through kopf's ``memo`` (:class:`Memo`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import kopf

from kvmesh.operator import adapter_sync, crd, render, scaling
from kvmesh.operator import spec as specs
from kvmesh.operator import status as st
from kvmesh.operator.apply import ApiError, ApplyConflict, Connection, KubeClient
from kvmesh.operator.generated_secrets import ensure_generated_secrets
from kvmesh.operator.memo import Memo
from kvmesh.operator.status_write import refresh_status, write_status

registry = kopf.OperatorRegistry()
ANNOTATION_PREFIX = "kvmesh.io"
PRUNED_KINDS = (
    "Deployment",
    "Service",
    "Secret",
    "ConfigMap",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Job",
    "PersistentVolumeClaim",
)  # the router's ServiceAccount/Role/RoleBinding are always rendered
# The same kinds as kopf resource selectors: their changes trigger a reconcile of the owner.
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("v1", "services"),
    ("v1", "secrets"),
    ("v1", "configmaps"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("v1", "persistentvolumeclaims"),
    ("batch", "v1", "jobs"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
)


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    settings.posting.level = (
        logging.WARNING
    )  # our own Events are explicit (decisions, invalid specs)
    settings.execution.max_workers = 4
    # No namespace/CRD watching: the operator serves a fixed namespace list (or all) and
    # its one CRD, so RBAC needs no cluster-wide list/watch of namespaces and CRDs.
    settings.scanning.disabled = True
    settings.networking.error_backoffs = [1, 2, 5, 10]
    # A watch that silently stalls (a dropped connection a proxy keeps open) is restarted:
    # the server closes each watch after server_timeout, the client gives up after client_timeout.
    settings.watching.server_timeout = int(memo.config.watch_server_timeout)
    settings.watching.client_timeout = memo.config.watch_client_timeout
    settings.watching.connect_timeout = memo.config.watch_connect_timeout
    # Children are watched through the API server's label selector: the operator only ever
    # receives objects it labelled (never, say, every Secret of a namespace).
    for resource in CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = render.LABEL_MD


@kopf.on.login(registry=registry)
async def login(memo: Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    conn = memo.config.connection
    if conn is not None:
        info = kopf.ConnectionInfo(
            server=conn.server,
            token=conn.token,
            ca_path=conn.ca_path,
            ca_data=conn.ca_data,
            insecure=conn.insecure or None,
            certificate_path=conn.certificate_path,
            certificate_data=conn.certificate_data,
            private_key_path=conn.private_key_path,
            private_key_data=conn.private_key_data,
        )
    else:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        # A re-login (e.g. after a 401 with a rotated token) replaces the client; the old
        # one's connections and threads are released.
        old, memo.shared.client = (
            memo.shared.client,
            KubeClient(Connection.from_kopf(info), retries=memo.config.api_retries),
        )
        if old is not None:
            await old.close()
    return info


@kopf.on.cleanup(registry=registry)
async def cleanup(memo: Memo, **_: Any) -> None:
    memo.shared.stopping = True  # daemons spawned late in a shutdown exit on their next wake-up
    for source in memo.redis.values():
        await source.close()
    if memo.client is not None:
        await memo.client.close()


@kopf.on.probe(id="modeldeployments", registry=registry)
def probe(memo: Memo, **_: Any) -> int:
    return len(memo.scalers)


async def _mark_invalid(
    memo: Memo, md: dict[str, Any], errors: list[str], reason: str = "InvalidSpec"
) -> None:
    previous = (md.get("status") or {}).get("conditions")
    gen = md["metadata"].get("generation")
    already = any(
        c.get("type") == "Ready"
        and c.get("reason") == reason
        and c.get("observedGeneration") == gen
        and c.get("message") == "; ".join(errors)
        for c in previous or []
    )
    await write_status(
        memo,
        md,
        {
            "observedGeneration": gen,
            "conditions": st.invalid_conditions(errors, gen, previous, st.now_iso(), reason),
        },
    )
    if not already:
        kopf.warn(crd.object_ref(md), reason=reason, message="; ".join(errors)[:1000])


async def reconcile(
    memo: Memo,
    md: dict[str, Any],
    logger: logging.Logger | logging.LoggerAdapter,
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Make the children match the spec (idempotent). ``should_stop`` is asked before each
    write, so a reconcile whose ModelDeployment is being deleted stops creating children.

    One reconcile of a ModelDeployment at a time (the create/update handler and the healer
    daemon run concurrently otherwise): an older spec's prune could delete what a newer
    spec's reconcile has just applied. One that had to wait re-reads the ModelDeployment."""
    assert memo.client is not None, "not logged in"
    meta = md["metadata"]
    lock = memo.shared.reconcile_locks.get(meta["uid"])
    if lock is None:
        lock = memo.shared.reconcile_locks[meta["uid"]] = asyncio.Lock()
    waited = lock.locked()
    async with lock:
        if waited:
            fresh = await memo.client.get(crd.KIND, meta["namespace"], meta["name"])
            if (
                fresh is None
                or fresh["metadata"].get("deletionTimestamp")
                or fresh["metadata"].get("uid") != meta["uid"]
            ):
                return
            md = fresh
        await _reconcile(memo, md, logger, should_stop)


async def _reconcile(
    memo: Memo,
    md: dict[str, Any],
    logger: logging.Logger | logging.LoggerAdapter,
    should_stop: Callable[[], bool],
) -> None:
    assert memo.client is not None, "not logged in"
    meta = md["metadata"]
    spec = specs.apply_defaults(dict(md.get("spec") or {}))
    errors = specs.validate(meta["name"], spec)
    if errors:
        logger.warning(f"invalid spec: {errors}")
        await _mark_invalid(memo, md, errors)
        return
    try:
        credentials = await ensure_generated_secrets(memo, md, spec)
        children = render.render_children(md, spec, memo.config.images, credentials)
        conflicts = []
        for child in children:
            if should_stop():
                return
            conflict = await _apply_child(memo, md, spec, child)
            if conflict:
                conflicts.append(conflict)
        if conflicts:
            memo.shared.conflicts[meta["uid"]] = "; ".join(conflicts)
        else:
            memo.shared.conflicts.pop(meta["uid"], None)
        await _prune(memo, md, children, keep=render.generated_secret_names(meta["name"], spec))
    except ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"applying children: {exc}", delay=5)
        # Rejected by the API server (e.g. a webhook or quota): report it, retry slowly (no hot loop).
        await _mark_invalid(
            memo, md, [f"the API server rejected a child: {exc.message}"], "ApplyFailed"
        )
        raise kopf.TemporaryError(f"child rejected: {exc}", delay=memo.config.rejected_retry_delay)
    await refresh_status(memo, md, spec, observed=True)
    logger.info(f"reconciled {len(children)} children")


def _shares_replicas(spec: dict[str, Any], child: dict[str, Any]) -> bool:
    """The engine Deployment's replica count under external autoscaling: an HPA or KEDA
    may legitimately own it, so the operator applies it without force."""
    return (
        child["kind"] == "Deployment"
        and child["metadata"]["labels"].get(render.LABEL_COMPONENT) == render.ENGINE
        and (spec.get("autoscaling") or {}).get("mode") == "external"
    )


async def _apply_child(
    memo: Memo, md: dict[str, Any], spec: dict[str, Any], child: dict[str, Any]
) -> str | None:
    """Server-side apply one child. Every field the operator renders is re-asserted with
    force (hand edits are drift and are healed), except where another manager may own a
    field: there a conflict is reported (returned) and the field is left to its owner."""
    assert memo.client is not None
    if not _shares_replicas(spec, child):
        await memo.client.apply(child)
        return None
    try:
        await memo.client.apply(child, force=False)
        return None
    except ApplyConflict as exc:
        # Apply the rest without the contested replica count, still without force.
        released = {**child, "spec": {k: v for k, v in child["spec"].items() if k != "replicas"}}
        try:
            await memo.client.apply(released, force=False)
        except ApplyConflict as again:
            return f"{child['kind']} {child['metadata']['name']}: {again.message}"
        return f"{child['kind']} {child['metadata']['name']}: {exc.message}"


async def _prune(
    memo: Memo, md: dict[str, Any], children: list[dict[str, Any]], keep: list[str] = ()
) -> None:
    """Delete children this ModelDeployment controls that are no longer rendered
    (e.g. the managed Redis after switching to an external one).

    The label only narrows the listing: an object is pruned only when its *controller*
    owner reference carries this ModelDeployment's uid (what the operator renders). A
    labelled object with no owner, another owner, a stale owner of the same name (another
    uid), or this ModelDeployment as a mere co-owner under another controller is left alone."""
    assert memo.client is not None
    meta = md["metadata"]
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children} | {("Secret", n) for n in keep}
    selector = f"{render.LABEL_MD}={meta['name']}"
    doomed = []
    for kind in PRUNED_KINDS:
        for obj in await memo.client.list(kind, meta["namespace"], selector):
            ometa = obj.get("metadata") or {}
            controlled = any(
                ref.get("controller") is True and ref.get("uid") == meta["uid"]
                for ref in ometa.get("ownerReferences") or []
            )
            if controlled and (kind, ometa.get("name")) not in wanted:
                doomed.append((kind, ometa["name"]))
    if not doomed:
        return
    # The spec these children were rendered from must still be the current one: after a
    # change (a Redis mode switched back, a /scale write) the newer generation's own
    # reconcile prunes, and nothing a newer spec wants is deleted by an older one.
    current = await memo.client.get(crd.KIND, meta["namespace"], meta["name"])
    if current is None or current["metadata"].get("generation") != meta.get("generation"):
        return
    for kind, name in doomed:
        await memo.client.delete(kind, meta["namespace"], name)


@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL, registry=registry)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL, field="spec", registry=registry)
async def reconcile_handler(body: kopf.Body, memo: Memo, logger: Any, **_: Any) -> None:
    md = (
        await memo.client.get(crd.KIND, body.metadata.namespace, body.metadata.name)
        if memo.client
        else None
    )
    if md is None or md["metadata"].get("deletionTimestamp"):
        return
    await reconcile(memo, md, logger)


@kopf.daemon(
    crd.GROUP,
    crd.VERSION,
    crd.PLURAL,
    registry=registry,
    cancellation_backoff=1.0,
    cancellation_timeout=5.0,
)
async def autoscaler_daemon(
    stopped: kopf.DaemonStopped, meta: kopf.Meta, memo: Memo, logger: Any, **_: Any
) -> None:
    """One loop per ModelDeployment: status refresh and autoscaling (scaling.run_loop)."""
    await scaling.run_loop(stopped, meta, memo, logger)


# --- Adapters: loaded and unloaded on the running replicas, never by a rollout. ---


async def _sync_adapters(memo: Memo, namespace: str, name: str, logger: Any) -> None:
    md = await memo.client.get(crd.KIND, namespace, name) if memo.client else None
    if md is None or md["metadata"].get("deletionTimestamp"):
        return
    spec = specs.apply_defaults(dict(md.get("spec") or {}))
    if specs.validate(name, spec):
        return  # reconcile reports it
    await adapter_sync.sync(memo, md, spec, logger)


@kopf.on.field(crd.GROUP, crd.VERSION, crd.PLURAL, field="spec.adapters", registry=registry)
@kopf.on.field(
    crd.GROUP, crd.VERSION, crd.PLURAL, field="spec.engine.loraModules", registry=registry
)
async def adapters_changed(body: kopf.Body, memo: Memo, logger: Any, **_: Any) -> None:
    """An adapter added or removed: load or unload it on the ready replicas now."""
    try:
        await _sync_adapters(memo, body.metadata.namespace, body.metadata.name, logger)
    except (ApiError, OSError) as exc:
        raise kopf.TemporaryError(f"syncing adapters: {exc}", delay=5)


@kopf.daemon(
    crd.GROUP,
    crd.VERSION,
    crd.PLURAL,
    registry=registry,
    id="adapters",
    cancellation_backoff=1.0,
    cancellation_timeout=5.0,
)
async def adapter_daemon(
    stopped: kopf.DaemonStopped, meta: kopf.Meta, memo: Memo, logger: Any, **_: Any
) -> None:
    """One loop per ModelDeployment: repair what the replicas serve (a restarted engine, a
    new replica, a fetch that finished) and refresh the adapters' status."""
    try:
        while not stopped and not memo.stopping:
            try:
                await _sync_adapters(memo, meta["namespace"], meta["name"], logger)
            except (ApiError, OSError, TimeoutError) as exc:
                if memo.stopping:
                    break
                logger.warning(f"adapter sync failed: {exc}")
            await scaling.pause(stopped, memo, memo.config.adapter_interval)
    finally:
        memo.adapters.pop(meta.get("uid"), None)


# --- Healing: children are reconciled continuously, not only on spec changes. ---


def _fingerprint(body: Any) -> str:
    """What a change of a child means: everything but status and bookkeeping metadata."""
    meta = dict(body.get("metadata") or {})
    keep = {k: meta.get(k) for k in ("labels", "annotations", "ownerReferences")}
    rest = {k: v for k, v in body.items() if k not in ("metadata", "status")}
    return json.dumps([keep, rest], sort_keys=True, default=str)


def _owner(body: Any) -> tuple[str, str] | None:
    meta = body.get("metadata") or {}
    name = (meta.get("labels") or {}).get(render.LABEL_MD)
    owned = any(
        ref.get("kind") == crd.KIND and ref.get("controller")
        for ref in meta.get("ownerReferences") or []
    )
    return (meta.get("namespace"), name) if name and owned else None


def _child_event(event: dict[str, Any], memo: Memo, **_: Any) -> None:
    """A child was deleted or changed by someone: reconcile its ModelDeployment now.
    Status-only changes (a Deployment's rollout progress) are not drift and are ignored."""
    body = event.get("object") or {}
    owner = _owner(body)
    uid = (body.get("metadata") or {}).get("uid")
    if owner is None or uid is None:
        return
    fingerprint = _fingerprint(body)
    if event.get("type") == "DELETED":
        memo.shared.fingerprints.pop(uid, None)
    elif memo.shared.fingerprints.get(uid) == fingerprint:
        return
    else:
        first_sight = uid not in memo.shared.fingerprints
        memo.shared.fingerprints[uid] = fingerprint
        if first_sight and event.get("type") is None:
            return  # the initial listing: the resume handler reconciles everything anyway
    memo.shared.dirty.setdefault(owner, asyncio.Event()).set()


for _resource in CHILD_RESOURCES:
    kopf.on.event(
        *_resource,
        registry=registry,
        labels={render.LABEL_MD: kopf.PRESENT},
        id=f"heal-{_resource[-1]}",
    )(_child_event)


@kopf.daemon(
    crd.GROUP,
    crd.VERSION,
    crd.PLURAL,
    registry=registry,
    id="healer",
    cancellation_backoff=3.0,
    cancellation_timeout=5.0,
)
async def healer_daemon(
    stopped: kopf.DaemonStopped, meta: kopf.Meta, memo: Memo, logger: Any, **_: Any
) -> None:
    """One loop per ModelDeployment: reconcile when a child drifted, and every resync interval."""
    key = (meta["namespace"], meta["name"])
    dirty = memo.shared.dirty.setdefault(key, asyncio.Event())
    delay = 1.0
    try:
        loop = asyncio.get_running_loop()
        while not stopped and not memo.stopping:
            deadline = loop.time() + memo.config.resync_interval
            while not (stopped or memo.stopping or dirty.is_set()) and loop.time() < deadline:
                # short waits: a stopped daemon exits within a fraction of a second
                await scaling.wait_event(dirty, min(0.25, max(deadline - loop.time(), 0.01)))
            if dirty.is_set():
                await asyncio.sleep(memo.config.heal_debounce)
            if stopped or memo.stopping:
                break
            dirty.clear()
            try:
                md = await memo.client.get(crd.KIND, *key) if memo.client else None
                if md is None or md["metadata"].get("deletionTimestamp"):
                    break
                await reconcile(
                    memo, md, logger, should_stop=lambda: bool(stopped) or memo.stopping
                )
                delay = 1.0
            except (TimeoutError, kopf.TemporaryError, ApiError, OSError) as exc:
                if memo.stopping:
                    break
                wait = max(
                    delay, float(getattr(exc, "delay", None) or 0)
                )  # a rejected child: slow retry
                logger.warning(f"healing reconcile failed, retrying in {wait:.0f}s: {exc}")
                await scaling.pause(stopped, memo, wait)
                delay = min(delay * 2, 60.0)
                dirty.set()
    finally:
        memo.shared.dirty.pop(key, None)
