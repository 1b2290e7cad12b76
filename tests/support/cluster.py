"""A local Kubernetes cluster for tests (docs/local-cluster.md): the real control plane
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler; kvmesh_testing.controlplane),
one node agent that runs pods as local processes in network namespaces of their own
(kvmesh_testing.node), and a Service forwarder (kvmesh_testing.node.services).

    with LocalCluster(tmp_path) as cluster:
        cluster.kubectl("apply", "-f", "manifests/")
        url = cluster.service_url("ns", "svc", 8000)

``python -m kvmesh_testing.cluster up --workdir DIR`` runs one by hand until Ctrl-C.

Needs root (network namespaces, a bridge, bind mounts), the ``ip``, ``nsenter`` and
``openssl`` commands, and the control-plane binaries (``make setup`` installs them). ``unavailable()`` says why a cluster cannot run here (tests skip on it).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from kvmesh_testing import controlplane
from kvmesh_testing.controlplane import ControlPlane, find_environment, wait_for
from kvmesh_testing.node import hostpaths, lifeline, network
from kvmesh_testing.node.pods import pod_dir

LOCK_DIR = hostpaths.STATE_DIR
SLOTS = range(0, 64)
NODE_NAME = "kvmesh-node"

# The controllers a cluster with nodes needs: workloads, Services' EndpointSlices, garbage
# collection, ServiceAccounts and the kube-root-ca.crt ConfigMap, namespaces, Jobs, volumes, PDBs.
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "endpointslice-controller",
    "endpoints-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "service-ca-certificate-publisher-controller",
    "namespace-controller",
    "job-controller",
    "persistentvolume-binder-controller",
    "disruption-controller",
    "pod-garbage-collector-controller",
    "statefulset-controller",
    "ttl-after-finished-controller",
    "node-lifecycle-controller",
)


def unavailable() -> str | None:
    """Why a local cluster cannot run on this machine (None: it can)."""
    assets, why = find_environment()
    if assets is None:
        return why
    if assets.controller_manager is None or assets.scheduler is None:
        return f"{assets.directory} lacks kube-controller-manager or kube-scheduler (`make setup` installs them)"
    if os.geteuid() != 0:
        return "the local cluster needs root (network namespaces, a bridge, bind mounts)"
    for tool in ("ip", "nsenter", "kubectl"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not available: {probe.stderr.strip()}"
    return None


class _Slot:
    """A cluster-wide exclusive number for this cluster's network names and ranges: a lock
    file held while the cluster runs (released by the kernel if the process dies)."""

    def __init__(self, only: int | None = None) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for n in SLOTS if only is None else [only]:
            clash = network.conflicts(network.NetworkConfig(n))
            if clash:
                if only is not None:
                    raise RuntimeError(
                        f"local-cluster slot {n}'s ranges overlap the host's routes {clash}"
                    )
                continue
            f = open(LOCK_DIR / f"slot-{n}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.number, self.file = n, f
            self.pids_file = LOCK_DIR / f"slot-{n}.pids"
            self._kill_leftovers()
            return
        raise RuntimeError(
            f"local-cluster slot {only} is in use"
            if only is not None
            else f"all {len(SLOTS)} local-cluster slots are in use"
        )

    def _kill_leftovers(self) -> None:
        """The processes a crashed earlier cluster in this slot left running (the pids it
        recorded, where the command line still matches)."""
        lifeline.stop_recorded(self.pids_file, grace=0)
        self.pids_file.unlink(missing_ok=True)

    def watchdog(self) -> subprocess.Popen:
        """A process that holds this slot's lock too and cleans the slot up if this process
        dies without stopping the cluster (kvmesh_testing.node.lifeline)."""
        return subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "kvmesh_testing.node.lifeline",
                "--slot",
                str(self.number),
                "--pids-file",
                str(self.pids_file),
            ],
            pass_fds=(self.file.fileno(),),
            stdin=subprocess.DEVNULL,
        )

    def record(self, pids: list[int]) -> None:
        entries = []
        for pid in pids:
            try:
                entries.append(
                    [pid, Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
                )
            except OSError:
                pass
        self.pids_file.write_text(json.dumps(entries))

    def release(self) -> None:
        self.pids_file.unlink(missing_ok=True)
        self.file.close()


class LocalCluster:
    def __init__(
        self,
        workdir: Path,
        *,
        node_cpu: str = "16",
        node_memory: str = "64Gi",
        gpus: int = 4,
        images: dict[str, Any] | None = None,
        backoff_initial: float = 10.0,
        backoff_cap: float = 300.0,
        log_level: str = "INFO",
        slot: int | None = None,
    ) -> None:
        """``slot``: this network slot or none (tests of the cleanup); by default the first free one."""
        self.workdir = Path(workdir).resolve()
        self.node_cpu, self.node_memory, self.gpus = node_cpu, node_memory, gpus
        self.images = images or {}
        self.backoff_initial, self.backoff_cap = backoff_initial, backoff_cap
        self.log_level = log_level
        self.slot = slot
        self.control_plane: ControlPlane | None = None
        self.net: network.NetworkConfig | None = None
        self.procs: list[controlplane.Proc] = []
        self._slot: _Slot | None = None
        self.api: Any = None
        self._kubeconfig: Path | None = None
        self._watchdog: subprocess.Popen | None = None

    # --- start / stop --------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        """Start every part; on failure, stop what started and raise."""
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot start a local cluster: {why}")
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        assets, _ = find_environment()
        assert assets is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in (
            self.workdir / "control-plane",
            self.node_dir,
        ):  # every start is a fresh cluster
            shutil.rmtree(stale, ignore_errors=True)
        self._slot = _Slot(self.slot)
        self._watchdog = self._slot.watchdog()
        self.net = net = network.NetworkConfig(self._slot.number)
        network.create_bridge(net)
        sans = (
            f"IP:{net.apiserver_service_ip}",
            f"IP:{net.gateway}",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        )
        cp = self.control_plane = ControlPlane(
            assets,
            self.workdir / "control-plane",
            service_cidr=net.service_cidr,
            extra_sans=sans,
            service_account_admission=True,
        )
        # the watchdog stops what is recorded: each process as it starts, not all at the end
        cp.on_spawn = lambda procs: self._slot.record([p.popen.pid for p in procs])
        cp.start()
        self.api = _AdminApi(cp)
        cp.start_controller_manager(
            CONTROLLERS,
            extra_args=(
                f"--root-ca-file={cp.ca_path}",
                f"--service-account-private-key-file={cp.workdir / 'sa.key'}",
            ),
        )
        cp.start_scheduler()
        kubeconfig = self.kubeconfig
        images_file = self.workdir / "images.json"
        images_file.write_text(json.dumps(self.images))
        python = [sys.executable, "-P", "-m"]
        self.procs.append(
            cp._spawn(
                "service-forwarder",
                [
                    *python,
                    "kvmesh_testing.node.services",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--slot",
                    str(net.slot),
                    "--apiserver-port",
                    str(cp.port),
                    "--log-level",
                    self.log_level,
                ],
            )
        )
        self.procs.append(
            cp._spawn(
                "node-agent",
                [
                    *python,
                    "kvmesh_testing.node",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--state-dir",
                    str(self.node_dir),
                    "--slot",
                    str(net.slot),
                    "--node-name",
                    NODE_NAME,
                    "--cpu",
                    self.node_cpu,
                    "--memory",
                    self.node_memory,
                    "--gpus",
                    str(self.gpus),
                    "--images",
                    str(images_file),
                    "--backoff-initial",
                    str(self.backoff_initial),
                    "--backoff-cap",
                    str(self.backoff_cap),
                    "--log-level",
                    self.log_level,
                ],
            )
        )
        self._slot.record([p.popen.pid for p in cp.procs])
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            for proc in self.procs + (self.control_plane.procs if self.control_plane else []):
                if not proc.alive():
                    raise RuntimeError(
                        f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}"
                    )
            node = self.api.get("Node", None, NODE_NAME)
            conds = {
                c["type"]: c["status"]
                for c in ((node or {}).get("status") or {}).get("conditions") or []
            }
            schedulable = not ((node or {}).get("spec") or {}).get(
                "taints"
            )  # the not-ready taint is gone
            return (
                conds.get("Ready") == "True"
                and schedulable
                and self.api.get("ServiceAccount", "default", "default") is not None
                and self.api.get("ConfigMap", "default", "kube-root-ca.crt") is not None
            )

        wait_for(
            ready,
            timeout=timeout,
            interval=0.2,
            message="the local cluster's node, ServiceAccount and CA",
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the agent first: it stops every pod
            proc.stop(timeout=30)
        self.procs.clear()
        if self.control_plane is not None:
            self.control_plane.stop()
        if self._slot is not None:  # only while the slot is ours: another cluster may take it next
            hostpaths.remove_created_mount_points(self._slot.number)
            if self.net is not None:
                network.delete_bridge(self.net)
            if self._watchdog is not None:
                self._watchdog.terminate()
                self._watchdog.wait(timeout=10)
                self._watchdog = None
            self._slot.release()
            self._slot = None

    # --- the interface tests use ---------------------------------------------------------------

    @property
    def node_dir(self) -> Path:
        return self.workdir / "node"

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane is not None
        if self._kubeconfig is None:
            self._kubeconfig = self.control_plane.kubeconfig(
                "admin", self.control_plane.admin_token
            )
        return self._kubeconfig

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        """kubectl with the admin kubeconfig; raises CalledProcessError (with its output) on failure.

        apply/create/replace get ``--validate=false`` unless ``--validate`` is given: the
        control-plane binaries serve OpenAPI documents that kubectl cannot parse (their
        JSON carries Go field names such as "Extensions"; /openapi/v2 answers 503), and
        kubectl's validation reads them first (docs/local-cluster.md, "Limits")."""
        argv = list(args)
        if (
            argv
            and argv[0] in ("apply", "create", "replace")
            and not any(a.startswith("--validate") for a in argv)
        ):
            argv.insert(1, "--validate=false")
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *argv],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, proc.args, proc.stdout, proc.stderr
            )
        return proc

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self.api.get("Pod", namespace, name)
        if pod is None:
            raise LookupError(f"no pod {namespace}/{name}")
        return pod

    def pod_ip(self, namespace: str, name: str) -> str:
        ip = (self.pod(namespace, name).get("status") or {}).get("podIP")
        if not ip:
            raise LookupError(f"pod {namespace}/{name} has no IP yet")
        return ip

    def service_url(self, namespace: str, name: str, port: int, scheme: str = "http") -> str:
        svc = self.api.get("Service", namespace, name)
        if svc is None:
            raise LookupError(f"no service {namespace}/{name}")
        ip = svc["spec"].get("clusterIP")
        if not ip or ip == "None":
            raise LookupError(
                f"service {namespace}/{name} is headless: it has no address (use its pods' IPs)"
            )
        return f"{scheme}://{ip}:{port}"

    def _pod_state_dir(self, namespace: str, name: str) -> Path:
        pod = self.api.get("Pod", namespace, name)
        if pod is not None:
            return pod_dir(self.node_dir, namespace, name, pod["metadata"]["uid"])
        runs = sorted(
            (self.node_dir / "pods" / namespace / name).glob("*"), key=lambda p: p.stat().st_mtime
        )
        if not runs:
            raise LookupError(f"pod {namespace}/{name} never ran on this node")
        return runs[-1]

    def processes(self, namespace: str, pod: str) -> dict[str, int]:
        """{container: pid} of the pod's running containers."""
        try:
            return json.loads((self._pod_state_dir(namespace, pod) / "pids.json").read_text())
        except FileNotFoundError:
            return {}

    def pod_log(self, namespace: str, pod: str, container: str, previous: bool = False) -> str:
        name = f"{container}.previous.log" if previous else f"{container}.log"
        path = self._pod_state_dir(namespace, pod) / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def component_log(self, name: str) -> str:
        """The log of a cluster process: etcd, kube-apiserver, kube-controller-manager,
        kube-scheduler, node-agent, service-forwarder."""
        assert self.control_plane is not None
        path = self.control_plane.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class _AdminApi:
    """get/list/apply/delete of dicts as a cluster admin (the control plane's client)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.cp.get(kind, namespace, name)

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        return self.cp.list(kind, namespace, selector)

    def apply(self, obj: dict[str, Any], manager: str = "kvmesh-test") -> dict[str, Any]:
        resp = self.cp.apply(obj, manager=manager)
        if resp.status_code >= 400:
            raise RuntimeError(
                f"{obj['kind']}/{obj['metadata']['name']}: {resp.status_code} {resp.text}"
            )
        return resp.json()

    def delete(
        self, kind: str, namespace: str | None, name: str, grace_seconds: int | None = None
    ) -> bool:
        assert self.cp.client is not None
        body = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        resp = self.cp.client.request("DELETE", controlplane.path(kind, namespace, name), json=body)
        if resp.status_code == 404:
            return False
        resp.raise_for_status()
        return True

    @property
    def client(self) -> httpx.Client:
        assert self.cp.client is not None
        return self.cp.client


for _kind, _api, _plural, _namespaced in (
    ("ConfigMap", "v1", "configmaps", True),
    ("Node", "v1", "nodes", False),
    ("PersistentVolume", "v1", "persistentvolumes", False),
    ("Lease", "coordination.k8s.io/v1", "leases", True),
    ("StatefulSet", "apps/v1", "statefulsets", True),
):
    controlplane.register_kind(_kind, _api, _plural, _namespaced)


def _up(args: argparse.Namespace) -> None:
    import signal as _signal
    import threading

    stop = threading.Event()
    for sig in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(sig, lambda *_: stop.set())
    images = json.loads(Path(args.images).read_text()) if args.images else None
    cluster = LocalCluster(Path(args.workdir), gpus=args.gpus, images=images)
    with cluster:
        print(
            f"kubeconfig: {cluster.kubeconfig}\n"
            f"  kubectl --kubeconfig {cluster.kubeconfig} get nodes\n"
            f"  export KUBECONFIG={cluster.kubeconfig}\n"
            f"pods get IPs in {cluster.net.pod_cidr}, Services in {cluster.net.service_cidr} (reachable from here);\n"
            f"logs: {cluster.workdir}/control-plane/*.log, container logs under {cluster.node_dir}/pods/.\n"
            f"Ctrl-C stops every process and removes the network namespaces and the bridge.",
            flush=True,
        )
        while not stop.wait(1):
            pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh_testing.cluster", description="a local Kubernetes cluster"
    )
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster and run it until Ctrl-C")
    up.add_argument("--workdir", required=True)
    up.add_argument("--gpus", type=int, default=4, help="the node's nvidia.com/gpu count")
    up.add_argument(
        "--images", help="a JSON file of extra image table entries (docs/local-cluster.md)"
    )
    args = p.parse_args(argv)
    if args.command == "up":
        _up(args)


if __name__ == "__main__":
    main()
