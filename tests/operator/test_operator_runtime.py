"""The real operator (kopf runtime) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import base64
import time

import redis.asyncio as aioredis

from kvmesh.operator.metrics_source import heartbeat_key, pods_key

from tests.operator.conftest import DEPLOYMENTS, MD, NETPOLS, PDBS, SECRETS, SERVICES, eventually, md_body


class Heartbeats:
    """Writes sidecar heartbeats (contract 3 layout) into the real Redis."""

    def __init__(self, url, model):
        self.r = aioredis.Redis.from_url(url)
        self.model = model

    async def beat(self, pod, kv, state="ready"):
        await self.r.sadd(pods_key(self.model), pod)
        key = heartbeat_key(self.model, pod)
        await self.r.hset(key, mapping={"url": f"http://{pod}:8000", "model": self.model, "kv_usage": kv,
                                        "running": 1, "waiting": 0, "total_blocks": 1000, "state": state,
                                        "ts": time.time()})
        await self.r.expire(key, 10)

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


async def mark_available(k8s, name, ready=None):
    dep = k8s.fetch_object(DEPLOYMENTS, "ns", name)
    n = dep["spec"]["replicas"] if ready is None else ready
    await k8s.patch_status(DEPLOYMENTS, "ns", name, {
        "observedGeneration": dep["metadata"]["generation"], "replicas": dep["spec"]["replicas"],
        "readyReplicas": n, "availableReplicas": n, "updatedReplicas": dep["spec"]["replicas"],
        "conditions": [{"type": "Available", "status": "True" if n else "False"}]})


async def test_create_children_status_ready_and_delete(k8s, operator):
    await k8s.put_object(MD, md_body(replicas=2))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))   # the last child rendered
    md = k8s.fetch_object(MD, "ns", "demo")
    uid = md["metadata"]["uid"]
    names = {(k, o["metadata"]["name"]) for k in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS)
             for o in k8s.list_objects(k, "ns")}
    assert names == {(DEPLOYMENTS, "demo-engine"), (DEPLOYMENTS, "demo-router"), (DEPLOYMENTS, "demo-redis"),
                     (SERVICES, "demo-engine"), (SERVICES, "demo-router"), (SERVICES, "demo-redis"),
                     (SECRETS, "demo-redis-url"), (NETPOLS, "demo-engine"), (PDBS, "demo-engine")}
    for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS):
        for obj in k8s.list_objects(key, "ns"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 2
    await eventually(lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] == "NotAvailable")
    assert cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["status"] == "False"

    for dep in ("demo-engine", "demo-router", "demo-redis"):
        await mark_available(k8s, dep)
    md = await eventually(lambda: (m := k8s.fetch_object(MD, "ns", "demo"))
                          and cond(m, "Ready")["status"] == "True" and m)
    s = md["status"]
    assert s["readyReplicas"] == 2 and s["replicas"] == 2
    assert s["observedGeneration"] == md["metadata"]["generation"]
    assert s["selector"] == "app.kubernetes.io/component=engine,kvmesh.io/model-deployment=demo"
    assert s["routerEndpoint"] == "http://demo-router.ns.svc:8000"
    assert cond(md, "Degraded")["status"] == "False"

    await k8s.delete_object(MD, "ns", "demo")
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo") is None)
    for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS, PDBS):
        assert k8s.list_objects(key, "ns") == []


async def test_spec_update_updates_and_prunes_children(k8s, operator, redis_url):
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    engine_gen = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["metadata"]["generation"]

    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"].update(replicas=3, engine={"blockSize": 32}, redis={"mode": "external", "url": redis_url})
    await k8s.put_object(MD, md)

    def updated():
        dep = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
        cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        return dep["spec"]["replicas"] == 3 and cmd[cmd.index("--block-size") + 1] == "32" and dep
    dep = await eventually(updated)
    assert dep["metadata"]["generation"] == engine_gen + 1
    # Managed Redis is gone; the URL Secret now carries the external URL.
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis") is None
                     and k8s.fetch_object(SERVICES, "ns", "demo-redis") is None)
    assert base64.b64decode(k8s.fetch_object(SECRETS, "ns", "demo-redis-url")["data"]["url"]).decode() == redis_url
    router = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-router")
    assert router["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "32"


async def test_scale_subresource_drives_engine_replicas(k8s, operator):
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    # What `kubectl scale md/demo --replicas=4` sends.
    async with k8s.servers[0].client.patch(
            f"/apis/kvmesh.io/v1alpha1/namespaces/ns/modeldeployments/demo/scale",
            json={"spec": {"replicas": 4}}, headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["spec"]["replicas"] == 4
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 4)
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo")["status"]["desiredReplicas"] == 4)


async def test_invalid_spec_reports_condition_without_crashing(k8s, operator):
    bad = md_body(replicas=2, autoscaling={"minReplicas": 3, "maxReplicas": 2},
                  redis={"mode": "external", "url": "redis://:secret@r:6379/0"})
    await k8s.put_object(MD, bad)
    md = await eventually(lambda: (m := k8s.fetch_object(MD, "ns", "demo")) and (m.get("status") or {}).get(
        "conditions") and m)
    ready = cond(md, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "must not carry credentials" in ready["message"] and "minReplicas must be <= " in ready["message"]
    assert cond(md, "Degraded")["status"] == "True"
    assert k8s.list_objects(DEPLOYMENTS, "ns") == []
    await eventually(lambda: any(e.get("reason") == "InvalidSpec" and e["type"] == "Warning"
                                 for e in k8s.list_objects("v1/events", "ns")))
    # Handled, not retried: no crash loop of the handler.
    await asyncio.sleep(0.5)
    annotations = k8s.fetch_object(MD, "ns", "demo")["metadata"].get("annotations") or {}
    assert not any("retries" in v for k, v in annotations.items() if k.startswith("kvmesh.io/"))

    # Fixing the spec recovers.
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"].pop("autoscaling")
    md["spec"].pop("redis")
    await k8s.put_object(MD, md)
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    await eventually(lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] != "InvalidSpec")


async def test_transient_api_errors_are_retried(k8s, operator):
    k8s.inject_fault("PATCH", r"/deployments/demo-router$", status=500, times=2)
    k8s.inject_fault("PATCH", r"/services/demo-engine$", status=429, times=1)
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"), timeout=15)
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-router") is not None
    assert all(f.times == 0 for f in k8s.faults)
    await eventually(lambda: k8s.fetch_object(MD, "ns", "demo")["status"].get("observedGeneration") == 1)


async def test_restart_changes_nothing(k8s, operator, redis_url):
    await k8s.put_object(MD, md_body(autoscaling={"minReplicas": 1, "maxReplicas": 5, "intervalSeconds": 0.1,
                                                  "targetKVUtilization": 0.5}))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    await hb.beat("demo-engine-a", 0.9)   # load 0.9 / target 0.5 -> 2 replicas
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 2)
    await hb.beat("demo-engine-b", 0.45)
    await hb.beat("demo-engine-a", 0.45)  # steady: utilisation ~ target
    for dep in ("demo-engine", "demo-router", "demo-redis"):
        await mark_available(k8s, dep)
    await eventually(lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["status"] == "True")
    await asyncio.sleep(0.3)

    def snapshot():
        return {(key, o["metadata"]["name"]): (o["metadata"]["resourceVersion"], o["metadata"].get("generation"),
                                               (o.get("spec") or {}).get("replicas"))
                for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS) for o in k8s.list_objects(key, "ns")}
    before = snapshot()
    await operator.stop()
    await hb.beat("demo-engine-b", 0.1)   # load dropped while the operator was down
    await hb.beat("demo-engine-a", 0.1)
    await operator.start()
    for _ in range(10):                   # resume handler + many autoscaler ticks
        await asyncio.sleep(0.1)
        await hb.beat("demo-engine-a", 0.1)
        await hb.beat("demo-engine-b", 0.1)
    assert snapshot() == before           # no duplicate, no re-created, no re-scaled child
    status = k8s.fetch_object(MD, "ns", "demo")["status"]
    assert status["desiredReplicas"] == 2
    assert status["lastDecision"]["action"] == "hold"   # a fresh scaler waits a full scale-down window
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
                    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
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
    await k8s.put_object(MD, md_body(autoscaling={
        "minReplicas": 1, "maxReplicas": 4, "targetKVUtilization": 0.5, "intervalSeconds": 0.1,
        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 60, "maxScaleDownStep": 1}))
    await eventually(lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine"))
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 1   # minReplicas
    engine = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"]  # noqa: E731
    md = lambda: k8s.fetch_object(MD, "ns", "demo")  # noqa: E731
    hb = Heartbeats(redis_url, "smollm2-135m-instruct")
    try:
        # No heartbeats yet: hold.
        await eventually(lambda: md()["status"]["lastDecision"]["action"] == "hold")
        assert "no KV-utilisation metrics" in md()["status"]["lastDecision"]["reason"]
        assert engine() == 1

        # One ready pod at 90% KV -> ceil(0.9 / 0.5) = 2.
        await hb.beat("demo-engine-a", 0.9)
        await hb.beat("other-engine-z", 1.0)    # another deployment's pod on a shared Redis: ignored
        await eventually(lambda: engine() == 2)
        status = md()["status"]
        assert status["desiredReplicas"] == 2 and status["lastScaleTime"]
        await eventually(lambda: events(k8s, "ScaledUp"))
        assert "1 -> 2" in events(k8s, "ScaledUp")[0]["message"]

        # The new pod is starting (no heartbeat): it counts as requested capacity, no cascade.
        await hb.beat("demo-engine-a", 1.0)
        clock.advance(5)
        await asyncio.sleep(0.5)
        assert engine() == 2
        assert md()["status"]["kvUtilization"] == 1.0 and md()["status"]["kvPercent"] == 100

        # Both ready, load falls: scale-down waits for the 60 s window (fast-forwarded).
        await hb.beat("demo-engine-a", 0.1)
        await hb.beat("demo-engine-b", 0.1)
        await eventually(lambda: md()["status"]["lastDecision"]["recommendation"] == 1)
        clock.advance(30)
        await asyncio.sleep(0.4)
        assert engine() == 2
        await hb.beat("demo-engine-a", 0.1)
        await hb.beat("demo-engine-b", 0.1)
        clock.advance(31)
        await eventually(lambda: engine() == 1)
        await eventually(lambda: events(k8s, "ScaledDown"))
        assert "2 -> 1" in events(k8s, "ScaledDown")[0]["message"]

        # Heartbeats vanish (Redis lost them): hold at the current count.
        await hb.drop("demo-engine-a")
        await hb.drop("demo-engine-b")
        clock.advance(120)
        await eventually(lambda: md()["status"]["lastDecision"]["action"] == "hold")
        assert engine() == 1
    finally:
        await hb.close()


async def test_operator_uses_exactly_its_rbac(k8s, operator):
    """Create, switch to an external Redis from a Secret (prunes the managed Redis and the
    URL Secret), scale, delete: every permission of the ClusterRole is exercised, and (the
    fixture checks) nothing beyond it."""
    from kvmesh.operator.manifests import RBAC_RULES
    from tests.operator.conftest import used_permissions

    await k8s.put_object("v1/secrets", {"apiVersion": "v1", "kind": "Secret",
                                        "metadata": {"name": "shared", "namespace": "ns"},
                                        "data": {"url": "cmVkaXM6Ly8xMjcuMC4wLjE6MS8w"}})
    await k8s.put_object(MD, md_body(autoscaling={"maxReplicas": 2, "intervalSeconds": 0.1}))
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    await eventually(lambda: events(k8s, "AutoscalerHold"))
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["redis"] = {"mode": "external", "secretRef": {"name": "shared"}}
    await k8s.put_object(MD, md)
    await eventually(lambda: k8s.fetch_object(SECRETS, "ns", "demo-redis-url") is None
                     and k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis") is None)
    granted = {(g, r, v) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    never_used = {("networking.k8s.io", "networkpolicies", "delete")}  # prune-only, never pruned here
    # The autoscaler's next ticks read the Redis URL from the user's Secret.
    await eventually(lambda: granted - used_permissions(k8s) <= never_used)
    unused = granted - used_permissions(k8s)
    assert unused <= never_used, unused


async def test_rejected_child_reports_apply_failed_then_recovers(k8s, operator):
    k8s.inject_fault("PATCH", r"/networkpolicies/demo-engine$", status=422, times=1)   # e.g. a webhook
    await k8s.put_object(MD, md_body(replicas=1))
    md = await eventually(lambda: (m := k8s.fetch_object(MD, "ns", "demo"))
                          and cond(m, "Ready")["reason"] == "ApplyFailed" and m)
    ready = cond(md, "Ready")
    assert ready["status"] == "False" and cond(md, "Degraded")["status"] == "True"
    await asyncio.sleep(0.4)   # status refreshes by the daemon keep it until a reconcile succeeds
    assert cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] == "ApplyFailed"
    assert "rejected" in ready["message"]
    # Retried after the (test-short) delay: everything appears and the condition clears.
    await eventually(lambda: k8s.fetch_object(NETPOLS, "ns", "demo-engine"), timeout=10)
    await eventually(lambda: cond(k8s.fetch_object(MD, "ns", "demo"), "Ready")["reason"] != "ApplyFailed")


async def test_drift_is_healed_within_seconds(k8s, operator):
    """Children are reconciled continuously: a deleted child comes back, a hand edit of a
    field the operator renders is put back (watch-triggered, not the periodic resync)."""
    await k8s.put_object(MD, md_body(replicas=2))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))
    rendered_image = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["template"]["spec"]["containers"][0][
        "image"]

    for key, name in ((DEPLOYMENTS, "demo-engine"), (SERVICES, "demo-engine"), (SECRETS, "demo-redis-url"),
                      (NETPOLS, "demo-engine"), (PDBS, "demo-engine")):
        old_uid = k8s.fetch_object(key, "ns", name)["metadata"]["uid"]
        await k8s.delete_object(key, "ns", name)
        await eventually(lambda: (o := k8s.fetch_object(key, "ns", name)) and o["metadata"]["uid"] != old_uid,
                         timeout=5)

    dep = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
    dep["spec"]["replicas"] = 7
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "attacker/engine:latest"
    await k8s.put_object(DEPLOYMENTS, dep)

    def restored():
        d = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")
        return d["spec"]["replicas"] == 2 and d["spec"]["template"]["spec"]["containers"][0]["image"] == rendered_image
    await eventually(restored, timeout=5)
    # The resync interval (60 s here) is far longer than the waits above: the watch did it.
    assert operator.config.resync_interval >= 30


async def test_children_of_another_owner_are_left_alone(k8s, operator):
    """A labelled object that this ModelDeployment does not own is neither healed nor pruned."""
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-engine"))
    stranger = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "demo-extra", "namespace": "ns", "labels": {"kvmesh.io/model-deployment": "demo"}},
        "spec": {"ports": [{"port": 80}]}}
    await k8s.put_object(SERVICES, stranger)
    # Trigger a reconcile through a real drift and wait until it has healed.
    await k8s.delete_object(SERVICES, "ns", "demo-engine")
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-engine"), timeout=5)
    assert k8s.fetch_object(SERVICES, "ns", "demo-extra") is not None
