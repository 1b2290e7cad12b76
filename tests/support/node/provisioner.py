"""A hostPath provisioner (as local-path provisioners do on small clusters): every
PersistentVolumeClaim that is not bound gets a PersistentVolume of its size, access modes and
class, pre-bound to it (claimRef), backed by a directory in the node's state directory; the
controller manager's PV binder then binds the pair and the scheduler places the claim's pods."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvmesh_testing.node.api import Api, ApiError, Informer

log = logging.getLogger(__name__)
PROVISIONER = "kvmesh.io/local-cluster"


class Provisioner:
    def __init__(self, api: Api, root: Path) -> None:
        self.api, self.root = api, root
        self.claims = Informer(api, "/api/v1/persistentvolumeclaims", on_event=self._claim_event)

    def start(self) -> None:
        self.claims.start()

    def stop(self) -> None:
        self.claims.stop()

    def _claim_event(self, kind: str, pvc: dict[str, Any]) -> None:
        spec, meta = pvc.get("spec") or {}, pvc["metadata"]
        if kind == "DELETED" or spec.get("volumeName") or meta.get("deletionTimestamp"):
            return
        name = f"pvc-{meta['uid']}"
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            },
            "spec": {
                "capacity": {
                    "storage": ((spec.get("resources") or {}).get("requests") or {}).get(
                        "storage", "1Gi"
                    )
                },
                "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                "volumeMode": spec.get("volumeMode") or "Filesystem",
                "storageClassName": spec.get("storageClassName") or "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        try:
            self.api.create("/api/v1/persistentvolumes", pv)
            log.info("provisioned %s for claim %s/%s", name, meta["namespace"], meta["name"])
        except ApiError as exc:
            if exc.status != 409:
                log.warning(
                    "cannot provision a volume for %s/%s: %s", meta["namespace"], meta["name"], exc
                )
