"""The operator against a real kube-apiserver (envtest-style; see apiserver_env.py).

Runs when kube-apiserver and etcd are found in $KUBEBUILDER_ASSETS or in
~/.local/share/kubebuilder-envtest/k8s/<version>/ (docs/operator.md, "Testing against a
real API server"); kube-controller-manager beside them adds Deployments -> ReplicaSets ->
Pods and owner-reference garbage collection. The CRD and RBAC come from manifests/, the
operator runs under its ServiceAccount's token (RBAC enforced), and every check reads
what the real server stored or answered: defaulting, CEL, server-side apply, /scale,
garbage collection.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.operator import crd, render
from kvmesh.operator import spec as specs
from tests.operator.apiserver_env import (
    ControlPlane,
    LogCapture,
    OperatorThread,
    find_environment,
    path,
    register_kind,
    wait_for,
)
from tests.operator.test_render import CASES as RENDER_CASES

ASSETS, SKIP_REASON = find_environment()
pytestmark = pytest.mark.skipif(ASSETS is None, reason=f"no real control plane: {SKIP_REASON}")

ROOT = Path(__file__).resolve().parents[2]
NS = "kvmesh-e2e"
OPERATOR_NS, OPERATOR_SA = "kvmesh-system", "kvmesh-operator"
MD = crd.KIND
HEAL_TIMEOUT = 15.0  # "within seconds": a watch on the children, or the periodic resync
GC_TIMEOUT = 30.0

register_kind(MD, crd.API_VERSION, crd.PLURAL)
register_kind("ConfigMap", "v1", "configmaps")  # the adapter list


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver, the CRD and RBAC of manifests/ installed, and the controller
    manager when there is one."""
    assert ASSETS is not None
    cp = ControlPlane(ASSETS, tmp_path_factory.mktemp("apiserver"))
    try:
        cp.start()
        cp.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}}
        ).raise_for_status()
        # The engine and router pods must pass the "restricted" Pod Security level.
        cp.apply(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": NS,
                    "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
                },
            }
        ).raise_for_status()
        cp.apply_file(ROOT / "manifests" / "crd.yaml")
        cp.apply_file(ROOT / "manifests" / "rbac.yaml")
        wait_for(lambda: _established(cp), timeout=30, message="CRD Established")
        cp.start_controller_manager()
        yield cp
    finally:
        cp.stop()


def _established(cp: ControlPlane) -> bool:
    obj = cp.get("CustomResourceDefinition", None, crd.CRD_NAME)
    conds = {c["type"]: c["status"] for c in (obj or {}).get("status", {}).get("conditions", [])}
    return conds.get("Established") == "True"


@pytest.fixture(scope="module")
def operator_logs() -> Iterator[LogCapture]:
    with LogCapture("kopf", "kvmesh") as capture:
        yield capture


@pytest.fixture(scope="module")
def operator(
    cluster: ControlPlane, redis_url: str, operator_logs: LogCapture
) -> Iterator[OperatorThread]:
    """The real operator, cluster-wide, authenticated with a TokenRequest token of the
    kvmesh-operator ServiceAccount: only the ClusterRole of manifests/rbac.yaml applies."""
    from kvmesh.operator.apply import Connection
    from kvmesh.operator.memo import OperatorConfig

    token = cluster.request_token(OPERATOR_NS, OPERATOR_SA)
    config = OperatorConfig(
        connection=Connection(server=cluster.server, token=token, ca_path=cluster.ca_path),
        status_interval=1.0,
        managed_redis_url=redis_url,
        api_retries=3,
        rejected_retry_delay=5.0,
        adapter_interval=0.5,
        adapter_settle_seconds=2.0,
    )
    runner = OperatorThread(config)
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


@pytest.fixture(scope="module")
def api(cluster: ControlPlane) -> httpx.Client:
    assert cluster.client is not None
    return cluster.client


def md_body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": MD,
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"builtin": "smollm2-135m-instruct"}, **spec},
    }


def create_md(api: httpx.Client, name: str, **spec: Any) -> dict[str, Any]:
    resp = api.post(path(MD, NS), json=md_body(name, **spec))
    assert resp.status_code == 201, resp.text
    return resp.json()


def expected_children(md: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of every child the operator makes for the server's (defaulted) object:
    the rendered ones and the generated credential Secrets."""
    spec = specs.apply_defaults(dict(md["spec"]))
    return [(c["kind"], c["metadata"]["name"]) for c in render.render_children(md, spec)] + [
        ("Secret", n) for n in render.generated_secret_names(md["metadata"]["name"], spec)
    ]


def redis_url_secret(md: dict[str, Any]) -> str:
    """The Secret holding the Redis URL the pods use."""
    return render.redis_secret_ref(md["metadata"]["name"], specs.apply_defaults(dict(md["spec"])))[
        0
    ]


def wait_children(
    cluster: ControlPlane, md: dict[str, Any], timeout: float = 20.0
) -> dict[tuple[str, str], dict]:
    wanted = expected_children(md)

    def check() -> dict[tuple[str, str], dict] | None:
        found = {(k, n): cluster.get(k, NS, n) for k, n in wanted}
        missing = [key for key, obj in found.items() if obj is None]
        assert not missing, f"children not created: {missing}"
        return found

    return wait_for(check, timeout=timeout, interval=0.2)


def md_conditions(cluster: ControlPlane, name: str) -> dict[str, dict[str, Any]]:
    obj = cluster.get(MD, NS, name) or {}
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


# --- the CRD itself ---------------------------------------------------------------------------


def test_crd_is_established_with_a_structural_schema(cluster: ControlPlane) -> None:
    obj = cluster.get("CustomResourceDefinition", None, crd.CRD_NAME)
    assert obj is not None
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conds["Established"]["status"] == "True"
    assert conds["NamesAccepted"]["status"] == "True"
    # A schema the server cannot treat as structural is reported here (and then not pruned/defaulted).
    assert "NonStructuralSchema" not in conds, conds["NonStructuralSchema"]["message"]
    assert obj["status"]["acceptedNames"]["shortNames"] == list(crd.SHORT_NAMES)


def test_server_defaults_a_minimal_spec(api: httpx.Client) -> None:
    resp = api.post(path(MD, NS), json=md_body("defaults"), params={"dryRun": "All"})
    assert resp.status_code == 201, resp.text
    spec = resp.json()["spec"]
    assert spec["replicas"] == 1
    assert spec["engine"]["drainTimeoutSeconds"] == crd.DEFAULT_DRAIN_TIMEOUT
    assert spec["engine"]["terminationGracePeriodSeconds"] == crd.DEFAULT_GRACE_PERIOD
    assert spec["redis"]["mode"] == "managed"
    # The server's defaulting and the operator's own (spec.apply_defaults) agree.
    assert specs.apply_defaults(md_body("defaults")["spec"]) == spec


def _adapter(name: str) -> dict[str, Any]:
    return {"name": name, "source": {"path": f"/srv/adapters/{name}"}}


REJECTED = [
    pytest.param(
        {
            "engine": {
                "drainTimeoutSeconds": 50,
                "preStopSleepSeconds": 10,
                "terminationGracePeriodSeconds": 60,
            }
        },
        "spec.engine",
        "drainTimeoutSeconds + preStopSleepSeconds must be less than terminationGracePeriodSeconds",
        id="drain-plus-prestop-reaches-grace",
    ),
    pytest.param(
        {"engine": {"drainTimeoutSeconds": 58, "terminationGracePeriodSeconds": 60}},
        "spec.engine",
        "drainTimeoutSeconds + preStopSleepSeconds must be less than terminationGracePeriodSeconds",
        id="drain-plus-default-prestop",
    ),
    pytest.param(
        {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "spec.autoscaling",
        "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
        id="min-above-max",
    ),
    pytest.param(
        {"redis": {"mode": "external"}},
        "spec.redis",
        "external Redis needs a url or a secretRef",
        id="external-redis-without-url",
    ),
    pytest.param(
        {"redis": {"mode": "external", "url": "redis://:hunter2@redis.example:6379/0"}},
        "spec.redis",
        "redis.url must not carry credentials",
        id="redis-url-with-password",
    ),
    pytest.param(
        {"model": {"builtin": "smollm2-135m-instruct", "huggingFace": {"repoId": "a/b"}}},
        "spec.model",
        "set exactly one model source",
        id="two-model-sources",
    ),
    pytest.param(
        {"adapters": [_adapter("sql"), _adapter("sql")]},
        "spec.adapters",
        "adapters: names must be unique",
        id="adapter-names-twice",
    ),
    pytest.param(
        {"adapters": [_adapter("sql v2")]},
        "spec.adapters[0].name",
        "an adapter name is letters, digits and . _ / - (no spaces, no '=')",
        id="adapter-name-with-a-space",
    ),
    pytest.param(
        {"adapters": [{"name": "a", "source": {"path": "/a", "pvc": {"claimName": "c"}}}]},
        "spec.adapters[0].source",
        "set exactly one adapter source: huggingFace, pvc or path",
        id="adapter-with-two-sources",
    ),
    pytest.param(
        {"lora": {"maxLoras": 4, "maxCpuLoras": 2}},
        "spec.lora",
        "lora.maxCpuLoras must be >= lora.maxLoras",
        id="fewer-cpu-loras-than-loras",
    ),
    pytest.param(
        {
            "engine": {
                "kvOffload": {
                    "shared": {
                        "volume": {"emptyDir": {}, "persistentVolumeClaim": {"claimName": "kv"}}
                    }
                }
            }
        },
        "spec.engine.kvOffload.shared.volume",
        "set exactly one volume source: emptyDir, hostPath or persistentVolumeClaim",
        id="kv-shared-with-two-volume-sources",
    ),
    pytest.param(
        {"engine": {"kvOffload": {"hostMemory": "8GB"}}},
        "spec.engine.kvOffload.hostMemory",
        "should match",
        id="kv-host-memory-not-a-quantity",
    ),
    pytest.param(
        {"engine": {"kvOffload": {"shared": {"volume": {"hostPath": {"path": "var/kv"}}}}}},
        "spec.engine.kvOffload.shared.volume.hostPath.path",
        "should match '^/'",
        id="kv-shared-relative-host-path",
    ),
]


@pytest.mark.parametrize(("spec", "field", "message"), REJECTED)
def test_cel_rules_are_enforced_by_the_server(
    api: httpx.Client, spec: dict, field: str, message: str
) -> None:
    body = md_body("rejected")
    body["spec"].update(spec)
    resp = api.post(path(MD, NS), json=body, params={"dryRun": "All"})
    assert resp.status_code == 422, resp.text
    status = resp.json()
    assert status["reason"] == "Invalid"
    causes = status["details"]["causes"]
    assert any(c.get("field") == field and message in c.get("message", "") for c in causes), causes
    assert "hunter2" not in resp.text, "the API server echoed a Redis password"


def test_cel_rules_accept_the_limit_cases(api: httpx.Client) -> None:
    body = md_body(
        "edge",
        engine={
            "drainTimeoutSeconds": 54,
            "preStopSleepSeconds": 5,
            "terminationGracePeriodSeconds": 60,
        },
        autoscaling={"minReplicas": 0, "maxReplicas": 1},
        redis={"mode": "external", "url": "redis://redis.example:6379/0"},
    )
    resp = api.post(path(MD, NS), json=body, params={"dryRun": "All"})
    assert resp.status_code == 201, resp.text


def test_a_valid_kv_offload_is_admitted_and_defaulted(api: httpx.Client) -> None:
    kv = {"hostMemory": "512Mi", "shared": {"volume": {"hostPath": {"path": "/mnt/kv"}}}}
    body = md_body("kv-tiers", engine={"kvOffload": kv})
    resp = api.post(path(MD, NS), json=body, params={"dryRun": "All"})
    assert resp.status_code == 201, resp.text
    stored = resp.json()["spec"]["engine"]["kvOffload"]
    assert stored == {**kv, "shared": {**kv["shared"], "size": crd.DEFAULT_KV_SHARED_SIZE}}
    assert specs.apply_defaults(body["spec"]) == resp.json()["spec"]


# --- the operator against it ------------------------------------------------------------------


def test_create_renders_owned_children_by_server_side_apply(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(api, "demo")
    children = wait_children(cluster, md)
    kinds = {k for k, _ in children}
    generated = render.generated_secret_names("demo", specs.apply_defaults(dict(md["spec"])))
    assert {"Deployment", "Service", "Secret", "NetworkPolicy"} <= kinds
    for (kind, name), obj in children.items():
        refs = obj["metadata"].get("ownerReferences") or []
        assert refs == [
            {
                "apiVersion": crd.API_VERSION,
                "kind": MD,
                "name": "demo",
                "uid": md["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], (kind, name, refs)
        managers = {(m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
        # Rendered children by server-side apply; generated credentials are created once (POST).
        operation = "Update" if name in generated else "Apply"
        assert (render.FIELD_MANAGER, operation) in managers, (kind, name, managers)
    engine = children[("Deployment", render.names("demo")[render.ENGINE])]
    assert engine["spec"]["replicas"] == 1
    # Secrets under server-side apply carry `data` (base64), and the URL points at the managed Redis.
    secret = children[("Secret", redis_url_secret(md))]
    url = base64.b64decode(secret["data"]["url"]).decode()
    assert (
        url.startswith("redis://") and f"@{render.names('demo')[render.REDIS]}.{NS}.svc:" in url
    ), url


@pytest.mark.parametrize("case", sorted(RENDER_CASES))
def test_the_server_accepts_every_rendered_variant(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread, case: str
) -> None:
    """The specs of the golden render cases (test_render.py): admitted, and every child they
    render (PDBs, the shared cache's claim and Job, Recreate rollouts, pod template
    passthrough...) is accepted by the server's own validation."""
    md = create_md(api, case, **RENDER_CASES[case])
    children = wait_children(cluster, md)
    assert all(
        o["metadata"]["ownerReferences"][0]["uid"] == md["metadata"]["uid"]
        for o in children.values()
    )

    def reconciled() -> dict[str, Any]:
        conds = md_conditions(cluster, case)
        assert "Ready" in conds, conds
        return conds

    ready = wait_for(reconciled, timeout=20)["Ready"]
    assert ready["reason"] not in ("ApplyFailed", "InvalidSpec"), ready["message"]


def test_a_child_the_server_rejects_is_reported(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    """maxSurge 0 with maxUnavailable 0 is a Deployment the server refuses. Either the CRD
    refuses it at admission, or the operator reports the server's message (no hot loop)."""
    body = md_body(
        "stuck",
        engine={"rollout": {"strategy": "RollingUpdate", "maxSurge": 0, "maxUnavailable": 0}},
    )
    resp = api.post(path(MD, NS), json=body)
    if resp.status_code == 422:
        assert "spec.engine.rollout" in resp.text, resp.text
        return
    assert resp.status_code == 201, resp.text

    def reported() -> dict[str, Any]:
        ready = md_conditions(cluster, "stuck")["Ready"]
        assert ready["reason"] == "ApplyFailed", ready
        return ready

    ready = wait_for(reported, timeout=20)
    assert "may not be 0 when `maxSurge` is 0" in ready["message"], ready["message"]
    assert cluster.get("Deployment", NS, render.names("stuck")[render.ENGINE]) is None
    api.delete(path(MD, NS, "stuck")).raise_for_status()  # stop the operator's slow retries


def test_controller_manager_admits_the_engine_pods(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    """Deployment -> ReplicaSet -> Pod, in a namespace enforcing the restricted Pod Security level."""
    if cluster.controller_manager is None:
        pytest.skip("no kube-controller-manager beside kube-apiserver")
    md = create_md(api, "pods")
    wait_children(cluster, md)
    engine = render.names("pods")[render.ENGINE]

    def replicaset() -> dict[str, Any]:
        owned = [
            rs
            for rs in cluster.list("ReplicaSet", NS, render.selector_string("pods"))
            if any(
                r["kind"] == "Deployment" and r["name"] == engine
                for r in rs["metadata"]["ownerReferences"]
            )
        ]
        assert owned, "no ReplicaSet for the engine Deployment"
        return owned[0]

    rs = wait_for(replicaset, timeout=20, message="engine ReplicaSet")

    def pods() -> list[dict]:
        failures = [
            c
            for c in (cluster.get("ReplicaSet", NS, rs["metadata"]["name"]) or {})
            .get("status", {})
            .get("conditions", [])
            if c["type"] == "ReplicaFailure"
        ]
        assert not failures, failures[0]["message"]
        return cluster.list("Pod", NS, render.selector_string("pods"))

    found = wait_for(pods, timeout=20, message="engine pods")
    assert len(found) == 1


def test_status_conditions_are_written(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(api, "status")
    wait_children(cluster, md)

    def status() -> dict[str, Any]:
        obj = cluster.get(MD, NS, "status")
        st = obj["status"]
        assert st["observedGeneration"] == obj["metadata"]["generation"]
        assert {"Ready", "Progressing", "Degraded"} <= {c["type"] for c in st["conditions"]}
        return st

    st = wait_for(status, timeout=20)
    conds = {c["type"]: c for c in st["conditions"]}
    for c in conds.values():
        assert c["status"] in ("True", "False") and c["lastTransitionTime"] and c["reason"], c
    # No node runs the engines here, so nothing can be ready.
    assert conds["Ready"]["status"] == "False"
    assert conds["Ready"]["reason"] != "ApplyFailed", conds["Ready"]["message"]
    assert st["selector"] == render.selector_string("status")
    assert st["model"] == specs.served_model_name(specs.apply_defaults(md["spec"]))


def test_scale_subresource(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(api, "scaled")
    wait_children(cluster, md)
    scale_path = path(MD, NS, "scaled", "scale")
    resp = api.get(scale_path)
    assert resp.status_code == 200, resp.text
    scale = resp.json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1

    # `kubectl scale md scaled --replicas 2`
    resp = api.patch(
        scale_path,
        content=json.dumps({"spec": {"replicas": 2}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    assert cluster.get(MD, NS, "scaled")["spec"]["replicas"] == 2
    engine = render.names("scaled")[render.ENGINE]
    wait_for(
        lambda: cluster.get("Deployment", NS, engine)["spec"]["replicas"] == 2,
        timeout=HEAL_TIMEOUT,
        message="engine Deployment scaled to 2",
    )

    # The status side: the selector for an HPA, and the observed replica count.
    def scale_status() -> dict[str, Any]:
        s = api.get(scale_path).json()
        assert s["status"].get("selector") == render.selector_string("scaled"), s
        return s

    s = wait_for(scale_status, timeout=10)
    assert s["status"].get("replicas", 0) == (
        cluster.get(MD, NS, "scaled").get("status") or {}
    ).get("readyReplicas", 0)

    # Scale to zero is allowed (minimum 0) and reaches the Deployment.
    resp = api.patch(
        scale_path,
        content=json.dumps({"spec": {"replicas": 0}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: cluster.get("Deployment", NS, engine)["spec"]["replicas"] == 0,
        timeout=HEAL_TIMEOUT,
        message="engine Deployment scaled to 0",
    )


def test_autoscaling_bounds_the_engine_replicas(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(
        api, "bounded", autoscaling={"minReplicas": 2, "maxReplicas": 3, "intervalSeconds": 0.5}
    )
    wait_children(cluster, md)
    engine = render.names("bounded")[render.ENGINE]
    wait_for(
        lambda: cluster.get("Deployment", NS, engine)["spec"]["replicas"] == 2,
        timeout=HEAL_TIMEOUT,
        message="engine replicas clamped to minReplicas",
    )


def _recreated(cluster: ControlPlane, kind: str, name: str, old_uid: str) -> bool:
    obj = cluster.get(kind, NS, name)
    return obj is not None and obj["metadata"]["uid"] != old_uid


@pytest.mark.parametrize(
    "child", ["engine-deployment", "engine-service", "redis-url-secret", "netpol"]
)
def test_deleted_child_comes_back(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread, child: str
) -> None:
    name = f"heal-{child}"
    md = create_md(api, name)
    children = wait_children(cluster, md)
    n = render.names(name)
    kind, child_name = {
        "engine-deployment": ("Deployment", n[render.ENGINE]),
        "engine-service": ("Service", n[render.ENGINE]),
        "redis-url-secret": ("Secret", redis_url_secret(md)),
        "netpol": ("NetworkPolicy", n["netpol"]),
    }[child]
    old_uid = children[(kind, child_name)]["metadata"]["uid"]
    resp = api.delete(path(kind, NS, child_name))
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: _recreated(cluster, kind, child_name, old_uid),
        timeout=HEAL_TIMEOUT,
        message=f"{kind}/{child_name} recreated",
    )


def test_hand_edits_are_put_back(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(api, "edited")
    children = wait_children(cluster, md)
    name = render.names("edited")[render.ENGINE]
    original = children[("Deployment", name)]
    container = original["spec"]["template"]["spec"]["containers"][0]
    # `kubectl edit` / `kubectl scale deploy`: an update by another field manager.
    patch = {
        "spec": {
            "replicas": 5,
            "template": {
                "spec": {
                    "containers": [
                        {"name": container["name"], "image": "example.com/not-kvmesh:latest"}
                    ]
                }
            },
        }
    }
    resp = api.patch(
        path("Deployment", NS, name),
        content=json.dumps(patch),
        headers={"Content-Type": "application/strategic-merge-patch+json"},
        params={"fieldManager": "kubectl-edit"},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["spec"]["replicas"] == 5

    def restored() -> bool:
        dep = cluster.get("Deployment", NS, name)
        image = next(
            c["image"]
            for c in dep["spec"]["template"]["spec"]["containers"]
            if c["name"] == container["name"]
        )
        assert dep["spec"]["replicas"] == 1, dep["spec"]["replicas"]
        assert image == container["image"], image
        return True

    wait_for(restored, timeout=HEAL_TIMEOUT, message="replicas and image put back")


def test_external_autoscaler_owns_the_engine_replicas_and_conflicts_are_reported(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    """With autoscaling.mode external another manager (an HPA on the engine Deployment)
    legitimately owns spec.replicas: the operator applies without force, so the real
    server's field ownership decides; the conflict is a condition, not an overwrite."""
    md = create_md(api, "hpa", autoscaling={"mode": "external", "minReplicas": 1, "maxReplicas": 5})
    children = wait_children(cluster, md)
    name = render.names("hpa")[render.ENGINE]
    assert children[("Deployment", name)]["spec"]["replicas"] == 1
    # What the HPA controller sends: an update of the Deployment's scale by its own manager.
    resp = api.patch(
        path("Deployment", NS, name, "scale"),
        content=json.dumps({"spec": {"replicas": 4}}),
        headers={"Content-Type": "application/merge-patch+json"},
        params={"fieldManager": "horizontal-pod-autoscaler"},
    )
    assert resp.status_code == 200, resp.text
    # A spec change makes the operator re-apply the engine Deployment (new --max-num-seqs).
    resp = api.patch(
        path(MD, NS, "hpa"),
        content=json.dumps({"spec": {"engine": {"maxNumSeqs": 64}}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text

    def reapplied() -> dict[str, Any]:
        dep = cluster.get("Deployment", NS, name)
        command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--max-num-seqs") + 1] == "64", "not re-applied yet"
        return dep

    dep = wait_for(reapplied, timeout=HEAL_TIMEOUT, message="engine Deployment re-applied")
    assert dep["spec"]["replicas"] == 4  # the HPA's value stands
    conflict = wait_for(
        lambda: (
            (c := md_conditions(cluster, "hpa").get("ApplyConflict"))
            and c["status"] == "True"
            and c
        ),
        timeout=HEAL_TIMEOUT,
        message="ApplyConflict=True",
    )
    assert "replicas" in conflict["message"] and conflict["reason"] == "FieldManagedElsewhere"

    # Built-in autoscaling (the default) owns the field: a hand edit is put back by force.
    resp = api.patch(
        path(MD, NS, "hpa"),
        content=json.dumps({"spec": {"autoscaling": {"mode": "builtin"}}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: cluster.get("Deployment", NS, name)["spec"]["replicas"] == 1,
        timeout=HEAL_TIMEOUT,
        message="builtin mode re-asserts the operator's replica count",
    )
    wait_for(
        lambda: md_conditions(cluster, "hpa")["ApplyConflict"]["status"] == "False",
        timeout=HEAL_TIMEOUT,
        message="ApplyConflict cleared",
    )


def test_prune_spares_labelled_objects_it_does_not_control(
    cluster: ControlPlane,
    api: httpx.Client,
    operator: OperatorThread,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Switching to an external Redis prunes the managed Redis; objects that carry the
    deployment's label but that it does not control (no owner, another owner, it as a mere
    co-owner) stay, as the real server stores them (tests/operator/test_prune_safety.py
    has every trigger against the emulator)."""
    from tests.operator.test_prune_safety import PruneCounter

    prunes = PruneCounter(monkeypatch)
    md = create_md(api, "pruned")
    engine_uid = wait_children(cluster, md)[("Deployment", render.names("pruned")[render.ENGINE])][
        "metadata"
    ]["uid"]
    owner = cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "pruned-owner", "namespace": NS},
            "data": {"k": "dg=="},
        }
    )
    assert owner.status_code in (200, 201), owner.text
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "name": "pruned-owner",
        "uid": owner.json()["metadata"]["uid"],
        "controller": True,
    }
    ours = {
        "apiVersion": crd.API_VERSION,
        "kind": MD,
        "name": "pruned",
        "uid": md["metadata"]["uid"],
        "controller": False,
    }
    label = {render.LABEL_MD: "pruned", render.LABEL_COMPONENT: render.REDIS}

    def meta(name: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": NS,
            "labels": label,
            **({"ownerReferences": owners} if owners else {}),
        }

    strangers = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("pruned-stray", []),
            "spec": {"ports": [{"port": 80}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta("pruned-theirs", [theirs]),
            "data": {"k": "dg=="},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta("pruned-co-owned", [theirs, ours]),
            "spec": {"podSelector": {}},
        },
    ]
    uids = {}
    for obj in strangers:
        resp = cluster.apply(obj)
        assert resp.status_code in (200, 201), resp.text
        uids[(obj["kind"], obj["metadata"]["name"])] = resp.json()["metadata"]["uid"]
    since = prunes.passes
    resp = api.patch(
        path(MD, NS, "pruned"),
        content=json.dumps({"spec": {"redis": {"mode": "external", "url": redis_url}}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    n = render.names("pruned")
    managed = [
        ("Deployment", n[render.REDIS]),
        ("Service", n[render.REDIS]),
        ("NetworkPolicy", n["redis-netpol"]),
        ("Secret", n["redis-auth"]),
    ]
    wait_for(
        lambda: all(cluster.get(k, NS, name) is None for k, name in managed),
        timeout=HEAL_TIMEOUT,
        message="managed Redis pruned",
    )
    # Reconciles of one ModelDeployment run one at a time: the second pass after the
    # switch started once the strangers existed, and has finished.
    wait_for(lambda: prunes.passes >= since + 2, timeout=HEAL_TIMEOUT, message="two prune passes")
    for (kind, name), uid in uids.items():
        obj = cluster.get(kind, NS, name)
        assert obj is not None and obj["metadata"]["uid"] == uid, f"{kind}/{name} was pruned"
    assert cluster.get("Secret", NS, n["redis-secret"]) is not None
    assert cluster.get("Deployment", NS, n[render.ENGINE])["metadata"]["uid"] == engine_uid


def test_delete_garbage_collects_the_children(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    md = create_md(api, "doomed")
    children = wait_children(cluster, md)
    resp = api.delete(path(MD, NS, "doomed"))
    assert resp.status_code == 200, resp.text
    # The operator lets go of it (its finalizer, if any, is removed).
    wait_for(
        lambda: cluster.get(MD, NS, "doomed") is None, timeout=20, message="ModelDeployment deleted"
    )
    if cluster.controller_manager is None:
        for (kind, name), _ in children.items():
            obj = cluster.get(kind, NS, name)
            assert (
                obj is None or obj["metadata"]["ownerReferences"][0]["uid"] == md["metadata"]["uid"]
            )
        pytest.skip("no kube-controller-manager: owner references checked, garbage collection not")
    wait_for(
        lambda: all(cluster.get(k, NS, n) is None for k, n in children),
        timeout=GC_TIMEOUT,
        message="children garbage-collected",
    )
    # Including what the controller manager made from them (collected after their Deployment,
    # in a later pass of the garbage collector).
    wait_for(
        lambda: cluster.list("ReplicaSet", NS, f"{render.LABEL_MD}=doomed") == [],
        timeout=GC_TIMEOUT,
        message="ReplicaSets garbage-collected",
    )


# --- RBAC: runs last, over everything the operator did in this module -------------------------


def test_operator_runs_within_its_rbac(
    cluster: ControlPlane, operator: OperatorThread, operator_logs: LogCapture
) -> None:
    token = cluster.request_token(OPERATOR_NS, OPERATOR_SA)
    with httpx.Client(
        base_url=cluster.server,
        verify=cluster.ssl_context(),
        headers={"Authorization": f"Bearer {token}"},
    ) as sa:
        # RBAC is enforced: what the ClusterRole does not grant is forbidden.
        assert sa.get("/api/v1/namespaces").status_code == 403
        assert sa.get(path("CustomResourceDefinition")).status_code == 403
        assert sa.get(path(MD, NS)).status_code == 200
    # ...and nothing the operator did in this module was refused.
    refused = [
        m for m in operator_logs.messages(logging.WARNING) if "403" in m or "forbidden" in m.lower()
    ]
    assert not refused, "\n".join(refused[:5])


def _phase_pod(md: str, suffix: str) -> dict[str, Any]:
    """A hand-made engine pod of ``md`` (no ReplicaSet owns it: no controller changes it)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{md}-engine-{suffix}",
            "namespace": NS,
            "labels": render.labels(md, render.ENGINE),
            "finalizers": ["kvmesh.test/hold"],  # a deleted pod stays, terminating
        },
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "engine",
                    "image": "kvmesh/engine:test",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def test_pods_in_every_phase_are_counted_exactly(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread
) -> None:
    """Pods in every phase a kubelet reports, their status written through the status subresource:
    the autoscaler counts the Running-and-Ready one as capacity, every other live one (Pending,
    Running-not-Ready, Unknown) as pending, stuck once past startupTimeoutSeconds, and leaves the
    terminating and finished ones out; status.readyReplicas is the engine Deployment's alone."""
    from tests.operator.pod_phases import LEFT_OUT, LISTED, PHASES

    md = create_md(
        api,
        "phases",
        replicas=0,  # no pod of the Deployment's own: only these
        autoscaling={
            "minReplicas": 0,
            "maxReplicas": 2,
            "intervalSeconds": 0.5,
            "startupTimeoutSeconds": 1,
        },
    )
    wait_children(cluster, md)
    names = {s: f"phases-engine-{s}" for s in PHASES}
    try:
        for suffix, (status, terminating) in PHASES.items():
            resp = api.post(path("Pod", NS), json=_phase_pod("phases", suffix))
            assert resp.status_code == 201, resp.text
            resp = api.patch(
                path("Pod", NS, names[suffix], "status"),
                content=json.dumps({"status": status}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["status"]["phase"] == status["phase"]
            if terminating:
                assert api.delete(path("Pod", NS, names[suffix])).status_code == 200
                assert cluster.get("Pod", NS, names[suffix])["metadata"]["deletionTimestamp"]
        stuck = sorted(names[s] for s, ready in LISTED.items() if not ready)

        def decided() -> tuple[dict[str, Any], dict[str, Any]]:
            # A scaling decision is written before it is acted on and the conditions after:
            # wait for both, then pin them exactly.
            d = cluster.get(MD, NS, "phases")["status"]["lastDecision"]
            assert d["stuckPods"] == stuck, d
            degraded = md_conditions(cluster, "phases")["Degraded"]
            assert degraded["status"] == "True", degraded
            return d, degraded

        decision, degraded = wait_for(decided, timeout=HEAL_TIMEOUT, interval=0.2)
        assert decision["readyReplicas"] == 1
        assert not set(decision["reason"].split()) & {names[s] for s in LEFT_OUT}
        status = cluster.get(MD, NS, "phases")["status"]
        assert status["readyReplicas"] == 0 and status["replicas"] == 0
        assert (degraded["status"], degraded["reason"]) == ("True", "ReplicasNotStarting")
        assert degraded["message"] == (
            f"{len(stuck)} engine pod(s) not Ready within 1s of their creation: {', '.join(stuck)}"
        )
    finally:
        for n in names.values():
            api.patch(
                path("Pod", NS, n),
                content=json.dumps({"metadata": {"finalizers": None}}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
            api.delete(path("Pod", NS, n), params={"gracePeriodSeconds": 0})
        api.delete(path(MD, NS, "phases"))


def _ready_pod(api: httpx.Client, md: str, suffix: str) -> str:
    """A hand-made engine pod, Running and Ready as a kubelet would report it."""
    body = _phase_pod(md, suffix)
    resp = api.post(path("Pod", NS), json=body)
    assert resp.status_code == 201, resp.text
    name = body["metadata"]["name"]
    status = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "podIP": "127.0.0.1",  # where its stub engine listens
    }
    resp = api.patch(
        path("Pod", NS, name, "status"),
        content=json.dumps({"status": status}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    return name


def _set_adapters(api: httpx.Client, name: str, adapters: list[dict[str, Any]]) -> None:
    resp = api.patch(
        path(MD, NS, name),
        content=json.dumps({"spec": {"adapters": adapters}}),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text


def test_adapters_load_and_unload_on_the_ready_pods_without_a_rollout(
    cluster: ControlPlane, api: httpx.Client, operator: OperatorThread, redis_url: str
) -> None:
    """Through the real server (RBAC, the status subresource, the CRD's printer column): an
    added adapter is loaded once on each ready pod, a removed one unloaded, a failed load is in
    status with its reason, and the engine Deployment's pod template never changes."""
    from tests.operator.adapter_engines import EnginesThread

    md = create_md(api, "lora", replicas=0, lora={"maxLoras": 2}, adapters=[_adapter("sql")])
    wait_children(cluster, md)
    pods = []
    try:
        pods = [_ready_pod(api, "lora", s) for s in ("a", "b")]
        with EnginesThread(redis_url, specs.served_model_name(md["spec"]), pods) as engines:
            engines.fail["broken"] = "Loading lora broken failed: no adapter_config.json"

            def status() -> dict[str, Any]:
                return cluster.get(MD, NS, "lora").get("status") or {}

            wait_for(lambda: status().get("adaptersReady") == "1/1", timeout=HEAL_TIMEOUT)
            template = cluster.get("Deployment", NS, "lora-engine")["spec"]["template"]
            _set_adapters(api, "lora", [_adapter("sql"), _adapter("chat"), _adapter("broken")])
            wait_for(lambda: status().get("adaptersReady") == "2/3", timeout=HEAL_TIMEOUT)
            assert engines.count("load_lora_adapter", "chat") == {p: 1 for p in pods}
            broken = next(a for a in status()["adapters"] if a["name"] == "broken")
            assert broken["state"] == "Failed"
            assert {r["reason"] for r in broken["replicas"]} == {
                "HTTP 400: Loading lora broken failed: no adapter_config.json"
            }
            # `kubectl get md` prints the column from the CRD.
            table = api.get(
                path(MD, NS, "lora"),
                headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            ).json()
            column = [c["name"] for c in table["columnDefinitions"]].index("Adapters")
            assert table["rows"][0]["cells"][column] == "2/3"

            _set_adapters(api, "lora", [_adapter("sql")])
            wait_for(lambda: status().get("adaptersReady") == "1/1", timeout=HEAL_TIMEOUT)
            wait_for(
                lambda: engines.count("unload_lora_adapter", "chat") == {p: 1 for p in pods},
                timeout=HEAL_TIMEOUT,
            )
            assert engines.count("load_lora_adapter", "sql") == {p: 1 for p in pods}
            config = cluster.get("ConfigMap", NS, "lora-adapters")
            assert config["data"]["lora-modules"] == "sql=/srv/adapters/sql\n"
            assert cluster.get("Deployment", NS, "lora-engine")["spec"]["template"] == template
    finally:
        for n in pods:
            api.patch(
                path("Pod", NS, n),
                content=json.dumps({"metadata": {"finalizers": None}}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
            api.delete(path("Pod", NS, n), params={"gracePeriodSeconds": 0})
        api.delete(path(MD, NS, "lora"))
