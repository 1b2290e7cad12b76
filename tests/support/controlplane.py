"""A real Kubernetes control plane on loopback, as controller-runtime's envtest runs one:
etcd and kube-apiserver (plus kube-controller-manager and kube-scheduler when asked),
found in ``$KUBEBUILDER_ASSETS`` or setup-envtest's default directory
``~/.local/share/kubebuilder-envtest/k8s/<version>-<os>-<arch>/``.

The API server runs with RBAC authorization, a service-account signing key (so the
TokenRequest API issues real ServiceAccount tokens), a static admin token (group
``system:masters``) and certificates from a throwaway CA made with the ``openssl`` CLI.
The operator's real-API-server suite and the local cluster (kvmesh_testing.cluster) use it;
docs/operator.md, "Testing against a real API server", says how to get the binaries.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvmesh.common.ports import free_port

ASSETS_ENV = "KUBEBUILDER_ASSETS"
DEFAULT_ASSETS_ROOT = Path.home() / ".local/share/kubebuilder-envtest/k8s"
ADMIN_USER = "kvmesh-test-admin"


@dataclass
class Assets:
    directory: Path
    etcd: Path
    apiserver: Path
    controller_manager: Path | None
    scheduler: Path | None = None


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", path.name.split("-")[0]))


def _assets_in(directory: Path) -> tuple[Assets | None, str]:
    etcd, apiserver, kcm, sched = (
        directory / n
        for n in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
    )
    missing = [p.name for p in (etcd, apiserver) if not os.access(p, os.X_OK)]
    if missing:
        return None, (
            f"{directory} has no executable {' or '.join(missing)} (docs/operator.md, "
            f"'Testing against a real API server')"
        )
    return Assets(
        directory,
        etcd,
        apiserver,
        kcm if os.access(kcm, os.X_OK) else None,
        sched if os.access(sched, os.X_OK) else None,
    ), ""


def find_assets() -> tuple[Assets | None, str]:
    """The control-plane binaries, or None and why not (the skip reason)."""
    if os.environ.get(ASSETS_ENV):
        return _assets_in(Path(os.environ[ASSETS_ENV]))
    if not DEFAULT_ASSETS_ROOT.is_dir():
        return None, (
            f"no kube-apiserver/etcd: set {ASSETS_ENV} or put them in {DEFAULT_ASSETS_ROOT}/<version>/ "
            f"(docs/operator.md, 'Testing against a real API server')"
        )
    reasons = []
    for directory in sorted(
        (p for p in DEFAULT_ASSETS_ROOT.iterdir() if p.is_dir()), key=_version_key, reverse=True
    ):
        assets, why = _assets_in(directory)
        if assets is not None:
            return assets, ""
        reasons.append(why)
    return None, "; ".join(reasons) or f"{DEFAULT_ASSETS_ROOT} is empty (set {ASSETS_ENV})"


def find_environment() -> tuple[Assets | None, str]:
    assets, why = find_assets()
    if assets is not None and shutil.which("openssl") is None:
        return None, "the openssl CLI is needed to make the test certificates"
    return assets, why


def wait_for(
    check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.1, message: str = ""
) -> Any:
    """Poll ``check()`` until it returns a truthy value; re-raise its last AssertionError
    (or fail naming ``message``) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            error: Exception = AssertionError(
                f"{message or 'condition'} still false after {timeout}s: {result!r}"
            )
        except (AssertionError, KeyError, TypeError, IndexError, httpx.TransportError) as exc:
            error = exc
        if time.monotonic() > deadline:
            raise error
        time.sleep(interval)


# --- API paths --------------------------------------------------------------------------------

# kind -> (apiVersion, plural, namespaced): what the tests and the manifests use.
KINDS: dict[str, tuple[str, str, bool]] = {
    "Namespace": ("v1", "namespaces", False),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "Secret": ("v1", "secrets", True),
    "Service": ("v1", "services", True),
    "Pod": ("v1", "pods", True),
    "Event": ("v1", "events", True),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims", True),
    "Deployment": ("apps/v1", "deployments", True),
    "ReplicaSet": ("apps/v1", "replicasets", True),
    "Job": ("batch/v1", "jobs", True),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies", True),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings", True),
    "EndpointSlice": ("discovery.k8s.io/v1", "endpointslices", True),
    "CustomResourceDefinition": ("apiextensions.k8s.io/v1", "customresourcedefinitions", False),
}


def register_kind(kind: str, api_version: str, plural: str, namespaced: bool = True) -> None:
    KINDS[kind] = (api_version, plural, namespaced)


def path(
    kind: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None
) -> str:
    api_version, plural, namespaced = KINDS[kind]
    p = ("/api/" if "/" not in api_version else "/apis/") + api_version
    if namespaced and namespace:
        p += f"/namespaces/{namespace}"
    p += f"/{plural}"
    if name:
        p += f"/{name}"
    if subresource:
        p += f"/{subresource}"
    return p


# --- certificates -----------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path, extra_sans: tuple[str, ...] = ()) -> None:
    """ca.crt/ca.key, a serving certificate for 127.0.0.1/localhost (and ``extra_sans``,
    e.g. ``IP:10.96.0.1``, ``DNS:kubernetes.default.svc``), and the service-account signing
    key pair (EC P-256: fast to make)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=kvmesh-test-ca",
        cwd=d,
    )
    _openssl(
        "req",
        "-x509",
        *ec,
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-keyout",
        "serving.key",
        "-out",
        "serving.crt",
        "-days",
        "2",
        "-subj",
        "/CN=kube-apiserver",
        "-addext",
        "subjectAltName=" + ",".join(("IP:127.0.0.1", "DNS:localhost", *extra_sans)),
        "-addext",
        "extendedKeyUsage=serverAuth",
        cwd=d,
    )
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
        cwd=d,
    )
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


# --- processes --------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager, kube-scheduler) in ``workdir``;
    ``client`` is an httpx client authenticated as a cluster admin.

    The defaults suit a cluster without nodes (the operator's suite). A cluster with a node
    agent sets ``service_cidr``, the ``extra_sans`` pods reach the API server by, and
    ``service_account_admission`` (pods then get their ServiceAccount token volume)."""

    assets: Assets
    workdir: Path
    service_cidr: str = "10.0.0.0/24"
    extra_sans: tuple[str, ...] = ()
    service_account_admission: bool = False
    procs: list[Proc] = field(default_factory=list)
    # called with every process so far after each start (a crash mid-start leaves none unrecorded)
    on_spawn: Callable[[list[Proc]], None] | None = None
    port: int = 0
    admin_token: str = ""
    client: httpx.Client | None = None
    controller_manager: Proc | None = None
    scheduler: Proc | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_path(self) -> str:
        return str(self.workdir / "ca.crt")

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_path)

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        popen = subprocess.Popen(
            argv,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        if self.on_spawn is not None:
            self.on_spawn(self.procs)
        return proc

    def _wait_healthy(self, proc: Proc, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}"
                )
            try:
                if check():
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} not healthy after {timeout}s:\n{proc.tail()}")

    def start(self, timeout: float = 90.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_pki(self.workdir, self.extra_sans)
        self.admin_token = secrets.token_hex(16)
        (self.workdir / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        )

        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.assets.etcd),
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        self._wait_healthy(
            etcd,
            lambda: httpx.get(f"{etcd_url}/health", timeout=1).json().get("health") == "true",
            timeout,
        )

        self.port = free_port()
        w = self.workdir
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.assets.apiserver),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={w / 'serving.crt'}",
                f"--tls-private-key-file={w / 'serving.key'}",
                f"--client-ca-file={w / 'ca.crt'}",
                f"--token-auth-file={w / 'tokens.csv'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={w / 'sa.pub'}",
                f"--service-account-signing-key-file={w / 'sa.key'}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--authorization-mode=RBAC",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                f"--cert-dir={w / 'apiserver-certs'}",
            ]
            + (
                []
                if self.service_account_admission
                else [
                    # No ServiceAccount controller runs, so there is no "default" ServiceAccount to
                    # admit pods against (envtest disables the plugin for the same reason).
                    "--disable-admission-plugins=ServiceAccount"
                ]
            ),
        )
        self.client = httpx.Client(
            base_url=self.server,
            verify=self.ssl_context(),
            timeout=30.0,
            headers={"Authorization": f"Bearer {self.admin_token}", "Accept": "application/json"},
        )
        self._wait_healthy(
            apiserver, lambda: self.client.get("/readyz").status_code == 200, timeout
        )

    def kubeconfig(self, name: str, token: str) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "test",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {"server": self.server, "certificate-authority": self.ca_path},
                }
            ],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
        }
        p = self.workdir / f"{name}.kubeconfig"
        p.write_text(json.dumps(cfg))
        return p

    NODELESS_CONTROLLERS = (
        "deployment-controller",
        "replicaset-controller",
        "garbage-collector-controller",
    )

    def start_controller_manager(
        self, controllers: tuple[str, ...] = NODELESS_CONTROLLERS, extra_args: tuple[str, ...] = ()
    ) -> Proc | None:
        """kube-controller-manager with ``controllers``; by default those a cluster without
        nodes can use: Deployments -> ReplicaSets -> Pods, and owner-reference garbage
        collection. Start it after the CRDs are installed: its garbage collector then knows
        their kinds without waiting for its next discovery resync."""
        if self.assets.controller_manager is None:
            return None
        kubeconfig = self.kubeconfig("controller-manager", self.admin_token)
        self.controller_manager = self._spawn(
            "kube-controller-manager",
            [
                str(self.assets.controller_manager),
                f"--kubeconfig={kubeconfig}",
                f"--controllers={','.join(controllers)}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--secure-port=0",
                "--concurrent-gc-syncs=5",
                *extra_args,
            ],
        )
        return self.controller_manager

    def start_scheduler(self) -> Proc | None:
        """kube-scheduler (binds pods to the nodes that agents register)."""
        if self.assets.scheduler is None:
            return None
        kubeconfig = self.kubeconfig("scheduler", self.admin_token)
        self.scheduler = self._spawn(
            "kube-scheduler",
            [
                str(self.assets.scheduler),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )
        return self.scheduler

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    # --- API helpers (admin) ------------------------------------------------------------------

    def apply(
        self, obj: dict[str, Any], manager: str = "kvmesh-test", force: bool = True
    ) -> httpx.Response:
        """Server-side apply of one object (as `kubectl apply --server-side` does)."""
        assert self.client is not None
        meta = obj["metadata"]
        return self.client.patch(
            path(obj["kind"], meta.get("namespace"), meta["name"]),
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
            params={"fieldManager": manager, "force": str(force).lower()},
        )

    def apply_file(self, file: Path) -> list[dict[str, Any]]:
        """Apply every document of a manifest file; raise on the first the server rejects."""
        applied = []
        for doc in yaml.safe_load_all(file.read_text()):
            if not doc:
                continue
            resp = self.apply(doc)
            if resp.status_code >= 400:
                raise AssertionError(
                    f"{file.name}: {doc['kind']}/{doc['metadata']['name']} rejected: "
                    f"{resp.status_code} {resp.text}"
                )
            applied.append(resp.json())
        return applied

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert self.client is not None
        resp = self.client.get(path(kind, namespace, name))
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        assert self.client is not None
        resp = self.client.get(
            path(kind, namespace), params={"labelSelector": selector} if selector else None
        )
        resp.raise_for_status()
        return resp.json()["items"]

    def request_token(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A ServiceAccount token from the TokenRequest API (what the kubelet mounts in a pod)."""
        assert self.client is not None
        resp = self.client.post(
            path("ServiceAccount", namespace, service_account, "token"),
            json={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds},
            },
        )
        resp.raise_for_status()
        return resp.json()["status"]["token"]
