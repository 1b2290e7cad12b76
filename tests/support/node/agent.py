"""The node agent: registers a Node, renews its Lease, and runs the pods the scheduler binds
to it as local processes (one PodWorker thread each). Also the pods' view of Services:
/etc/hosts entries and the Service environment variables.

``python -m kvmesh_testing.node --kubeconfig K --state-dir D --slot N`` (kvmesh_testing.cluster
starts it); it stops every pod on SIGTERM, or when the process that started it is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvmesh_testing.node import network
from kvmesh_testing.node.api import Api, Informer
from kvmesh_testing.node.envvars import ConfigError
from kvmesh_testing.node.events import EventRecorder
from kvmesh_testing.node.images import ImageTable
from kvmesh_testing.node.kubelet_api import KubeletApi
from kvmesh_testing.node.lifeline import watch_parent
from kvmesh_testing.node.pods import PodWorker
from kvmesh_testing.node.provisioner import Provisioner
from kvmesh_testing.node.registration import Registration

log = logging.getLogger("kvmesh_testing.node")


class Agent:
    def __init__(
        self,
        *,
        kubeconfig: Path,
        state_dir: Path,
        slot: int,
        node_name: str = "kvmesh-node",
        cpu: str = "16",
        memory: str = "64Gi",
        gpus: int = 4,
        images: dict[str, Any] | None = None,
        backoff_initial: float = 10.0,
        backoff_cap: float = 300.0,
    ) -> None:
        self.api = Api(kubeconfig)
        self.state_dir = state_dir
        self.net = network.NetworkConfig(slot)
        self.ips = network.PodIPs(self.net)
        self.node_name = node_name
        self.allocatable = {
            "cpu": cpu,
            "memory": memory,
            "pods": "110",
            "ephemeral-storage": "100Gi",
            "nvidia.com/gpu": str(gpus),
        }
        self.images = ImageTable(images)
        self.backoff_initial, self.backoff_cap = backoff_initial, backoff_cap
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()  # uids whose pods this agent has finalised
        self.lock = threading.Lock()
        self.registration = Registration(self.api, node_name, self.allocatable, self.net.gateway)
        self.services = Informer(self.api, "/api/v1/services", on_event=self._service_event)
        self.slices = Informer(
            self.api, "/apis/discovery.k8s.io/v1/endpointslices", on_event=self._service_event
        )
        self.pods = Informer(
            self.api,
            "/api/v1/pods",
            on_event=self._pod_event,
            fieldSelector=f"spec.nodeName={node_name}",
        )
        self.provisioner = Provisioner(self.api, state_dir / "volumes")
        self.events = EventRecorder(self.api, node_name)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.kubelet_api = KubeletApi(self.net.gateway, self.state_dir, self.log_dir)
        self.kubelet_api.start()
        self.registration.kubelet_port = self.kubelet_api.port
        self.registration.register()
        self.events.start()
        self.services.start()
        self.slices.start()
        self.services.synced.wait(30)
        self.provisioner.start()
        self.pods.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.pods.stop()
        self.services.stop()
        self.slices.stop()
        self.provisioner.stop()
        self.registration.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.shutdown.set()
        for (
            w
        ) in workers:  # now, from here: a worker may be blocked on an API server that is going away
            w.kill_containers()
        deadline = time.monotonic() + timeout
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                w.teardown_network()
        self.events.stop()
        self.kubelet_api.stop()
        self.api.close()

    # --- pods --------------------------------------------------------------------------------

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.gone.set()
                return
            if worker is not None:
                worker.update(pod)
                return
            if uid in self.finished or (pod.get("status") or {}).get("phase") in (
                "Succeeded",
                "Failed",
            ):
                return
            worker = self.workers[uid] = PodWorker(self, pod)
        worker.start()

    def worker_done(self, worker: PodWorker) -> None:
        with self.lock:
            if self.workers.get(worker.uid) is worker and (
                worker.gone.is_set()
                or worker.shutdown.is_set()
                or worker.pod["metadata"].get("deletionTimestamp")
            ):
                del self.workers[worker.uid]
                self.finished.add(worker.uid)

    def log_dir(self, namespace: str, pod: str) -> Path | None:
        """The log directory of the pod's current (else latest) run on this node."""
        with self.lock:
            for w in self.workers.values():
                if (w.namespace, w.pod_name) == (namespace, pod):
                    return w.dir / "logs"
        runs = sorted(
            (self.state_dir / "pods" / namespace / pod).glob("*/logs"),
            key=lambda p: p.stat().st_mtime,
        )
        return runs[-1] if runs else None

    def claim_path(self, namespace: str, claim: str) -> str:
        pvc = self.api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        if pvc is None:
            raise ConfigError(f'persistentvolumeclaim "{claim}" not found')
        volume = (pvc.get("spec") or {}).get("volumeName")
        if volume:
            pv = self.api.get(f"/api/v1/persistentvolumes/{volume}") or {}
            host_path = ((pv.get("spec") or {}).get("hostPath") or {}).get("path")
            if host_path:
                Path(host_path).mkdir(parents=True, exist_ok=True)
                return host_path
        path = self.state_dir / "claims" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    # --- Services as the pods see them ---------------------------------------------------------

    def _service_event(self, kind: str, svc: dict[str, Any]) -> None:
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.refresh_hosts()

    def service_links(self, namespace: str) -> list[tuple[str, str, list[dict[str, Any]]]]:
        return [
            (s["metadata"]["name"], s["spec"].get("clusterIP", ""), s["spec"].get("ports") or [])
            for s in self.services.items()
            if s["metadata"]["namespace"] == namespace
        ]

    def hosts_for(self, namespace: str, pod_ip: str, pod_name: str) -> str:
        lines = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{pod_ip}\t{pod_name}",
            "# Services (kvmesh local cluster)",
        ]
        for svc in sorted(self.services.items(), key=Informer.key):
            ip = svc["spec"].get("clusterIP")
            if not ip:
                continue
            name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
            names = [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc", f"{name}.{ns}"]
            if ns == namespace:
                names.append(name)
            # a headless Service's names resolve to its ready endpoints, as cluster DNS answers
            for address in self._ready_addresses(ns, name) if ip == "None" else [ip]:
                lines.append(f"{address}\t{' '.join(names)}")
        return "\n".join(lines) + "\n"

    def _ready_addresses(self, namespace: str, service: str) -> list[str]:
        out = []
        for s in self.slices.items():
            meta = s["metadata"]
            if (
                meta.get("namespace") == namespace
                and (meta.get("labels") or {}).get("kubernetes.io/service-name") == service
            ):
                out += [
                    a
                    for e in s.get("endpoints") or []
                    if (e.get("conditions") or {}).get("ready", True)
                    for a in e.get("addresses") or []
                ]
        return sorted(set(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh_testing.node", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument(
        "--slot",
        type=int,
        required=True,
        help="the cluster's network slot (kvmesh_testing.cluster)",
    )
    p.add_argument("--node-name", default="kvmesh-node")
    p.add_argument("--cpu", default="16")
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument(
        "--images", type=Path, help="JSON: extra image table entries (kvmesh_testing.node.images)"
    )
    p.add_argument(
        "--backoff-initial", type=float, default=10.0, help="first crash back-off, seconds"
    )
    p.add_argument(
        "--backoff-cap", type=float, default=300.0, help="longest crash back-off, seconds"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    watch_parent(stop.set)
    agent = Agent(
        kubeconfig=args.kubeconfig,
        state_dir=args.state_dir,
        slot=args.slot,
        node_name=args.node_name,
        cpu=args.cpu,
        memory=args.memory,
        gpus=args.gpus,
        images=json.loads(args.images.read_text()) if args.images else None,
        backoff_initial=args.backoff_initial,
        backoff_cap=args.backoff_cap,
    )
    agent.start()
    log.info("node %s ready (pods on %s)", args.node_name, agent.net.pod_cidr)
    stop.wait()
    log.info("stopping: every pod's processes are killed")
    agent.stop()
