"""The node agent against the real control plane: pods run as local processes with their
own IPs, env, volumes, probes, restarts, deletion and status (one cluster for the module)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvmesh_testing.cluster import LocalCluster
from kvmesh_testing.node.images import HOST_PATHS
from tests.cluster.conftest import condition, container_status, namespace, pod, wait_for, wait_pod

NS = "agent"


def http(url: str, timeout: float = 5.0) -> httpx.Response:
    return httpx.get(url, timeout=timeout, trust_env=False)


@pytest.fixture(scope="module")
def ns(cluster: LocalCluster) -> str:
    return namespace(cluster, NS)


READY = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}


def standin(name: str = "web", **extra) -> dict:
    """The stand-in server; Ready once it serves (its SIGTERM handler is set by then)."""
    return {
        "name": name,
        "image": "example.com/standin:1",
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": READY,
        **extra,
    }


def running(cluster: LocalCluster, name: str, ns: str = NS, timeout: float = 30.0) -> dict:
    return wait_pod(
        cluster, ns, name, lambda p: condition(p, "Ready") == "True", timeout, f"pod {name} Ready"
    )


def events(cluster: LocalCluster, ns: str, pod_name: str) -> list[dict]:
    return [e for e in cluster.api.list("Event", ns) if e["involvedObject"]["name"] == pod_name]


def test_env_and_volumes_reach_the_container(cluster: LocalCluster, ns: str) -> None:
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": ns},
            "data": {"password": base64.b64encode(b"s3cret").decode()},
        }
    )
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings", "namespace": ns},
            "data": {"mode": "fast", "app.conf": "level=3\n"},
        }
    )
    script = (
        "import os, json, pathlib\n"
        "files = {p: pathlib.Path(p).read_text() for p in ['/etc/app/app.conf', '/etc/creds/password',"
        " '/etc/podinfo/labels', '/etc/one/mode']}\n"
        "pathlib.Path('/scratch/x').write_text('w')\n"
        "try:\n    pathlib.Path('/etc/app/new').write_text('w'); ro = False\n"
        "except OSError:\n    ro = True\n"
        "print(json.dumps({'env': {k: os.environ.get(k) for k in ['PASSWORD', 'MODE', 'CFG_mode', 'MY_IP',"
        " 'MY_NAME', 'MY_NS', 'MY_NODE', 'MEM_MI', 'REF', 'KUBERNETES_SERVICE_HOST', 'HOME']},"
        " 'files': files, 'read_only': ro, 'hostname': os.uname().nodename}), flush=True)\n"
    )
    container = {
        "name": "main",
        "image": "example.com/python:1",
        "args": ["-c", script],
        "env": [
            {
                "name": "PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
            },
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "REF", "value": "ip=$(MY_IP) literal=$$(MY_IP)"},
        ],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "resources": {"limits": {"memory": "96Mi"}},
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/app", "readOnly": True},
            {"name": "creds", "mountPath": "/etc/creds"},
            {"name": "podinfo", "mountPath": "/etc/podinfo"},
            {"name": "cfg", "mountPath": "/etc/one", "subPath": "."},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    }
    cluster.api.apply(
        pod(
            "envvol",
            ns,
            [container],
            restartPolicy="Never",
            volumes=[
                {"name": "cfg", "configMap": {"name": "settings"}},
                {"name": "creds", "secret": {"secretName": "creds"}},
                {
                    "name": "podinfo",
                    "downwardAPI": {
                        "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                    },
                },
                {"name": "scratch", "emptyDir": {}},
            ],
        )
    )
    done = wait_pod(
        cluster,
        ns,
        "envvol",
        lambda p: p["status"].get("phase") == "Succeeded",
        message="envvol done",
    )
    out = json.loads(cluster.pod_log(ns, "envvol", "main").strip().splitlines()[-1])
    ip = done["status"]["podIP"]
    assert out["env"] == {
        "PASSWORD": "s3cret",
        "MODE": "fast",
        "CFG_mode": "fast",
        "MY_IP": ip,
        "MY_NAME": "envvol",
        "MY_NS": ns,
        "MY_NODE": "kvmesh-node",
        "MEM_MI": "96",
        "REF": f"ip={ip} literal=$(MY_IP)",
        "KUBERNETES_SERVICE_HOST": cluster.net.apiserver_service_ip,
        "HOME": "/root",
    }
    assert out["files"] == {
        "/etc/app/app.conf": "level=3\n",
        "/etc/creds/password": "s3cret",
        "/etc/podinfo/labels": 'test="envvol"',
        "/etc/one/mode": "fast",
    }
    assert out["read_only"] is True
    assert out["hostname"] == "envvol"
    status = container_status(done, "main")
    assert (
        status["state"]["terminated"]["exitCode"] == 0
        and status["state"]["terminated"]["reason"] == "Completed"
    )
    assert not os.path.exists("/etc/app/app.conf"), "a pod's mounts must not show on the host"


def test_readiness_probe_flips_ready_and_the_endpoint(cluster: LocalCluster, ns: str) -> None:
    c = standin(
        readinessProbe={
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 1,
        }
    )
    c["env"] = [{"name": "START_READY", "value": "0"}]
    cluster.api.apply(pod("flip", ns, [c]))
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "flip", "namespace": ns},
            "spec": {
                "selector": {"test": "flip"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            },
        }
    )
    p = wait_pod(
        cluster, ns, "flip", lambda p: container_status(p, "web")["started"], message="flip started"
    )
    assert condition(p, "Ready") == "False" and container_status(p, "web")["ready"] is False
    ip = p["status"]["podIP"]

    def endpoint_ready() -> bool | None:
        slices = cluster.api.list("EndpointSlice", ns, "kubernetes.io/service-name=flip")
        return next(
            (
                e["conditions"].get("ready")
                for s in slices
                for e in s.get("endpoints") or []
                if ip in e["addresses"]
            ),
            None,
        )

    time.sleep(1.5)
    assert condition(cluster.pod(ns, "flip"), "Ready") == "False"
    http(f"http://{ip}:8000/set?ready=1")
    running(cluster, "flip", ns)
    wait_for(lambda: endpoint_ready() is True, message="the EndpointSlice marks the pod ready")
    assert http(cluster.service_url(ns, "flip", 80) + "/ready").status_code == 200
    http(f"http://{ip}:8000/set?ready=0")
    wait_for(
        lambda: condition(cluster.pod(ns, "flip"), "Ready") == "False",
        message="flip not Ready again",
    )
    wait_for(lambda: endpoint_ready() is False, message="the EndpointSlice marks the pod not ready")


def test_liveness_failure_restarts_the_container(cluster: LocalCluster, ns: str) -> None:
    c = standin(
        livenessProbe={
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        }
    )
    cluster.api.apply(pod("live", ns, [c]))
    p = running(cluster, "live", ns)
    first_pid = cluster.processes(ns, "live")["web"]
    http(f"http://{p['status']['podIP']}:8000/set?healthy=0")
    p = wait_pod(
        cluster,
        ns,
        "live",
        lambda p: (
            container_status(p, "web")["restartCount"] == 1 and condition(p, "Ready") == "True"
        ),
        message="live restarted once and Ready",
    )
    status = container_status(p, "web")
    last = status["lastState"]["terminated"]
    assert last["exitCode"] == 0 and "liveness probe" in last["message"], (
        last
    )  # the stand-in exits 0 on SIGTERM
    assert "running" in status["state"]
    assert cluster.processes(ns, "live")["web"] != first_pid
    assert "got SIGTERM" in cluster.pod_log(ns, "live", "web", previous=True)
    # kubectl describe tells the story: the probe failures and the kill
    seen = wait_for(
        lambda: (
            {e["reason"] for e in events(cluster, ns, "live")}
            >= {"Unhealthy", "Killing", "Started"}
            and events(cluster, ns, "live")
        ),
        message="the events",
    )
    # a probe that lands before a (re)started server listens is refused: that is an Unhealthy event too
    unhealthy = [e["message"] for e in seen if e["reason"] == "Unhealthy"]
    assert any(
        m.startswith("Liveness probe failed: HTTP probe failed with statuscode: 500")
        for m in unhealthy
    ), unhealthy


def test_a_crashing_container_backs_off(cluster: LocalCluster, ns: str) -> None:
    c = {
        "name": "crash",
        "image": "example.com/python:1",
        "args": ["-c", "import sys; print('boom'); sys.exit(3)"],
    }
    cluster.api.apply(pod("crash", ns, [c]))

    def backing_off(p: dict) -> bool:
        s = container_status(p, "crash")
        return (
            s["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff"
            and s["restartCount"] >= 1
        )

    seen_backoff = container_status(
        wait_pod(cluster, ns, "crash", backing_off, message="CrashLoopBackOff"), "crash"
    )
    assert seen_backoff["lastState"]["terminated"]["exitCode"] == 3
    assert seen_backoff["lastState"]["terminated"]["reason"] == "Error"
    assert "back-off" in seen_backoff["state"]["waiting"]["message"]
    start = time.monotonic()
    wait_for(
        lambda: container_status(cluster.pod(ns, "crash"), "crash")["restartCount"] >= 4,
        timeout=40,
        message="restarts keep coming",
    )
    # the later restarts wait 1 s, then 2 s (the cap) each: restarting at once would take well under a second
    assert time.monotonic() - start >= 1.8
    p = cluster.pod(ns, "crash")
    assert p["status"]["phase"] == "Running" and condition(p, "Ready") == "False"
    assert "boom" in cluster.pod_log(ns, "crash", "crash")
    assert any(
        e["reason"] == "BackOff" and e["type"] == "Warning" for e in events(cluster, ns, "crash")
    )


def test_delete_sends_sigterm_then_sigkill_after_the_grace_period(
    cluster: LocalCluster, ns: str
) -> None:
    stubborn = standin(env=[{"name": "IGNORE_TERM", "value": "1"}])
    cluster.api.apply(pod("stubborn", ns, [stubborn], terminationGracePeriodSeconds=3))
    cluster.api.apply(pod("polite", ns, [standin()], terminationGracePeriodSeconds=30))
    running(cluster, "stubborn", ns)
    running(cluster, "polite", ns)
    pids = {name: cluster.processes(ns, name)["web"] for name in ("stubborn", "polite")}
    start = time.monotonic()
    cluster.api.delete("Pod", ns, "stubborn")
    cluster.api.delete("Pod", ns, "polite")
    wait_for(
        lambda: cluster.api.get("Pod", ns, "polite") is None, timeout=10, message="polite pod gone"
    )
    polite_took = time.monotonic() - start
    wait_for(
        lambda: cluster.api.get("Pod", ns, "stubborn") is None,
        timeout=20,
        message="stubborn pod gone",
    )
    stubborn_took = time.monotonic() - start
    assert polite_took < 3, "a process that exits on SIGTERM must not wait out the grace period"
    assert 2.8 <= stubborn_took < 12, stubborn_took
    assert "got SIGTERM" in cluster.pod_log(ns, "stubborn", "web")
    for pid in pids.values():
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )


def test_two_pods_on_port_8000_behind_a_service(cluster: LocalCluster, ns: str) -> None:
    c = standin(
        env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
    )
    cluster.api.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "pair", "namespace": ns},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "pair"}},
                "template": {
                    "metadata": {"labels": {"app": "pair"}},
                    "spec": {"terminationGracePeriodSeconds": 5, "containers": [c]},
                },
            },
        }
    )
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "pair", "namespace": ns},
            "spec": {
                "selector": {"app": "pair"},
                "ports": [{"name": "http", "port": 8080, "targetPort": 8000}],
            },
        }
    )
    wait_for(
        lambda: (
            (cluster.api.get("Deployment", ns, "pair").get("status") or {}).get("availableReplicas")
            == 2
        ),
        timeout=40,
        message="both replicas available",
    )
    pods = cluster.api.list("Pod", ns, "app=pair")
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2
    for ip in ips:
        assert http(f"http://{ip}:8000/whoami").json()["pod_ip"] == ip
    # the EndpointSlice controller may trail the Deployment's status by a resync
    wait_for(
        lambda: (
            {
                a
                for e in cluster.api.list("EndpointSlice", ns, "kubernetes.io/service-name=pair")
                for e2 in (e.get("endpoints") or [])
                if (e2.get("conditions") or {}).get("ready")
                for a in e2["addresses"]
            }
            == ips
        ),
        message="both pods behind the Service",
    )
    url = cluster.service_url(ns, "pair", 8080)
    seen: set[str] = set()
    # round-robin over ready endpoints: both pods answer within a few requests once the forwarder sees both
    wait_for(
        lambda: (
            seen.update(http(url + "/whoami").json()["pod_ip"] for _ in range(4)) or seen == ips
        ),
        timeout=15,
        message=f"both pods answer through the Service (seen {seen})",
    )
    assert seen == ips
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "pair-direct", "namespace": ns},
            "spec": {"clusterIP": "None", "selector": {"app": "pair"}, "ports": [{"port": 8000}]},
        }
    )
    wait_for(
        lambda: (
            len(
                cluster.api.list("EndpointSlice", ns, "kubernetes.io/service-name=pair-direct")[
                    0
                ].get("endpoints")
                or []
            )
            == 2
        ),
        message="the headless Service's endpoints",
    )
    # from inside a pod, by the Service's DNS names; the headless one's name gives the pods' IPs
    probe = (
        "import urllib.request, json, socket, sys\n"
        "for host in sys.argv[1:]:\n"
        "    print(host, json.load(urllib.request.urlopen(f'http://{host}:8080/whoami', timeout=5))['pod_ip'])\n"
        "print('direct', ','.join(sorted({a[4][0] for a in socket.getaddrinfo('pair-direct', 8000,"
        " type=socket.SOCK_STREAM)})))\n"
    )
    names = ["pair", f"pair.{ns}", f"pair.{ns}.svc", f"pair.{ns}.svc.cluster.local"]
    cluster.api.apply(
        pod(
            "client",
            ns,
            [{"name": "c", "image": "example.com/python:1", "args": ["-c", probe, *names]}],
            restartPolicy="Never",
        )
    )
    done = wait_pod(
        cluster, ns, "client", lambda p: p["status"].get("phase") in ("Succeeded", "Failed")
    )
    log = cluster.pod_log(ns, "client", "c")
    assert done["status"]["phase"] == "Succeeded", log
    answered = dict(line.split() for line in log.strip().splitlines())
    assert set(answered.pop("direct").split(",")) == ips
    assert set(answered) == set(names) and set(answered.values()) <= ips


def test_an_unmapped_image_fails_with_a_clear_reason(cluster: LocalCluster, ns: str) -> None:
    cluster.api.apply(pod("nope", ns, [{"name": "x", "image": "quay.io/nobody/nothing:1"}]))
    p = wait_pod(
        cluster,
        ns,
        "nope",
        lambda p: (
            container_status(p, "x")["state"].get("waiting", {}).get("reason") == "ErrImagePull"
        ),
        message="ErrImagePull",
    )
    status = container_status(p, "x")
    assert "quay.io/nobody/nothing:1" in status["state"]["waiting"]["message"]
    assert "image table" in status["state"]["waiting"]["message"]
    assert cluster.pod(ns, "nope")["status"]["phase"] == "Pending"


def test_in_cluster_config_works_from_a_pod(cluster: LocalCluster, ns: str) -> None:
    rbac = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "reader", "namespace": ns},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader", "namespace": ns},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    ]
    for obj in rbac:
        cluster.api.apply(obj)
    cluster.api.apply(
        pod(
            "kubectl",
            ns,
            [
                {
                    "name": "k",
                    "image": "example.com/kubectl:1",
                    "args": ["get", "pods", "-o", "name"],
                }
            ],
            serviceAccountName="reader",
            restartPolicy="Never",
        )
    )
    cluster.api.apply(
        pod(
            "forbidden",
            ns,
            [{"name": "k", "image": "example.com/kubectl:1", "args": ["get", "secrets"]}],
            serviceAccountName="reader",
            restartPolicy="Never",
        )
    )
    for name, phase in (("kubectl", "Succeeded"), ("forbidden", "Failed")):
        wait_for(
            lambda: cluster.pod(ns, name)["status"].get("phase") in ("Succeeded", "Failed"),
            message=f"{name} finished",
        )
        assert cluster.pod(ns, name)["status"]["phase"] == phase, cluster.pod_log(ns, name, "k")
    assert "pod/kubectl" in cluster.pod_log(ns, "kubectl", "k")
    assert 'cannot list resource "secrets"' in cluster.pod_log(ns, "forbidden", "k")
    assert f"system:serviceaccount:{ns}:reader" in cluster.pod_log(ns, "forbidden", "k")


def test_a_killed_process_is_restarted(cluster: LocalCluster, ns: str) -> None:
    cluster.api.apply(pod("victim", ns, [standin()]))
    running(cluster, "victim", ns)
    pid = cluster.processes(ns, "victim")["web"]
    os.kill(pid, signal.SIGKILL)
    p = wait_pod(
        cluster,
        ns,
        "victim",
        lambda p: (
            container_status(p, "web")["restartCount"] == 1 and condition(p, "Ready") == "True"
        ),
        message="victim restarted",
    )
    last = container_status(p, "web")["lastState"]["terminated"]
    assert last["exitCode"] == 137 and last["signal"] == signal.SIGKILL
    assert cluster.processes(ns, "victim")["web"] != pid


def test_init_containers_run_in_order_and_policies_end_pods(cluster: LocalCluster, ns: str) -> None:
    def step(n: int) -> dict:
        return {
            "name": f"init{n}",
            "image": "example.com/python:1",
            "volumeMounts": [{"name": "w", "mountPath": "/w"}],
            "args": ["-c", f"open('/w/order', 'a').write('{n}')"],
        }

    main = {
        "name": "main",
        "image": "example.com/python:1",
        "volumeMounts": [{"name": "w", "mountPath": "/w"}],
        "args": ["-c", "import sys; print(open('/w/order').read()); sys.exit(0)"],
    }
    cluster.api.apply(
        pod(
            "inits",
            ns,
            [main],
            initContainers=[step(1), step(2)],
            restartPolicy="Never",
            volumes=[{"name": "w", "emptyDir": {}}],
        )
    )
    failing = {
        "name": "main",
        "image": "example.com/python:1",
        "args": ["-c", "raise SystemExit(7)"],
    }
    cluster.api.apply(pod("fails", ns, [failing], restartPolicy="Never"))
    for name, phase in (("inits", "Succeeded"), ("fails", "Failed")):
        wait_for(
            lambda: cluster.pod(ns, name)["status"].get("phase") == phase, message=f"{name} {phase}"
        )
    p = cluster.pod(ns, "inits")
    assert cluster.pod_log(ns, "inits", "main").strip() == "12"
    assert condition(p, "Initialized") == "True"
    assert all(
        s["state"]["terminated"]["exitCode"] == 0 for s in p["status"]["initContainerStatuses"]
    )
    assert (
        container_status(cluster.pod(ns, "fails"), "main")["state"]["terminated"]["exitCode"] == 7
    )


def test_kubectl_works_against_the_cluster(cluster: LocalCluster) -> None:
    out = cluster.kubectl("get", "nodes", "-o", "jsonpath={.items[0].status.allocatable}").stdout
    allocatable = json.loads(out)
    assert allocatable["nvidia.com/gpu"] == "4" and allocatable["cpu"] == "16"
    with pytest.raises(subprocess.CalledProcessError):
        cluster.kubectl("get", "nosuchkind")


def test_a_claim_is_provisioned_and_shared_by_pods(cluster: LocalCluster, ns: str) -> None:
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data", "namespace": ns},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    mount = [{"name": "d", "mountPath": "/data"}]
    volumes = [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
    cluster.api.apply(
        pod(
            "writer",
            ns,
            [
                {
                    "name": "w",
                    "image": "example.com/python:1",
                    "volumeMounts": mount,
                    "args": ["-c", "open('/data/note', 'w').write('kept')"],
                }
            ],
            restartPolicy="Never",
            volumes=volumes,
        )
    )
    wait_pod(
        cluster,
        ns,
        "writer",
        lambda p: p["status"].get("phase") == "Succeeded",
        timeout=60,
        message="writer done (its claim bound first)",
    )
    cluster.api.apply(
        pod(
            "reader",
            ns,
            [
                {
                    "name": "r",
                    "image": "example.com/python:1",
                    "volumeMounts": mount,
                    "args": ["-c", "print(open('/data/note').read())"],
                }
            ],
            restartPolicy="Never",
            volumes=volumes,
        )
    )
    wait_pod(
        cluster,
        ns,
        "reader",
        lambda p: p["status"].get("phase") == "Succeeded",
        message="reader done",
    )
    assert cluster.pod_log(ns, "reader", "r").strip() == "kept"
    assert cluster.api.get("PersistentVolumeClaim", ns, "data")["status"]["phase"] == "Bound"


def test_deleting_a_namespace_stops_its_pods(cluster: LocalCluster) -> None:
    ns = namespace(cluster, "doomed")
    cluster.api.apply(pod("web", ns, [standin()]))
    running(cluster, "web", ns)
    pid = cluster.processes(ns, "web")["web"]
    cluster.api.delete("Namespace", None, ns)
    wait_for(
        lambda: cluster.api.get("Namespace", None, ns) is None,
        timeout=60,
        message="the namespace gone",
    )
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_gpu_requests_schedule_within_the_node_count(cluster: LocalCluster, ns: str) -> None:
    def gpu_pod(name: str, gpus: int) -> dict:
        c = {
            "name": "g",
            "image": "example.com/python:1",
            "args": ["-c", "import time; time.sleep(300)"],
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        }
        return pod(name, ns, [c], terminationGracePeriodSeconds=0)

    cluster.api.apply(gpu_pod("gpu-fits", 4))
    cluster.api.apply(gpu_pod("gpu-too-many", 5))
    wait_pod(
        cluster,
        ns,
        "gpu-fits",
        lambda p: p["status"].get("phase") == "Running",
        message="the 4-GPU pod runs",
    )
    p = wait_pod(
        cluster,
        ns,
        "gpu-too-many",
        lambda p: condition(p, "PodScheduled") == "False",
        message="the 5-GPU pod unschedulable",
    )
    message = next(c["message"] for c in p["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in message
    for name in ("gpu-fits", "gpu-too-many"):
        cluster.api.delete("Pod", ns, name)


def test_exec_probe_and_pre_stop_hook_run_inside_the_container(
    cluster: LocalCluster, ns: str, tmp_path
) -> None:
    out = tmp_path / "hook"
    out.mkdir()
    c = standin(
        readinessProbe={
            "exec": {"command": ["sh", "-c", 'test "$(hostname)" = hooked']},
            "periodSeconds": 1,
        },
        lifecycle={
            "preStop": {
                "exec": {"command": ["sh", "-c", 'echo "bye from $(hostname)" > /out/said']}
            }
        },
        volumeMounts=[{"name": "out", "mountPath": "/out"}],
    )
    cluster.api.apply(
        pod("hooked", ns, [c], volumes=[{"name": "out", "hostPath": {"path": str(out)}}])
    )
    running(cluster, "hooked", ns)  # the exec readiness probe saw the pod's hostname
    cluster.api.delete("Pod", ns, "hooked")
    wait_for(lambda: cluster.api.get("Pod", ns, "hooked") is None, message="hooked pod gone")
    assert (out / "said").read_text().strip() == "bye from hooked"
    log = cluster.pod_log(ns, "hooked", "web")
    assert "got SIGTERM" in log


def test_configmap_volume_follows_updates_but_subpath_files_do_not(
    cluster: LocalCluster, ns: str
) -> None:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "live-cfg", "namespace": ns},
        "data": {"greeting": "hello", "old": "x"},
    }
    cluster.api.apply(cm)
    c = standin(
        volumeMounts=[
            {"name": "cfg", "mountPath": "/cfg"},
            {"name": "cfg", "mountPath": "/pinned/greeting", "subPath": "greeting"},
        ]
    )
    cluster.api.apply(
        pod("cfgwatch", ns, [c], volumes=[{"name": "cfg", "configMap": {"name": "live-cfg"}}])
    )
    ip = running(cluster, "cfgwatch", ns)["status"]["podIP"]

    def read(path: str) -> httpx.Response:
        return http(f"http://{ip}:8000/file?path={path}")

    assert read("/cfg/greeting").text == "hello" and read("/cfg/old").status_code == 200
    cluster.api.apply({**cm, "data": {"greeting": "bonjour"}})
    wait_for(
        lambda: read("/cfg/greeting").text == "bonjour",
        timeout=30,
        message="the volume follows the ConfigMap",
    )
    wait_for(lambda: read("/cfg/old").status_code == 404, message="a removed key's file goes")
    assert read("/pinned/greeting").text == "hello"


def test_kubectl_logs_reads_the_containers_log(cluster: LocalCluster, ns: str) -> None:
    c = {
        "name": "talk",
        "image": "example.com/python:1",
        "args": [
            "-c",
            "import time\nfor i in range(3): print('line', i, flush=True)\ntime.sleep(300)",
        ],
    }
    cluster.api.apply(pod("talker", ns, [c], terminationGracePeriodSeconds=0))
    wait_for(lambda: "line 2" in cluster.pod_log(ns, "talker", "talk"), message="the pod printed")
    out = cluster.kubectl("logs", "-n", ns, "talker", "-c", "talk").stdout
    assert out.splitlines() == ["line 0", "line 1", "line 2"]
    assert cluster.kubectl("logs", "-n", ns, "talker", "--tail=1").stdout.strip() == "line 2"
    missing = cluster.kubectl("logs", "-n", ns, "talker", "--previous", check=False)
    assert missing.returncode != 0
    cluster.api.delete("Pod", ns, "talker")


def test_the_operators_redis_pod_runs_unmodified(cluster: LocalCluster, ns: str) -> None:
    """The managed Redis as operator/render.py renders it (restricted securityContext, the
    password from a Secret expanded into args as $(REDIS_PASSWORD), tcpSocket probes), reached
    through its Service by the address the operator hands the pods."""
    import redis

    from kvmesh.operator import render
    from kvmesh.operator import spec as specs

    spec = specs.apply_defaults(
        {"model": {"builtin": "smollm2-135m-instruct"}, "redis": {"mode": "managed"}}
    )
    md = {"metadata": {"name": "cache", "namespace": ns, "uid": "not-a-real-owner"}}
    password = "pw-" + base64.b32encode(os.urandom(10)).decode().lower()
    cluster.api.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": render.names("cache")["redis-auth"], "namespace": ns},
            "stringData": {"password": password},
        }
    )
    for obj in render.render_redis(md, spec, render.Images()):
        if obj["kind"] in ("Deployment", "Service"):
            obj["metadata"].pop(
                "ownerReferences"
            )  # no ModelDeployment owns them here (the garbage collector would)
            cluster.api.apply(obj)
    name = render.names("cache")[render.REDIS]
    wait_for(
        lambda: (
            (cluster.api.get("Deployment", ns, name).get("status") or {}).get("availableReplicas")
            == 1
        ),
        timeout=60,
        message="the Redis Deployment available",
    )
    host = cluster.service_url(ns, name, 6379).split("//")[1].split(":")[0]
    assert redis.Redis(host=host, port=6379, password=password, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=host, port=6379, socket_timeout=5).get("x")
    url = render.managed_redis_url(
        "cache", ns
    )  # redis://cache-redis.<ns>.svc:6379/0, as the pods get it
    probe = f"import redis; print(redis.Redis.from_url({url!r}, password={password!r}, socket_timeout=5).ping())"
    cluster.api.apply(
        pod(
            "redis-client",
            ns,
            [{"name": "c", "image": "example.com/python:1", "args": ["-c", probe]}],
            restartPolicy="Never",
        )
    )
    wait_pod(
        cluster, ns, "redis-client", lambda p: p["status"].get("phase") in ("Succeeded", "Failed")
    )
    assert cluster.pod_log(ns, "redis-client", "c").strip() == "True"


def test_a_volume_over_the_checkout_does_not_hide_the_programs(cluster: LocalCluster) -> None:
    # A checkout under /tmp, where the engine pods mount an emptyDir: the volume must not hide
    # the venv and the checkout the container's programs run from (they are bound back), and it
    # still hides everything else that was there.
    import kvmesh

    target = Path(kvmesh.__file__).resolve().parents[2]  # the checkout's parent
    if target == Path("/"):
        pytest.skip("the checkout sits at the root of the file system")
    kept = {
        Path(p).relative_to(target).parts[0] for p in HOST_PATHS if Path(p).is_relative_to(target)
    }
    ns = namespace(cluster, "covered")
    script = "import os, kvmesh.router; print(sorted(os.listdir(os.environ['TARGET'])))"
    main = {
        "name": "main",
        "image": "example.com/python:1",
        "args": ["-c", script],
        "env": [{"name": "TARGET", "value": str(target)}],
        "volumeMounts": [{"name": "scratch", "mountPath": str(target)}],
    }
    cluster.api.apply(
        pod(
            "covered",
            ns,
            [main],
            restartPolicy="Never",
            volumes=[{"name": "scratch", "emptyDir": {}}],
        )
    )
    wait_pod(
        cluster,
        ns,
        "covered",
        lambda p: p["status"].get("phase") in ("Succeeded", "Failed"),
        message="the covered pod ended",
    )
    log = cluster.pod_log(ns, "covered", "main")
    assert cluster.pod(ns, "covered")["status"]["phase"] == "Succeeded", log
    assert log.strip().splitlines()[-1] == str(sorted(kept))
