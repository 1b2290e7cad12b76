"""The real operator (kopf runtime) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import base64
import datetime
import time

import redis.asyncio as aioredis

from kvmesh.common.redis_layout import demand_key
from kvmesh.operator import crd, render
from kvmesh.operator.metrics_source import heartbeat_key, pods_key
from kvmesh.operator.scaling import DELETION_COST
from tests.operator.conftest import (
    CONFIGMAPS,
    DEPLOYMENTS,
    JOBS,
    MD,
    NETPOLS,
    PDBS,
    PODS,
    PVCS,
    SECRETS,
    SERVICES,
    eventually,
    md_body,
)


class Heartbeats:
    """Writes sidecar heartbeats (contract 3 layout) into the real Redis."""

    def __init__(self, url, model):
        self.r = aioredis.Redis.from_url(url)
        self.model = model

    async def beat(self, pod, kv, state="ready", running=1, waiting=0, num_keys=None):
        await self.r.sadd(pods_key(self.model), pod)
        key = heartbeat_key(self.model, pod)
        extra = {} if num_keys is None else {"num_keys": num_keys}
        await self.r.hset(
            key,
            mapping={
                "url": f"http://{pod}:8000",
                "model": self.model,
                "kv_usage": kv,
                "running": running,
                "waiting": waiting,
                "total_blocks": 1000,
                "state": state,
                "ts": time.time(),
                **extra,
            },
        )
        await self.r.expire(key, 10)

    async def demand(self):
        """What a router holding requests at 0 replicas writes."""
        await self.r.set(demand_key(self.model), time.time(), ex=60)

    async def drop(self, pod):
        await self.r.delete(heartbeat_key(self.model, pod))

    async def close(self):
        await self.r.flushdb()
        await self.r.aclose()


def cond(obj, ctype):
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    raise AssertionError(f"no {ctype} condition in {obj.get('status')}")


async def add_pod(k8s, clock, name, ready=True, age=0.0, md="demo", ip="127.0.0.1"):
    """An engine pod as the ReplicaSet controller would create it (the emulator runs none);
    its creationTimestamp is on the operator's (fast-forwarded) clock."""
    created = datetime.datetime.fromtimestamp(clock.now - age, datetime.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    await k8s.put_object(
        PODS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "labels": render.labels(md, render.ENGINE),
                "creationTimestamp": created,
            },
            "status": {
                "phase": "Running" if ready else "Pending",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "podIP": ip,
            },
        },
    )


async def set_ready(k8s, name, ready=True):
    pod = k8s.fetch_object(PODS, "ns", name)
    pod["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    await k8s.put_object(PODS, pod)


def operator_requests(k8s, plural, method="GET", name=None, subresource=None):
    """The operator's API calls on one resource (from the emulator's request log), in order."""
    out = []
    for i, req in enumerate(list(k8s._requests)):
        if (
            req.resource is None
            or req.resource.plural != plural
            or req.params.get("watch") == "true"
        ):
            continue
        if not req.headers.get("User-Agent", "").startswith("kvmesh"):
            continue
        if (
            str(getattr(req.method, "value", req.method)).upper() == method
            and req.name == name
            and req.subresource == subresource
        ):
            out.append(i)
    return out


async def after_ticks(k8s, n=2, plural="pods", name=None):
    """Wait until the operator's loop has run ``n`` more full ticks (each autoscaling tick lists
    the engine pods once; pass plural=modeldeployments, name=... for other loops, which GET their
    ModelDeployment once a tick): proof that "nothing changed" is not a race with a slow tick."""
    start = len(operator_requests(k8s, plural, name=name))
    await eventually(
        lambda: len(operator_requests(k8s, plural, name=name)) >= start + n + 1, timeout=15
    )


async def mark_available(k8s, name, ready=None):
    dep = k8s.fetch_object(DEPLOYMENTS, "ns", name)
    n = dep["spec"]["replicas"] if ready is None else ready
    await k8s.patch_status(
        DEPLOYMENTS,
        "ns",
        name,
        {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": dep["spec"]["replicas"],
            "readyReplicas": n,
            "availableReplicas": n,
            "updatedReplicas": dep["spec"]["replicas"],
            "conditions": [{"type": "Available", "status": "True" if n else "False"}],
        },
    )


async def test_create_children_status_ready_and_delete(k8s, operator):
    await k8s.put_object(MD, md_body(replicas=2))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))  # the last child rendered
    md = k8s.fetch_object(MD, "ns", "demo")
    uid = md["metadata"]["uid"]
    names = {
        (k, o["metadata"]["name"])
        for k in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS)
        for o in k8s.list_objects(k, "ns")
    }
    assert names == {
        (DEPLOYMENTS, "demo-engine"),
        (DEPLOYMENTS, "demo-router"),
        (DEPLOYMENTS, "demo-redis"),
        (SERVICES, "demo-engine"),
        (SERVICES, "demo-router"),
        (SERVICES, "demo-redis"),
        (SECRETS, "demo-engine-api-key"),
        (SECRETS, "demo-redis-auth"),
        (NETPOLS, "demo-engine"),
        (NETPOLS, "demo-redis"),
        (PDBS, "demo-engine"),
    }
    for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS):
        for obj in k8s.list_objects(key, "ns"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 2
    await eventually(
        lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] == "NotAvailable"
    )
    assert cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["status"] == "False"

    for dep in ("demo-engine", "demo-router", "demo-redis"):
        await mark_available(k8s, dep)
    md = await eventually(
        lambda: (
            (m := k8s.fetch_object(MD, "ns", "demo")) and cond(m, "Ready")["status"] == "True" and m
        )
    )
    s = md["status"]
    assert s["readyReplicas"] == 2 and s["replicas"] == 2
    assert s["observedGeneration"] == md["metadata"]["generation"]
    assert s["selector"] == "app.kubernetes.io/component=engine,kvmesh.io/model-deployment=demo"
    assert s["routerEndpoint"] == "http://demo-router.ns.svc:8000"
    assert cond(md, "Degraded")["status"] == "False"

    await k8s.delete_object(MD, "ns", "demo")
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo") is None)
    # Garbage collection is asynchronous (a child a reconcile in flight applied after the owner
    # was gone is collected a moment later, as by the real garbage collector).
    await eventually(
        lambda: all(
            k8s.list_objects(key, "ns") == []
            for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS)
        )
    )


async def test_spec_update_updates_and_prunes_children(k8s, operator, redis_url):
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    engine_gen = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["metadata"]["generation"]

    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"].update(
        replicas=3, engine={"blockSize": 32}, redis={"mode": "external", "url": redis_url}
    )
    await k8s.put_object(MD, md)

    def updated():
        dep = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        return dep["spec"]["replicas"] == 3 and cmd[cmd.index("--block-size") + 1] == "32" and dep

    dep = await eventually(updated)
    assert dep["metadata"]["generation"] == engine_gen + 1
    # Managed Redis is gone; the URL Secret now carries the external URL.
    await eventually(
        lambda: (
            k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis") is None
            and k8s.fetch_object(SERVICES, "ns", "demo-redis") is None
        )
    )
    assert (
        base64.b64decode(k8s.fetch_object(SECRETS, "ns", "demo-redis-url")["data"]["url"]).decode()
        == redis_url
    )
    router = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-router")
    router_cmd = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router_cmd[router_cmd.index("--block-size") + 1] == "32"


async def test_scale_subresource_drives_engine_replicas(k8s, operator):
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    # What `kubectl scale md/demo --replicas=4` sends.
    async with k8s.servers[0].client.patch(
        "/apis/kvmesh.io/v1alpha1/namespaces/ns/modeldeployments/demo/scale",
        json={"spec": {"replicas": 4}},
        headers={"Content-Type": "application/merge-patch+json"},
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["spec"]["replicas"] == 4
    await eventually(
        lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 4
    )
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo")["status"]["desiredReplicas"] == 4)


async def test_invalid_spec_reports_condition_without_crashing(k8s, operator):
    bad = md_body(
        replicas=2,
        autoscaling={"minReplicas": 3, "maxReplicas": 2},
        redis={"mode": "external", "url": "redis://:secret@r:6379/0"},
    )
    await k8s.put_object(MD, bad)
    md = await eventually(
        lambda: (
            (m := k8s.fetch_object(MD, "ns", "demo"))
            and (m.get("status") or {}).get("conditions")
            and m
        )
    )
    ready = cond(md, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert (
        "must not carry credentials" in ready["message"]
        and "minReplicas must be <= " in ready["message"]
    )
    assert cond(md, "Degraded")["status"] == "True"
    assert k8s.list_objects(DEPLOYMENTS, "ns") == []
    await eventually(
        lambda: any(
            e.get("reason") == "InvalidSpec" and e["type"] == "Warning"
            for e in k8s.list_objects("v1/events", "ns")
        )
    )
    # Handled, not retried: no crash loop of the handler (status loop ticks meanwhile).
    await after_ticks(k8s, 2, plural=crd.PLURAL, name="demo")
    annotations = k8s.fetch_object(MD, "ns", "demo")["metadata"].get("annotations") or {}
    assert not any("retries" in v for k, v in annotations.items() if k.startswith("kvmesh.io/"))

    # Fixing the spec recovers.
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"].pop("autoscaling")
    md["spec"].pop("redis")
    await k8s.put_object(MD, md)
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    await eventually(
        lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] != "InvalidSpec"
    )


async def test_transient_api_errors_are_retried(k8s, operator):
    k8s.inject_fault("PATCH", r"/deployments/demo-router$", status=500, times=2)
    k8s.inject_fault("PATCH", r"/services/demo-engine$", status=429, times=1)
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"), timeout=15)
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-router") is not None
    assert all(f.times == 0 for f in k8s.faults)
    await eventually(
        lambda: k8s.fetch_object(MD, "ns", "demo")["status"].get("observedGeneration") == 1
    )


async def test_restart_changes_nothing(k8s, operator, redis_url, clock):
    await k8s.put_object(
        MD,
        md_body(
            autoscaling={
                "minReplicas": 1,
                "maxReplicas": 5,
                "intervalSeconds": 0.1,
                "targetKVUtilization": 0.5,
            }
        ),
    )
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    await add_pod(k8s, clock, "demo-engine-a")
    await hb.beat("demo-engine-a", 0.9)  # load 0.9 / target 0.5 -> 2 replicas
    await eventually(
        lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 2
    )
    await add_pod(k8s, clock, "demo-engine-b")
    await hb.beat("demo-engine-b", 0.45)
    await hb.beat("demo-engine-a", 0.45)  # steady: utilisation ~ target
    for dep in ("demo-engine", "demo-router", "demo-redis"):
        await mark_available(k8s, dep)
    await eventually(lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["status"] == "True")
    await eventually(
        lambda: k8s.fetch_object(MD, "ns", "demo")["status"]["lastDecision"]["action"] == "none"
    )

    def snapshot():
        return {
            (key, o["metadata"]["name"]): (
                o["metadata"]["resourceVersion"],
                o["metadata"].get("generation"),
                (o.get("spec") or {}).get("replicas"),
            )
            for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)
            for o in k8s.list_objects(key, "ns")
        }

    before = snapshot()
    await operator.stop()
    await hb.beat("demo-engine-b", 0.1)  # load dropped while the operator was down
    await hb.beat("demo-engine-a", 0.1)
    await operator.start()
    await after_ticks(k8s, 5)  # resume handler + several autoscaler ticks
    assert snapshot() == before  # no duplicate, no re-created, no re-scaled child
    assert k8s.fetch_object(MD, "ns", "demo")["spec"]["replicas"] == 2
    status = k8s.fetch_object(MD, "ns", "demo")["status"]
    assert status["desiredReplicas"] == 2
    assert (
        status["lastDecision"]["action"] == "hold"
    )  # a fresh scaler waits a full scale-down window
    assert status["lastDecision"]["recommendation"] == 1
    await hb.close()


async def test_liveness_endpoint(k8s, redis_url, clock):
    import aiohttp

    from tests.operator.conftest import OperatorRunner, _free_port

    port = _free_port()
    runner = OperatorRunner(k8s, redis_url, clock, liveness=f"http://127.0.0.1:{port}/healthz")
    await runner.start()
    try:

        async def probe():
            for _ in range(100):
                try:
                    async with (
                        aiohttp.ClientSession() as s,
                        s.get(f"http://127.0.0.1:{port}/healthz") as r,
                    ):
                        return r.status, await r.json()
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            raise AssertionError("liveness endpoint never came up")

        status, body = await probe()
        assert status == 200 and body.get("modeldeployments") == 0
    finally:
        await runner.stop()


def events(k8s, reason):
    return [e for e in k8s.list_objects("v1/events", "ns") if e.get("reason") == reason]


async def test_autoscaler_from_redis_heartbeats_across_windows(k8s, operator, redis_url, clock):
    await k8s.put_object(
        MD,
        md_body(
            autoscaling={
                "minReplicas": 1,
                "maxReplicas": 4,
                "targetKVUtilization": 0.5,
                "intervalSeconds": 0.1,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 60,
                "maxScaleDownStep": 1,
            }
        ),
    )
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    assert (
        k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 1
    )  # minReplicas
    engine = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"]  # noqa: E731
    template = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["template"]  # noqa: E731
    credentials = await eventually(
        lambda: template()["metadata"]["annotations"].get("kvmesh.io/credentials")
    )
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        # No heartbeats yet: hold.
        await eventually(lambda: md()["status"]["lastDecision"]["action"] == "hold")
        assert "no KV-utilisation metrics" in md()["status"]["lastDecision"]["reason"]
        assert engine() == 1

        # A heartbeat without a pod in the API adds no replica (and no load).
        await hb.beat("demo-engine-ghost", 1.0)
        await after_ticks(k8s)
        assert md()["status"]["lastDecision"]["action"] == "hold" and engine() == 1

        # One ready pod at 90% KV -> ceil(0.9 / 0.5) = 2, written to spec.replicas through /scale.
        await add_pod(k8s, clock, "demo-engine-a")
        await hb.beat("demo-engine-a", 0.9)
        await hb.beat("other-engine-z", 1.0)  # another deployment's pod on a shared Redis: ignored
        await eventually(lambda: engine() == 2)
        status = md()["status"]
        assert status["desiredReplicas"] == 2 and status["lastScaleTime"]
        assert md()["spec"]["replicas"] == 2
        decision = status["lastDecision"]
        assert (
            decision["readyReplicas"] == 1
            and decision["waitingRequests"] == 0
            and decision["stuckPods"] == []
        )
        # Scaling changed the replica count and nothing else: the engine pods do not roll.
        assert template()["metadata"]["annotations"]["kvmesh.io/credentials"] == credentials
        assert operator_requests(k8s, crd.PLURAL, "PATCH", "demo", "scale")
        await eventually(lambda: events(k8s, "ScaledUp"))
        assert "1 -> 2" in events(k8s, "ScaledUp")[0]["message"]

        # The new pod is starting (not Ready): it counts as requested capacity, no cascade.
        await add_pod(k8s, clock, "demo-engine-b", ready=False)
        await hb.beat("demo-engine-a", 1.0)
        clock.advance(5)
        await after_ticks(k8s)
        assert engine() == 2 and md()["spec"]["replicas"] == 2
        assert md()["status"]["kvUtilization"] == 1.0 and md()["status"]["kvPercent"] == 100

        # Both ready, load falls: scale-down waits for the 60 s window (fast-forwarded).
        await set_ready(k8s, "demo-engine-b")
        await hb.beat("demo-engine-a", 0.1)
        await hb.beat("demo-engine-b", 0.1)
        await eventually(lambda: md()["status"]["lastDecision"]["recommendation"] == 1)
        clock.advance(30)
        await after_ticks(k8s)
        assert engine() == 2
        await hb.beat("demo-engine-a", 0.1)
        await hb.beat("demo-engine-b", 0.1)
        clock.advance(31)
        await eventually(lambda: engine() == 1)
        assert md()["spec"]["replicas"] == 1
        await eventually(lambda: events(k8s, "ScaledDown"))
        assert "2 -> 1" in events(k8s, "ScaledDown")[0]["message"]
        await k8s.delete_object(PODS, "ns", "demo-engine-b")

        # Heartbeats vanish (Redis lost them): hold at the current count.
        await hb.drop("demo-engine-a")
        await hb.drop("demo-engine-b")
        clock.advance(120)
        await eventually(lambda: md()["status"]["lastDecision"]["action"] == "hold")
        assert engine() == 1
    finally:
        await hb.close()


async def test_operator_uses_exactly_its_rbac(k8s, operator, clock):
    """Create, switch to an external Redis from a Secret (prunes the managed Redis and the
    URL Secret), scale (through /scale, the pods' deletion cost first), delete: every
    permission of the ClusterRole is exercised, and (the fixture checks) nothing beyond it."""
    from kvmesh.operator.manifests import RBAC_RULES
    from tests.operator.conftest import used_permissions

    await k8s.put_object(
        "v1/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "shared", "namespace": "ns"},
            "data": {"url": "cmVkaXM6Ly8xMjcuMC4wLjE6MS8w"},
        },
    )
    await add_pod(k8s, clock, "demo-engine-a")
    await add_pod(k8s, clock, "demo-engine-b")
    # spec.replicas above maxReplicas: the bounds scale it down at once (pods annotated, then /scale).
    await k8s.put_object(
        MD, md_body(replicas=3, autoscaling={"maxReplicas": 2, "intervalSeconds": 0.1})
    )
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo")["spec"]["replicas"] == 2)
    await eventually(lambda: events(k8s, "AutoscalerHold"))
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["redis"] = {"mode": "external", "secretRef": {"name": "shared"}}
    await k8s.put_object(MD, md)
    await eventually(
        lambda: (
            k8s.fetch_object(SECRETS, "ns", "demo-redis-auth") is None
            and k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis") is None
        )
    )
    # A Hugging Face model on the shared cache (claim + fetch Job), an inline external URL
    # (the operator's URL Secret), two routers (their budget), LoRA (the adapter list); then
    # back, which prunes them.
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["model"] = {"huggingFace": {"repoId": "org/m", "sharedCache": {"enabled": True}}}
    md["spec"]["redis"] = {"mode": "external", "url": "redis://127.0.0.1:1/0"}
    md["spec"]["router"] = {"replicas": 2}
    md["spec"]["lora"] = {}
    await k8s.put_object(MD, md)
    await eventually(
        lambda: (
            k8s.list_objects(JOBS, "ns")
            and k8s.fetch_object(PVCS, "ns", "demo-model-cache")
            and k8s.fetch_object(SECRETS, "ns", "demo-redis-url")
            and k8s.fetch_object(PDBS, "ns", "demo-router")
            and k8s.fetch_object(CONFIGMAPS, "ns", "demo-adapters")
        )
    )
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["model"] = {"builtin": "smollm2-135m-instruct"}
    md["spec"]["router"] = {"replicas": 1}
    del md["spec"]["lora"]
    await k8s.put_object(MD, md)
    await eventually(
        lambda: (
            not k8s.list_objects(JOBS, "ns")
            and not k8s.list_objects(PVCS, "ns")
            and k8s.fetch_object(PDBS, "ns", "demo-router") is None
            and not k8s.list_objects(CONFIGMAPS, "ns")
        )
    )
    granted = {
        (g, r, v)
        for rule in RBAC_RULES
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    never_used = {
        ("networking.k8s.io", "networkpolicies", "delete"),  # prune-only, never pruned here
        # held only to grant it to the routers' Role (RBAC's escalation check)
        ("discovery.k8s.io", "endpointslices", "get"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
    }
    # The autoscaler's next ticks read the Redis URL from the user's Secret.
    try:
        await eventually(lambda: granted - used_permissions(k8s) <= never_used, timeout=3)
    except AssertionError:
        raise AssertionError(sorted(granted - used_permissions(k8s) - never_used)) from None
    unused = granted - used_permissions(k8s)
    assert unused <= never_used, unused


async def test_rejected_child_reports_apply_failed_then_recovers(k8s, operator):
    k8s.inject_fault(
        "PATCH", r"/networkpolicies/demo-engine$", status=422, times=3
    )  # e.g. a webhook
    await k8s.put_object(MD, md_body(replicas=1))
    md = await eventually(
        lambda: (
            (m := k8s.fetch_object(MD, "ns", "demo"))
            and cond(m, "Ready")["reason"] == "ApplyFailed"
            and m
        )
    )
    ready = cond(md, "Ready")
    assert ready["status"] == "False" and cond(md, "Degraded")["status"] == "True"
    assert "rejected" in ready["message"]
    # Status refreshes (every 0.2 s here) keep the condition for as long as the child is
    # missing; the retries (test-short delay) then create it and the condition clears.
    seen = []

    def recovered():
        reason = cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"]
        missing = k8s.fetch_object(NETPOLS, "ns", "demo-engine") is None
        seen.append((missing, reason))
        return not missing and reason != "ApplyFailed"

    await eventually(recovered, timeout=15)
    assert all(reason == "ApplyFailed" for missing, reason in seen if missing), seen
    assert sum(missing for missing, _ in seen) >= 3  # it was watched while the child was missing


async def test_drift_is_healed_within_seconds(k8s, operator):
    """Children are reconciled continuously: a deleted child comes back, a hand edit of a
    field the operator renders is put back (watch-triggered, not the periodic resync)."""
    await k8s.put_object(MD, md_body(replicas=2))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))
    rendered_image = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]
    credentials = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["template"][
        "metadata"
    ]["annotations"]["kvmesh.io/credentials"]

    for key, name in (
        (DEPLOYMENTS, "demo-engine"),
        (SERVICES, "demo-engine"),
        (SECRETS, "demo-engine-api-key"),
        (NETPOLS, "demo-engine"),
        (PDBS, "demo-engine"),
    ):
        old_uid = k8s.fetch_object(key, "ns", name)["metadata"]["uid"]
        await k8s.delete_object(key, "ns", name)
        await eventually(
            lambda: (o := k8s.fetch_object(key, "ns", name)) and o["metadata"]["uid"] != old_uid,
            timeout=5,
        )

    # The engine key was made anew: engines and routers roll together onto it.
    def annotation(dep):
        return k8s.fetch_object(DEPLOYMENTS, "ns", dep)["spec"]["template"]["metadata"][
            "annotations"
        ].get("kvmesh.io/credentials")

    await eventually(
        lambda: annotation("demo-engine") == annotation("demo-router") != credentials, timeout=5
    )

    dep = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
    dep["spec"]["replicas"] = 7
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "attacker/engine:latest"
    await k8s.put_object(DEPLOYMENTS, dep)

    def restored():
        d = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
        return (
            d["spec"]["replicas"] == 2
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == rendered_image
        )

    await eventually(restored, timeout=5)
    # The resync interval (60 s here) is far longer than the waits above: the watch did it.
    assert operator.config.resync_interval >= 30


async def test_children_of_another_owner_are_left_alone(k8s, operator, monkeypatch):
    """A labelled object that this ModelDeployment does not own is neither healed nor pruned.
    (tests/operator/test_prune_safety.py: every kind of not belonging, every trigger.)"""
    from tests.operator.test_prune_safety import PruneCounter

    prunes = PruneCounter(monkeypatch)
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))
    stranger = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "demo-extra",
            "namespace": "ns",
            "labels": {"kvmesh.io/model-deployment": "demo"},
        },
        "spec": {"ports": [{"port": 80}]},
    }
    await k8s.put_object(SERVICES, stranger)
    since = prunes.passes
    # Trigger reconciles through two real drifts, each healed.
    for key in (SERVICES, NETPOLS):
        old_uid = k8s.fetch_object(key, "ns", "demo-engine")["metadata"]["uid"]
        await k8s.delete_object(key, "ns", "demo-engine")
        await eventually(
            lambda: (
                (o := k8s.fetch_object(key, "ns", "demo-engine"))
                and o["metadata"]["uid"] != old_uid
            ),
            timeout=5,
        )
    # Reconciles run one at a time: the second complete prune since the stranger came began
    # after it existed.
    await prunes.more(2, since=since)
    assert k8s.fetch_object(SERVICES, "ns", "demo-extra") is not None


# -- autoscaling: startup deadline, scale to zero, deletion cost, external mode ------------------


def auto(**kw):
    return {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetKVUtilization": 0.5,
        "intervalSeconds": 0.1,
        "scaleDownStabilizationSeconds": 60,
        **kw,
    }


async def test_pod_not_ready_past_the_startup_timeout_is_reported_and_not_counted(
    k8s, operator, redis_url, clock
):
    await k8s.put_object(MD, md_body(replicas=2, autoscaling=auto(startupTimeoutSeconds=60)))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        await add_pod(k8s, clock, "demo-engine-a")
        await add_pod(k8s, clock, "demo-engine-b", ready=False)  # e.g. unschedulable: no free GPU
        await hb.beat("demo-engine-a", 0.9)  # over the 2 requested replicas: 0.45, on target
        await eventually(lambda: md()["status"]["lastDecision"]["action"] == "none")
        await after_ticks(k8s)
        assert md()["spec"]["replicas"] == 2
        assert cond(md(), "Degraded")["reason"] != "ReplicasNotStarting"

        clock.advance(
            61
        )  # b is past its startup deadline: 1 serving replica at 90% needs 2, + b's slot
        await eventually(lambda: md()["spec"]["replicas"] == 3)
        await eventually(
            lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 3
        )
        degraded = await eventually(
            lambda: (c := cond(md(), "Degraded"))["reason"] == "ReplicasNotStarting" and c
        )
        assert degraded["status"] == "True" and "demo-engine-b" in degraded["message"]
        assert "demo-engine-a" not in degraded["message"]
        warning = await eventually(lambda: events(k8s, "ReplicasNotStarting"))
        assert warning[0]["type"] == "Warning" and "demo-engine-b" in warning[0]["message"]
        assert "demo-engine-b" in md()["status"]["lastDecision"]["reason"]

        await set_ready(k8s, "demo-engine-b")  # it started after all: the condition clears
        await eventually(lambda: cond(md(), "Degraded")["reason"] != "ReplicasNotStarting")
        assert len(events(k8s, "ReplicasNotStarting")) == 1  # one Warning per change of the set
    finally:
        await hb.close()


async def test_scale_to_zero_when_idle_and_back_on_a_routers_demand(
    k8s, operator, redis_url, clock
):
    await k8s.put_object(
        MD,
        md_body(
            replicas=1,
            autoscaling=auto(
                minReplicas=0,
                maxReplicas=2,
                scaleToZeroIdleSeconds=30,
                scaleUpStabilizationSeconds=120,
            ),
        ),
    )
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    engine = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"]  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        await add_pod(k8s, clock, "demo-engine-a")
        await hb.beat("demo-engine-a", 0.1, running=1)
        await eventually(lambda: "KV utilisation 0.10" in md()["status"]["lastDecision"]["reason"])
        clock.advance(40)  # a request is running: never idle, however long
        await after_ticks(k8s)
        assert md()["spec"]["replicas"] == 1 and engine() == 1

        await hb.beat("demo-engine-a", 0.0, running=0, waiting=0)
        await after_ticks(k8s)  # idle from here on
        assert md()["spec"]["replicas"] == 1
        clock.advance(31)
        await eventually(lambda: md()["spec"]["replicas"] == 0)
        await eventually(lambda: engine() == 0)
        assert "scaling to zero" in md()["status"]["lastDecision"]["reason"]
        await k8s.delete_object(PODS, "ns", "demo-engine-a")
        await hb.drop("demo-engine-a")

        clock.advance(600)  # no demand: stays at zero
        await after_ticks(k8s)
        assert md()["spec"]["replicas"] == 0 and md()["status"]["lastDecision"]["action"] == "none"

        await hb.demand()  # a router holds a request: back to 1 at once
        await eventually(
            lambda: md()["spec"]["replicas"] == 1
        )  # (the clock did not move: no window)
        await eventually(lambda: engine() == 1)
        await eventually(
            lambda: any("scaling from zero" in e["message"] for e in events(k8s, "ScaledUp"))
        )
    finally:
        await hb.close()


async def test_scale_down_sets_pod_deletion_costs_before_lowering_replicas(
    k8s, operator, redis_url, clock
):
    await k8s.put_object(MD, md_body(replicas=3, autoscaling=auto(startupTimeoutSeconds=60)))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        for pod in ("demo-engine-a", "demo-engine-b", "demo-engine-c"):
            await add_pod(k8s, clock, pod)
        await add_pod(
            k8s, clock, "demo-engine-d", ready=False, age=120
        )  # stuck (a surge that never started)
        await hb.beat("demo-engine-a", 0.05, running=0, num_keys=500)  # most cached blocks, idle
        await hb.beat("demo-engine-b", 0.05, running=0, num_keys=10)  # cheapest ready pod
        await hb.beat("demo-engine-c", 0.05, running=2, num_keys=100)  # busy
        await eventually(lambda: md()["status"]["lastDecision"]["recommendation"] == 1)
        assert not operator_requests(
            k8s, "pods", "PATCH", "demo-engine-b"
        )  # nothing before a scale-down
        clock.advance(61)
        await eventually(lambda: md()["spec"]["replicas"] == 2)
        costs = {
            p: (k8s.fetch_object(PODS, "ns", p)["metadata"].get("annotations") or {}).get(
                DELETION_COST
            )
            for p in ("demo-engine-a", "demo-engine-b", "demo-engine-c", "demo-engine-d")
        }
        assert costs == {
            "demo-engine-a": "500",
            "demo-engine-b": "10",
            "demo-engine-c": "2100",
            "demo-engine-d": "-1000",
        }
        # Annotated before spec.replicas went down (the ReplicaSet reads the costs when it scales).
        last_annotation = max(operator_requests(k8s, "pods", "PATCH", p)[-1] for p in costs)
        first_scale = operator_requests(k8s, crd.PLURAL, "PATCH", "demo", "scale")[0]
        assert last_annotation < first_scale
    finally:
        await hb.close()


async def test_external_mode_never_writes_spec_replicas(k8s, operator, redis_url, clock):
    await k8s.put_object(MD, md_body(replicas=1, autoscaling=auto(mode="external")))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        await add_pod(k8s, clock, "demo-engine-a")
        await hb.beat("demo-engine-a", 1.0, waiting=30)  # builtin would scale this up
        await eventually(
            lambda: md()["status"].get("kvUtilization") == 1.0
        )  # status still refreshed
        clock.advance(60)
        await after_ticks(k8s, 3)
        assert md()["spec"]["replicas"] == 1 and "lastDecision" not in md()["status"]
        assert not operator_requests(k8s, crd.PLURAL, "PATCH", "demo", "scale")

        # What an HPA does: the /scale target moves; the engines follow; the operator leaves it.
        async with k8s.servers[0].client.patch(
            "/apis/kvmesh.io/v1alpha1/namespaces/ns/modeldeployments/demo/scale",
            json={"spec": {"replicas": 3}},
            headers={"Content-Type": "application/merge-patch+json"},
        ) as resp:
            assert resp.status == 200
        await eventually(
            lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 3
        )
        await hb.beat("demo-engine-a", 0.0, waiting=0)
        clock.advance(600)
        await after_ticks(k8s, 3)
        assert md()["spec"]["replicas"] == 3
        assert not operator_requests(k8s, crd.PLURAL, "PATCH", "demo", "scale")
    finally:
        await hb.close()


async def test_requests_waiting_at_the_routers_count_as_demand_for_replicas(
    k8s, operator, redis_url, clock
):
    """Flow control holds requests at the routers while every replica is saturated: the
    engines' queues stay short, and the routers' published queue depth is what asks for more
    replicas (as the engines' waiting count would)."""
    from kvmesh.common import redis_layout as rl

    await k8s.put_object(MD, md_body(autoscaling=auto(scaleUpStabilizationSeconds=0)))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    engine = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"]  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    key = rl.flow_queued_key("smollm2-135m-instruct")
    try:
        await add_pod(k8s, clock, "demo-engine-a")
        await hb.beat("demo-engine-a", 0.5, running=4, waiting=0)  # KV on target, no engine queue
        await eventually(lambda: "KV utilisation 0.50" in md()["status"]["lastDecision"]["reason"])
        assert engine() == 1
        # two routers hold 6 + 5 requests (and a stale entry and junk count nothing)
        now = time.time()
        await hb.r.hset(key, "router-1", rl.queued_entry(6, now))
        await hb.r.hset(key, "router-2", rl.queued_entry(5, now))
        await hb.r.hset(key, "router-old", rl.queued_entry(400, now - 60))
        await hb.r.hset(key, "junk", "lots")
        await hb.beat("demo-engine-a", 0.5, running=4, waiting=0)
        clock.advance(5)  # past the last recommendation (1), into a new scale-up window
        await eventually(lambda: engine() == 3)  # ceil(11 waiting / 4 per replica)
        assert md()["status"]["lastDecision"]["waitingRequests"] == 11
    finally:
        await hb.close()
