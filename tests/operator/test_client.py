"""The operator's API client (kvmesh.operator.apply.KubeClient, on the official
``kubernetes`` client's DynamicClient) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import os
import socket

import kopf
import pytest

from kvmesh.operator import crd
from kvmesh.operator.apply import ApiError, ApplyConflict, Connection, KubeClient, object_path
from kvmesh.operator.render import FIELD_MANAGER
from tests.operator.conftest import DEPLOYMENTS, MD, PODS, md_body


def pod(name: str, **labels: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "img:1"}]},
    }


def requests(k8s, method: str, path_end: str) -> list:
    return [
        r
        for r in k8s._requests
        if str(getattr(r.method, "value", r.method)).upper() == method
        and r.url.path.endswith(path_end)
    ]


@pytest.fixture()
async def client(k8s):
    c = KubeClient(Connection(server=str(k8s.url).rstrip("/")), retries=3, backoff=0.01)
    yield c
    await c.close()


async def test_apply_creates_then_updates_with_the_operators_field_manager(k8s, client):
    created = await client.apply(pod("p", app="a"))
    assert created["metadata"]["uid"] and created["metadata"]["labels"] == {"app": "a"}
    changed = pod("p", app="a", tier="x")
    changed["spec"]["containers"][0]["image"] = "img:2"
    updated = await client.apply(changed)
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]
    stored = k8s.fetch_object(PODS, "ns", "p")
    assert stored["spec"]["containers"][0]["image"] == "img:2"
    assert stored["metadata"]["labels"] == {"app": "a", "tier": "x"}
    applies = requests(k8s, "PATCH", "/api/v1/namespaces/ns/pods/p")
    assert len(applies) == 2
    for r in applies:
        assert r.headers["Content-Type"].startswith("application/apply-patch+yaml")
        assert r.params["fieldManager"] == FIELD_MANAGER == "kvmesh-operator"
        assert r.params["force"] == "true"
        assert r.headers["User-Agent"].startswith(
            "kvmesh"
        )  # conftest.used_permissions counts these


async def test_apply_without_force_reports_a_conflict_and_does_not_retry_it(k8s, client):
    await client.apply(pod("p", app="a"))
    k8s.inject_fault("PATCH", r"/pods/p$", status=409, times=4)  # another manager owns a field
    with pytest.raises(ApplyConflict) as info:
        await client.apply(pod("p", app="b"), force=False)
    assert info.value.status == 409 and not info.value.transient
    attempts = requests(k8s, "PATCH", "/pods/p")[1:]
    assert len(attempts) == 1 and attempts[0].params["force"] == "false"
    assert k8s.fetch_object(PODS, "ns", "p")["metadata"]["labels"] == {"app": "a"}
    # With force, a 409 is a transient conflict (e.g. a concurrent write): retried until it applies
    # (3 more injected 409s, then the 4th try).
    applied = await client.apply(pod("p", app="c"))
    assert applied["metadata"]["labels"] == {"app": "c"}
    assert len(requests(k8s, "PATCH", "/pods/p")) == 1 + 1 + 4


async def test_get_returns_none_for_a_missing_object(k8s, client):
    assert await client.get("Pod", "ns", "nope") is None
    assert await client.get(crd.KIND, "ns", "nope") is None
    await k8s.put_object(MD, md_body("demo", replicas=2))
    md = await client.get(crd.KIND, "ns", "demo")
    assert md["spec"]["replicas"] == 2 and md["kind"] == crd.KIND


async def test_list_with_label_selectors(client):
    for name, labels in (
        ("a1", {"app": "a", "tier": "web"}),
        ("a2", {"app": "a"}),
        ("b1", {"app": "b"}),
    ):
        await client.apply(pod(name, **labels))
    names = lambda items: sorted(o["metadata"]["name"] for o in items)  # noqa: E731
    assert names(await client.list("Pod", "ns")) == ["a1", "a2", "b1"]
    assert names(await client.list("Pod", "ns", "app=a")) == ["a1", "a2"]
    assert names(await client.list("Pod", "ns", "app=a,tier=web")) == ["a1"]
    assert names(await client.list("Pod", "ns", "app in (a,b),!tier")) == ["a2", "b1"]
    assert await client.list("Pod", "other") == []


async def test_status_patch_goes_to_the_status_subresource(k8s, client):
    await k8s.put_object(MD, md_body("demo", replicas=2))
    before = k8s.fetch_object(MD, "ns", "demo")
    result = await client.patch_status(crd.KIND, "ns", "demo", {"readyReplicas": 1, "model": "m"})
    assert result["status"] == {"readyReplicas": 1, "model": "m"}
    await client.patch_status(crd.KIND, "ns", "demo", {"readyReplicas": 2})
    after = k8s.fetch_object(MD, "ns", "demo")
    assert after["status"] == {"readyReplicas": 2, "model": "m"}  # a merge patch
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert requests(k8s, "PATCH", "/modeldeployments/demo/status")
    # A merge patch of the main resource (annotations) leaves the status alone.
    await client.patch(
        crd.KIND, "ns", "demo", {"metadata": {"annotations": {"k": "v"}}, "status": {"model": "x"}}
    )
    after = k8s.fetch_object(MD, "ns", "demo")
    assert after["metadata"]["annotations"]["k"] == "v" and after["status"]["model"] == "m"


async def test_patch_of_a_missing_object_is_a_404(client):
    with pytest.raises(ApiError) as info:
        await client.patch("Pod", "ns", "nope", {"metadata": {"annotations": {"k": "v"}}})
    assert info.value.status == 404 and not info.value.transient


async def test_scale_subresource_sets_spec_replicas(k8s, client):
    await k8s.put_object(MD, md_body("demo", replicas=1))
    scale = await client.scale(crd.KIND, "ns", "demo", 3)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert k8s.fetch_object(MD, "ns", "demo")["spec"]["replicas"] == 3
    assert (
        requests(k8s, "PATCH", "/modeldeployments/demo/scale")[0]
        .headers["Content-Type"]
        .startswith("application/merge-patch+json")
    )
    # Pods have no scale subresource: named, not sent.
    with pytest.raises(ApiError) as info:
        await client.scale("Pod", "ns", "p", 2)
    assert info.value.status == 404 and "scale" in info.value.message


async def test_delete_removes_and_tolerates_gone(k8s, client):
    owner = await client.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"replicas": 1},
        }
    )
    child = pod("p")
    child["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "d",
            "uid": owner["metadata"]["uid"],
        }
    ]
    await client.apply(child)
    await client.delete("Deployment", "ns", "d")
    assert k8s.fetch_object(DEPLOYMENTS, "ns", "d") is None
    assert k8s.fetch_object(PODS, "ns", "p") is None  # background propagation: the GC took it
    await client.delete("Deployment", "ns", "d")  # already gone: fine
    assert len(requests(k8s, "DELETE", "/deployments/d")) == 2


async def test_transient_errors_are_retried_with_backoff(k8s, client):
    await client.apply(pod("p", app="a"))
    k8s.inject_fault("GET", r"/pods/p$", status=503, times=2)
    k8s.inject_fault("PATCH", r"/pods/p/status$", status=429, times=1)
    k8s.inject_fault("PATCH", r"/pods/p$", status=500, times=3)
    assert (await client.get("Pod", "ns", "p"))["metadata"]["name"] == "p"
    assert len(requests(k8s, "GET", "/pods/p")) == 3
    await client.patch_status("Pod", "ns", "p", {"phase": "Running"})
    assert len(requests(k8s, "PATCH", "/pods/p/status")) == 2
    await client.patch(
        "Pod", "ns", "p", {"metadata": {"annotations": {"k": "v"}}}
    )  # the 4th try succeeds
    assert k8s.fetch_object(PODS, "ns", "p")["metadata"]["annotations"] == {"k": "v"}
    # More failures than retries: the last error surfaces, still marked transient.
    k8s.inject_fault("GET", r"/pods/p$", status=503, times=10)
    with pytest.raises(ApiError) as info:
        await client.get("Pod", "ns", "p")
    assert (
        info.value.status == 503 and info.value.transient and "injected fault" in info.value.message
    )
    assert len(requests(k8s, "GET", "/pods/p")) == 3 + 4  # 1 + retries (3)


async def test_client_errors_are_not_retried(k8s, client):
    await client.apply(pod("p"))
    k8s.inject_fault("PATCH", r"/pods/p$", status=422, times=3)
    with pytest.raises(ApiError) as info:
        await client.apply(pod("p"))
    assert info.value.status == 422 and not info.value.transient
    assert len(requests(k8s, "PATCH", "/pods/p")) == 2


async def test_connection_errors_are_transient_and_retried():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = KubeClient(Connection(server=f"http://127.0.0.1:{port}"), retries=2, backoff=0.01)
    try:
        with pytest.raises(ApiError) as info:
            await client.get("Pod", "ns", "p")
        assert (
            info.value.status == 503
            and info.value.transient
            and "connection error" in info.value.message
        )
    finally:
        await client.close()


async def test_calls_run_off_the_event_loop(k8s, client, monkeypatch):
    """The library is synchronous: a request in flight must leave the loop free (here the
    emulator itself runs on the test's loop, so a blocked loop could not even answer)."""
    await client.get("Pod", "ns", "warm-up")  # discovery done
    arrived, release = asyncio.Event(), asyncio.Event()
    handle = k8s._handle

    async def held(request):
        if request.url.path.endswith("/pods/slow"):
            arrived.set()
            await release.wait()
        return await handle(request)

    monkeypatch.setattr(k8s, "_handle", held)
    call = asyncio.create_task(client.get("Pod", "ns", "slow"))
    await asyncio.wait_for(arrived.wait(), timeout=10)
    assert not call.done()
    release.set()
    assert await asyncio.wait_for(call, timeout=10) is None


async def test_discovery_is_cached_and_refreshed_for_new_kinds(k8s):
    k8s.resources.pop(next(r for r in k8s.resources if getattr(r, "plural", None) == crd.PLURAL))
    client = KubeClient(Connection(server=str(k8s.url).rstrip("/")), retries=0)
    try:
        assert await client.get(crd.KIND, "ns", "demo") is None  # CRD not installed: not served
        for _ in range(3):
            await client.apply(pod("p"))
            await client.list("Pod", "ns")
            await client.get("Deployment", "ns", "d")
        assert len(requests(k8s, "GET", "/api/v1")) == 1
        assert len(requests(k8s, "GET", "/apis/apps/v1")) == 1
        groups_lookups = len(requests(k8s, "GET", "/apis"))
        # The CRD appears later: the next miss re-discovers, then it is found.
        k8s.register(MD, crd.KIND, subresources=("status", "scale"))
        await k8s.put_object(MD, md_body("demo", replicas=2))
        assert (await client.get(crd.KIND, "ns", "demo"))["spec"]["replicas"] == 2
        assert (await client.scale(crd.KIND, "ns", "demo", 4))["spec"]["replicas"] == 4
        assert len(requests(k8s, "GET", "/apis")) == groups_lookups + 1
    finally:
        await client.close()


async def test_raw_request_and_object_path(k8s, client):
    await client.apply(pod("p"))
    path = object_path("Pod", "ns", "p")
    assert path == "/api/v1/namespaces/ns/pods/p"
    result = await client.request(
        "PATCH",
        path,
        body={"metadata": {"annotations": {"c": "1"}}},
        content_type="application/merge-patch+json",
    )
    assert result["metadata"]["annotations"] == {"c": "1"}
    listed = await client.request(
        "GET", object_path("Pod", "ns"), params={"labelSelector": "app=none"}
    )
    assert listed["items"] == []


async def test_credentials_from_kopf_token_and_inline_pem(k8s):
    info = kopf.ConnectionInfo(
        server=str(k8s.url).rstrip("/"),
        token="s3cret",
        ca_data=b"-----CA-----\n",
        certificate_data=b"-----CERT-----\n",
        private_key_data=b"-----KEY-----\n",
        insecure=True,
    )
    conn = Connection.from_kopf(info)
    cfg, temp = conn.configuration()
    try:
        assert cfg.host == conn.server and cfg.verify_ssl is False
        assert open(cfg.ssl_ca_cert, "rb").read() == b"-----CA-----\n"
        assert open(cfg.cert_file, "rb").read() == b"-----CERT-----\n"
        assert open(cfg.key_file, "rb").read() == b"-----KEY-----\n"
        assert sorted(temp) == sorted([cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file])
    finally:
        for path in temp:
            os.unlink(path)
    paths = Connection(
        server="https://k8s:6443",
        ca_path="/ca.crt",
        certificate_path="/c.crt",
        private_key_path="/c.key",
    ).configuration()
    assert (paths[0].ssl_ca_cert, paths[0].cert_file, paths[0].key_file, paths[1]) == (
        "/ca.crt",
        "/c.crt",
        "/c.key",
        [],
    )
    assert paths[0].verify_ssl is True

    client = KubeClient(
        conn, retries=0
    )  # plain http here: the bearer token is what the server sees
    try:
        assert await client.get("Pod", "ns", "p") is None
        written = list(client._temp_files)
        assert written and all(os.path.exists(p) for p in written)
    finally:
        await client.close()
    assert not any(os.path.exists(p) for p in written)  # the PEM files go with the client
    sent = requests(k8s, "GET", "/pods/p")[-1].headers
    assert sent["Authorization"] == "Bearer s3cret" and sent["User-Agent"].startswith("kvmesh")


async def test_apiserver_credentials_conflicts_and_subresources(tmp_path):
    """The same client against a real kube-apiserver (skipped without one; see
    tests/operator/apiserver_env.py): TLS with a CA file or inline CA and client-certificate
    data, bearer tokens, a real field-ownership conflict, /scale and /status, RBAC errors."""
    import subprocess

    from tests.operator.apiserver_env import ControlPlane, find_environment

    assets, why = find_environment()
    if assets is None:
        pytest.skip(f"no real control plane: {why}")
    cp = ControlPlane(assets, tmp_path)
    clients: list[KubeClient] = []

    def make(**kw) -> KubeClient:
        clients.append(KubeClient(Connection(server=cp.server, **kw), retries=1, backoff=0.01))
        return clients[-1]

    try:
        await asyncio.to_thread(cp.start)
        cp.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
        ).raise_for_status()
        for args in (
            [
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "client.key",
                "-out",
                "client.csr",
                "-subj",
                "/O=system:masters/CN=cert-admin",
            ],
            [
                "x509",
                "-req",
                "-in",
                "client.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "client.crt",
                "-days",
                "1",
            ],
        ):
            subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)
        admin = make(token=cp.admin_token, ca_path=cp.ca_path)
        by_cert = make(
            ca_data=(tmp_path / "ca.crt").read_bytes(),
            certificate_data=(tmp_path / "client.crt").read_bytes(),
            private_key_data=(tmp_path / "client.key").read_bytes(),
        )
        stranger = make(token="not-a-token", ca_path=cp.ca_path)
        unverified = make(token=cp.admin_token)  # the test CA is not trusted

        dep = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "ns", "labels": {"app": "x"}},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "x"}},
                "template": {
                    "metadata": {"labels": {"app": "x"}},
                    "spec": {"containers": [{"name": "c", "image": "img:1"}]},
                },
            },
        }
        created = await by_cert.apply(dep)
        assert [m["manager"] for m in created["metadata"]["managedFields"]] == [FIELD_MANAGER]
        assert [o["metadata"]["name"] for o in await admin.list("Deployment", "ns", "app=x")] == [
            "d"
        ]
        assert await admin.list("Deployment", "ns", "app=y") == []
        # Another manager (an HPA, say) takes spec.replicas: without force the apply conflicts.
        cp.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "d", "namespace": "ns"},
                "spec": {"replicas": 5},
            },
            manager="hpa",
        ).raise_for_status()
        with pytest.raises(ApplyConflict) as info:
            await admin.apply(dep, force=False)
        assert "hpa" in info.value.message and ".spec.replicas" in info.value.message
        assert (await admin.apply(dep))["spec"]["replicas"] == 2  # force takes it back
        assert (await admin.scale("Deployment", "ns", "d", 3))["spec"]["replicas"] == 3
        status = await admin.patch_status("Deployment", "ns", "d", {"observedGeneration": 99})
        assert status["status"]["observedGeneration"] == 99
        patched = await admin.patch(
            "Deployment", "ns", "d", {"metadata": {"annotations": {"a": "b"}}}
        )
        assert patched["metadata"]["annotations"] == {"a": "b"}
        await admin.delete("Deployment", "ns", "d")
        await admin.delete("Deployment", "ns", "d")
        assert await admin.get("Deployment", "ns", "d") is None

        with pytest.raises(ApiError) as info:
            await stranger.get("Deployment", "ns", "d")
        assert info.value.status == 401 and not info.value.transient
        with pytest.raises(ApiError) as info:
            await unverified.get("Deployment", "ns", "d")
        assert info.value.status == 503 and "CERTIFICATE_VERIFY_FAILED" in info.value.message
    finally:
        for c in clients:
            await c.close()
        await asyncio.to_thread(cp.stop)
