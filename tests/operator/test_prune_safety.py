"""Prune safety: the operator deletes only what its ModelDeployment controls.

The real operator (kopf runtime) against the API emulator. Objects that carry the
deployment's label ``kvmesh.io/model-deployment=<name>`` but that it does not control —
no owner at all, another owner, an owner of the same kind *and name* with another uid
(a deleted and re-created ModelDeployment), or a co-owned object whose controller is
someone else — survive every kind of reconcile: create, spec update, healing after a
deleted child, the periodic resync. Switching the Redis mode while the autoscaler is
scaling deletes exactly the managed Redis objects (and, back, exactly the URL Secret).

"Survives" is checked three ways: the object is still there with its uid, the operator
never sent a DELETE for it (the emulator's request log), and — the wait — a whole prune
pass has run after the trigger (a counter around ``handlers._prune``), so no assertion is
a race with a slow reconcile; a stopped operator is the final barrier.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvmesh.operator import crd, handlers, render
from tests.operator.conftest import (
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
from tests.operator.test_operator_runtime import Heartbeats, add_pod

MODEL = "smollm2-135m-instruct"
LABEL = {render.LABEL_MD: "demo"}
KEY_OF_KIND = {
    "Deployment": DEPLOYMENTS,
    "Service": SERVICES,
    "Secret": SECRETS,
    "NetworkPolicy": NETPOLS,
    "PodDisruptionBudget": PDBS,
    "Job": JOBS,
    "PersistentVolumeClaim": PVCS,
}
PLURAL_OF_KIND = {k: v.rsplit("/", 1)[1] for k, v in KEY_OF_KIND.items()}


class PruneCounter:
    """Counts complete prune passes of the running operator (same process, its own thread).
    Reconciles of one ModelDeployment run one at a time, so of two passes completed after a
    point, the second began after it: ``more(2, since)`` proves a whole prune ran after a
    trigger (one pass may have been under way already). ``hold`` parks the next
    prune whose ModelDeployment matches a predicate (its children applied, nothing pruned
    yet) until ``release``: the seam where an older spec's prune meets a newer spec."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.passes = 0
        self.memo: Any = None
        self._hold: Any = None
        self.held, self._release = threading.Event(), threading.Event()
        original = handlers._prune

        async def counted(memo: Any, md: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            self.memo = memo
            if self._hold is not None and self._hold(md):
                self._hold = None
                self.held.set()
                while not self._release.is_set():
                    await asyncio.sleep(0.01)
            await original(memo, md, *args, **kwargs)
            self.passes += 1

        monkeypatch.setattr(handlers, "_prune", counted)

    async def more(self, n: int, since: int, timeout: float = 15.0) -> None:
        await eventually(lambda: self.passes >= since + n, timeout=timeout)

    def hold(self, predicate: Any) -> None:
        self.held.clear()
        self._release.clear()
        self._hold = predicate

    def release(self) -> None:
        self._release.set()

    def waiting_reconciles(self, uid: str) -> int:
        """Reconciles of this ModelDeployment queued behind the one that holds its lock."""
        lock = self.memo.shared.reconcile_locks.get(uid) if self.memo is not None else None
        return len(getattr(lock, "_waiters", None) or ())


@pytest.fixture()
def prunes(monkeypatch: pytest.MonkeyPatch) -> PruneCounter:
    return PruneCounter(monkeypatch)


def operator_deletes(k8s) -> list[tuple[str, str]]:
    """(plural, name) of every DELETE the operator (not kopf's bookkeeping) sent, in order."""
    out = []
    for req in list(k8s._requests):
        if (
            req.resource is not None
            and req.name
            and str(getattr(req.method, "value", req.method)).upper() == "DELETE"
            and req.headers.get("User-Agent", "").startswith("kvmesh")
        ):
            out.append((req.resource.plural, req.name))
    return out


def _ref(
    kind: str, name: str, uid: str, controller: bool = True, api_version: str = "apps/v1"
) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def _body(
    kind: str, name: str, owners: list[dict[str, Any]], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {**LABEL, **(labels or {})}}
    if owners:
        meta["ownerReferences"] = owners
    api = {
        "Deployment": "apps/v1",
        "NetworkPolicy": "networking.k8s.io/v1",
        "PodDisruptionBudget": "policy/v1",
        "Job": "batch/v1",
    }.get(kind, "v1")
    spec = {
        "Deployment": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
        "Service": {"ports": [{"port": 80}]},
        "NetworkPolicy": {"podSelector": {}},
        "PodDisruptionBudget": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": name}}},
        "Job": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "busybox"}],
                }
            }
        },
        "PersistentVolumeClaim": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }.get(kind)
    body: dict[str, Any] = {"apiVersion": api, "kind": kind, "metadata": meta}
    if kind == "Secret":
        body["data"] = {"k": "dg=="}
    else:
        body["spec"] = spec
    return body


async def put_strangers(k8s, impostor_uid: str, someone_uid: str) -> dict[tuple[str, str], str]:
    """Labelled objects this ModelDeployment does not control, one of each pruned kind and
    each way of not belonging: (kind, name) -> uid.

    ``impostor_uid`` is a live object's uid used in an owner reference that names
    *ModelDeployment demo* (what a deleted and re-created deployment's leftovers look
    like); ``someone_uid`` is a user's Deployment that owns some of them.
    """
    someone = _ref("Deployment", "someone-else", someone_uid)
    impostor = _ref(crd.KIND, "demo", impostor_uid, api_version=crd.API_VERSION)
    co_owned = [
        _ref("Deployment", "someone-else", someone_uid),  # the controller
        {**_ref(crd.KIND, "demo", "", controller=False, api_version=crd.API_VERSION)},
    ]  # uid set below
    plan = [
        ("Deployment", "demo-stray-deploy", []),  # no owner
        ("Deployment", "demo-other-deploy", [someone]),  # another owner
        ("Service", "demo-stray-svc", []),
        ("Service", "demo-impostor-svc", [impostor]),  # same kind and name, another uid
        ("Secret", "demo-stray-secret", []),
        ("Secret", "demo-impostor-secret", [impostor]),
        ("NetworkPolicy", "demo-other-netpol", [someone]),
        ("PodDisruptionBudget", "demo-stray-pdb", []),
        ("Job", "demo-other-job", [someone]),
        ("PersistentVolumeClaim", "demo-stray-pvc", []),
        ("PersistentVolumeClaim", "demo-impostor-pvc", [impostor]),
        # Carries the managed Redis's component label too: a Redis-mode switch must spare it.
        ("Deployment", "demo-redis-backup", [], {render.LABEL_COMPONENT: render.REDIS}),
        ("Service", "demo-co-owned-svc", co_owned),  # demo is an owner, not the controller
    ]
    out = {}
    for kind, name, owners, *labels in plan:
        obj = await k8s.put_object(
            KEY_OF_KIND[kind], _body(kind, name, owners, *(labels or [None]))
        )
        out[(kind, name)] = obj["metadata"]["uid"]
    return out


async def set_demo_as_co_owner(k8s, demo_uid: str) -> None:
    obj = k8s.fetch_object(SERVICES, "ns", "demo-co-owned-svc")
    obj["metadata"]["ownerReferences"][1]["uid"] = demo_uid
    await k8s.put_object(SERVICES, obj)


def assert_strangers_intact(k8s, strangers: dict[tuple[str, str], str]) -> None:
    gone = [
        key
        for key, uid in strangers.items()
        if (o := k8s.fetch_object(KEY_OF_KIND[key[0]], "ns", key[1])) is None
        or o["metadata"]["uid"] != uid
    ]
    assert not gone, f"pruned or replaced: {gone}"
    deleted = {(p, n) for p, n in operator_deletes(k8s)}
    hit = [key for key in strangers if (PLURAL_OF_KIND[key[0]], key[1]) in deleted]
    assert not hit, f"the operator sent a DELETE for {hit}"


def children_present(k8s) -> bool:
    return bool(
        k8s.fetch_object(PDBS, "ns", "demo-engine")
        and k8s.fetch_object(SERVICES, "ns", "demo-redis")
    )


async def someone_else(k8s) -> str:
    """A user's Deployment (not labelled for demo) that owns some strangers; its uid also
    stands in for a stale ModelDeployment's (the emulator collects dependents whose owners
    are all gone, as the garbage collector would)."""
    obj = await k8s.put_object(
        DEPLOYMENTS,
        _body("Deployment", "someone-else", [])
        | {"metadata": {"name": "someone-else", "namespace": "ns", "labels": {"app": "user"}}},
    )
    return obj["metadata"]["uid"]


async def test_strangers_survive_create_update_heal_and_resync(k8s, operator, prunes):
    # The periodic resync as well, every second (the healer daemon reads it when it starts).
    operator.config.resync_interval = 1.0
    someone_uid = await someone_else(k8s)
    strangers = await put_strangers(k8s, impostor_uid=someone_uid, someone_uid=someone_uid)

    # 1. create: the strangers were there first.
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: children_present(k8s))
    md = k8s.fetch_object(MD, "ns", "demo")
    await set_demo_as_co_owner(k8s, md["metadata"]["uid"])
    # Reconciles run one at a time: of two passes completed after a point, the second began
    # after it (and the resync keeps them coming).
    await prunes.more(2, since=prunes.passes)
    assert_strangers_intact(k8s, strangers)

    # 2. spec update (a new engine argument, more replicas, the router's budget).
    since = prunes.passes
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"].update(replicas=3, engine={"blockSize": 32}, router={"replicas": 2})
    await k8s.put_object(MD, md)
    await eventually(
        lambda: (
            k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"] == 3
            and k8s.fetch_object(PDBS, "ns", "demo-router")
        )
    )
    await prunes.more(2, since=since)
    assert_strangers_intact(k8s, strangers)
    # ...and a child the update no longer renders is pruned (the pass did run).
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["router"] = {"replicas": 1}
    await k8s.put_object(MD, md)
    await eventually(lambda: k8s.fetch_object(PDBS, "ns", "demo-router") is None)
    assert ("poddisruptionbudgets", "demo-router") in operator_deletes(k8s)

    # 3. healing after a deleted child (watch-triggered).
    for key, name in (
        (SERVICES, "demo-engine"),
        (DEPLOYMENTS, "demo-router"),
        (SECRETS, "demo-redis-auth"),
    ):
        since = prunes.passes
        old_uid = k8s.fetch_object(key, "ns", name)["metadata"]["uid"]
        await k8s.delete_object(key, "ns", name)
        await eventually(
            lambda: (o := k8s.fetch_object(key, "ns", name)) and o["metadata"]["uid"] != old_uid
        )
        await prunes.more(2, since=since)
        assert_strangers_intact(k8s, strangers)

    # 4. resync: nothing changes, the healer reconciles on its interval.
    since = prunes.passes
    await prunes.more(2, since=since)
    assert_strangers_intact(k8s, strangers)

    # A stop is the final barrier: no prune can be in flight any more.
    await operator.stop()
    assert_strangers_intact(k8s, strangers)
    # The operator's own deletes were of its own children only.
    assert {n for _, n in operator_deletes(k8s)} <= {"demo-router"}


MANAGED_REDIS = {
    ("deployments", "demo-redis"),
    ("services", "demo-redis"),
    ("networkpolicies", "demo-redis"),
    ("secrets", "demo-redis-auth"),
}


def labelled(k8s) -> dict[tuple[str, str], str]:
    return {
        (key.rsplit("/", 1)[1], o["metadata"]["name"]): o["metadata"]["uid"]
        for key in KEY_OF_KIND.values()
        for o in k8s.list_objects(key, "ns")
        if (o["metadata"].get("labels") or {}).get(render.LABEL_MD) == "demo"
    }


async def test_redis_mode_switch_while_scaling_prunes_exactly_the_managed_redis(
    k8s, operator, prunes, redis_url, clock
):
    someone_uid = await someone_else(k8s)
    strangers = await put_strangers(k8s, impostor_uid=someone_uid, someone_uid=someone_uid)
    await k8s.put_object(
        MD,
        md_body(
            autoscaling={
                "minReplicas": 1,
                "maxReplicas": 4,
                "intervalSeconds": 0.1,
                "targetKVUtilization": 0.5,
                "scaleUpStabilizationSeconds": 0,
            }
        ),
    )
    await eventually(lambda: children_present(k8s))
    await set_demo_as_co_owner(k8s, k8s.fetch_object(MD, "ns", "demo")["metadata"]["uid"])
    engine = lambda: k8s.fetch_object(DEPLOYMENTS, "ns", "demo-engine")["spec"]["replicas"]  # noqa: E731
    hb = Heartbeats(redis_url, MODEL)
    try:
        await add_pod(k8s, clock, "demo-engine-a")
        await hb.beat("demo-engine-a", 0.9)  # ceil(0.9 / 0.5) = 2
        await eventually(lambda: engine() == 2)
        before = labelled(k8s)
        deletes_before = len(operator_deletes(k8s))

        # Scale up (3 pods at full load -> 4) and switch to an external Redis at the same time.
        for pod in ("demo-engine-b", "demo-engine-c"):
            await add_pod(k8s, clock, pod)
        for pod in ("demo-engine-a", "demo-engine-b", "demo-engine-c"):
            await hb.beat(pod, 1.0)
        clock.advance(1)  # past the (0 s) scale-up window of the earlier 2s
        md = k8s.fetch_object(MD, "ns", "demo")
        md["spec"]["redis"] = {"mode": "external", "url": redis_url}
        await k8s.put_object(MD, md)
        await eventually(
            lambda: (
                engine() == 4
                and k8s.fetch_object(SECRETS, "ns", "demo-redis-url")
                and all(
                    k8s.fetch_object(KEY_OF_KIND[k], "ns", n) is None
                    for k, n in (
                        ("Deployment", "demo-redis"),
                        ("Service", "demo-redis"),
                        ("NetworkPolicy", "demo-redis"),
                        ("Secret", "demo-redis-auth"),
                    )
                )
            )
        )
        since = prunes.passes
        await prunes.more(1, since=since)
        after = labelled(k8s)
        assert set(before) - set(after) == MANAGED_REDIS  # exactly these went
        assert set(after) - set(before) == {
            ("secrets", "demo-redis-url")
        }  # and the URL Secret came
        assert all(after[k] == before[k] for k in after if k in before)  # nothing else re-created
        assert set(operator_deletes(k8s)[deletes_before:]) == MANAGED_REDIS
        assert k8s.fetch_object(MD, "ns", "demo")["spec"]["replicas"] == 4  # the scale-up stands
        assert_strangers_intact(k8s, strangers)

        # Back to managed while scaling down (load gone, window fast-forwarded).
        before, deletes_before = after, len(operator_deletes(k8s))
        await add_pod(k8s, clock, "demo-engine-d")  # the 4th replica is up: none is starting
        for pod in ("demo-engine-a", "demo-engine-b", "demo-engine-c", "demo-engine-d"):
            await hb.beat(pod, 0.1)
        clock.advance(400)  # past the scale-down window
        md = k8s.fetch_object(MD, "ns", "demo")
        md["spec"]["redis"] = {"mode": "managed"}
        await k8s.put_object(MD, md)
        await eventually(
            lambda: (
                engine() < 4
                and k8s.fetch_object(SECRETS, "ns", "demo-redis-url") is None
                and k8s.fetch_object(NETPOLS, "ns", "demo-redis")
                and k8s.fetch_object(SECRETS, "ns", "demo-redis-auth")
            )
        )
        since = prunes.passes
        await prunes.more(1, since=since)
        after = labelled(k8s)
        assert set(before) - set(after) == {("secrets", "demo-redis-url")}
        assert set(after) - set(before) == MANAGED_REDIS
        assert all(after[k] == before[k] for k in after if k in before)
        assert set(operator_deletes(k8s)[deletes_before:]) == {("secrets", "demo-redis-url")}
        assert_strangers_intact(k8s, strangers)
        assert k8s.list_objects(PODS, "ns")  # the pods are the test's; nothing touched them
    finally:
        await hb.close()
    await operator.stop()
    assert_strangers_intact(k8s, strangers)


def redis_mode(md: dict[str, Any]) -> str:
    return ((md.get("spec") or {}).get("redis") or {}).get("mode", "managed")


async def test_reconciles_of_one_deployment_do_not_overlap(k8s, operator, prunes, redis_url):
    """The create reconcile (managed Redis) is parked just before its prune; the spec is
    switched to an external Redis meanwhile. The healer's reconcile (woken by the children
    the first one created) and the update handler's wait for it: the URL Secret is not
    applied, nor the managed Redis deleted, until the first reconcile has finished."""
    prunes.hold(lambda md: redis_mode(md) == "managed")
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(prunes.held.is_set)
    uid = k8s.fetch_object(MD, "ns", "demo")["metadata"]["uid"]
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["redis"] = {"mode": "external", "url": redis_url}
    await k8s.put_object(MD, md)
    await eventually(
        lambda: prunes.waiting_reconciles(uid) >= 1
    )  # another reconcile is queued on the lock
    assert k8s.fetch_object(SECRETS, "ns", "demo-redis-url") is None
    assert not operator_deletes(k8s)
    prunes.release()
    await eventually(
        lambda: (
            k8s.fetch_object(SECRETS, "ns", "demo-redis-url")
            and k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis") is None
            and k8s.fetch_object(SECRETS, "ns", "demo-redis-auth") is None
        )
    )
    since = prunes.passes
    await prunes.more(1, since=since)
    assert sorted(operator_deletes(k8s)) == sorted(MANAGED_REDIS)  # each once, the URL Secret never


async def test_a_prune_of_a_superseded_spec_deletes_nothing(k8s, operator, prunes, redis_url):
    """Managed -> external -> managed again before the external reconcile has pruned:
    that reconcile's prune (which would delete the managed Redis) is stale and is skipped,
    so the Redis pod keeps running (same Deployment, never deleted)."""
    await k8s.put_object(MD, md_body(replicas=1))
    await eventually(lambda: children_present(k8s))
    await prunes.more(1, since=0)
    redis_uid = k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis")["metadata"]["uid"]
    auth_uid = k8s.fetch_object(SECRETS, "ns", "demo-redis-auth")["metadata"]["uid"]

    prunes.hold(lambda md: redis_mode(md) == "external")
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["redis"] = {"mode": "external", "url": redis_url}
    await k8s.put_object(MD, md)
    await eventually(prunes.held.is_set)  # external applied, managed not yet pruned
    assert k8s.fetch_object(SECRETS, "ns", "demo-redis-url") is not None
    md = k8s.fetch_object(MD, "ns", "demo")
    md["spec"]["redis"] = {"mode": "managed"}
    await k8s.put_object(MD, md)
    since = prunes.passes
    prunes.release()
    await eventually(lambda: k8s.fetch_object(SECRETS, "ns", "demo-redis-url") is None)
    await prunes.more(2, since=since)
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "demo-redis")["metadata"]["uid"] == redis_uid
    assert k8s.fetch_object(SECRETS, "ns", "demo-redis-auth")["metadata"]["uid"] == auth_uid
    assert set(operator_deletes(k8s)) == {("secrets", "demo-redis-url")}
