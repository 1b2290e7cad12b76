"""The Node object (capacity incl. a fake ``nvidia.com/gpu`` count, Ready condition,
addresses) and its Lease in ``kube-node-lease``, renewed as the kubelet renews it."""

from __future__ import annotations

import datetime as dt
import logging
import platform
import threading
from typing import Any

from kvmesh_testing.node.api import Api, ApiError
from kvmesh_testing.node.status import now

log = logging.getLogger(__name__)
LEASE_SECONDS = 40
RENEW_SECONDS = 10


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_status(capacity: dict[str, str], address: str, kubelet_port: int) -> dict[str, Any]:
    t = now()
    return {
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "local node agent is ready",
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            },
            *(
                {
                    "type": kind,
                    "status": "False",
                    "reason": f"KubeletHas{reason}",
                    "lastHeartbeatTime": t,
                    "lastTransitionTime": t,
                }
                for kind, reason in (
                    ("MemoryPressure", "SufficientMemory"),
                    ("DiskPressure", "NoDiskPressure"),
                    ("PIDPressure", "SufficientPID"),
                )
            ),
        ],
        # InternalIP only: the API server reaches a node by the first of its preferred address
        # types it finds (Hostname first), and this node's name resolves nowhere.
        "addresses": [{"type": "InternalIP", "address": address}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": "kvmesh local node",
            "containerRuntimeVersion": "kvmesh-local://0",
            "kubeletVersion": "v1.36.2",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


class Registration:
    def __init__(
        self, api: Api, name: str, capacity: dict[str, str], address: str, kubelet_port: int = 0
    ) -> None:
        self.api, self.name, self.capacity, self.address = api, name, capacity, address
        self.kubelet_port = kubelet_port
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._renew_loop, name="node-lease", daemon=True)

    def register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "kvmesh-local",
                },
            },
            "spec": {},
        }
        try:
            self.api.create("/api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self.update_status()
        self.renew_lease()
        self.thread.start()

    def update_status(self) -> None:
        self.api.patch(
            f"/api/v1/nodes/{self.name}/status",
            {"status": node_status(self.capacity, self.address, self.kubelet_port)},
            kind="merge-patch",
        )

    def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": _micro_now(),
        }
        if self.api.get(path) is None:
            self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                    "spec": spec,
                },
            )
        else:
            self.api.patch(path, {"spec": spec}, kind="merge-patch")

    def _renew_loop(self) -> None:
        beats = 0
        while not self.stopping.wait(RENEW_SECONDS):
            try:
                self.renew_lease()
                beats += 1
                if beats % 4 == 0:  # the node status heartbeat, less often than the lease
                    self.update_status()
            except Exception as exc:  # the API server restarting: try again next period
                log.warning("node lease renewal failed: %s", exc)

    def deregister(self) -> None:
        self.stopping.set()
        try:
            self.api.delete(f"/api/v1/nodes/{self.name}")
        except Exception as exc:
            log.debug("node delete failed: %s", exc)
