"""The real operator (kopf runtime) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio

from tests.operator.conftest import DEPLOYMENTS, MD, NETPOLS, SECRETS, SERVICES, eventually, md_body


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
    await eventually(lambda: k8s.fetch_object(SERVICES, "ns", "demo-redis"))
    md = k8s.fetch_object(MD, "ns", "demo")
    uid = md["metadata"]["uid"]
    names = {(k, o["metadata"]["name"]) for k in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS)
             for o in k8s.list_objects(k, "ns")}
    assert names == {(DEPLOYMENTS, "demo-engine"), (DEPLOYMENTS, "demo-router"), (DEPLOYMENTS, "demo-redis"),
                     (SERVICES, "demo-engine"), (SERVICES, "demo-router"), (SERVICES, "demo-redis"),
                     (SECRETS, "demo-redis-url"), (NETPOLS, "demo-engine")}
    for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS):
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
    for key in (DEPLOYMENTS, SERVICES, SECRETS, NETPOLS):
        assert k8s.list_objects(key, "ns") == []
