"""Mount points that pods need and the host lacks (``/models``, ``/data``,
``/var/run/secrets/kubernetes.io/serviceaccount``...) are created on the host's file system,
as empty directories or files: a container's mount namespace still shares the host's files.
The launcher records each one it creates; a cluster that stops removes those still empty once
no other local cluster runs (their pods could have them mounted). The launcher holds a shared
lock while it makes mount points, the removal an exclusive one."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

STATE_DIR = Path("/run/kvmesh-local-cluster")
LOCK = STATE_DIR / "mount-points.lock"
LOG = STATE_DIR / "mount-points.created"


def _other_cluster_runs(own_slot: int | None) -> bool:
    for lock_file in STATE_DIR.glob("slot-*.lock"):
        if lock_file.name == f"slot-{own_slot}.lock":
            continue
        with open(lock_file, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
    return False


def remove_created_mount_points(own_slot: int | None) -> list[str]:
    """Remove the recorded mount points that are still empty, unless another cluster runs;
    the paths removed."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _other_cluster_runs(own_slot):
            return []
        try:
            paths = set(LOG.read_text().splitlines())
        except FileNotFoundError:
            return []
        removed = []
        for path in sorted(
            (p for p in paths if p.startswith("/")), key=lambda p: p.count("/"), reverse=True
        ):
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # only an empty one
                elif os.path.isfile(path) and os.path.getsize(path) == 0:
                    os.unlink(path)
                else:
                    continue
                removed.append(path)
            except OSError:
                pass
        LOG.write_text("")
        return removed
