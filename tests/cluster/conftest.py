"""Fixtures for the local cluster's own tests: one cluster per module (skipped, with the
reason, where it cannot run - except under CI=true, where that is a failure)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh_testing.cluster import LocalCluster, unavailable

HERE = Path(__file__).resolve().parent
STANDIN = str(HERE / "standin.py")
# Stand-in images: the project's images are not needed to test the agent itself.
IMAGES = {
    "example.com/standin:*": {"entrypoint": [sys.executable, "-u", STANDIN]},
    "example.com/python:*": {"entrypoint": [sys.executable, "-u"]},
    "example.com/kubectl:*": {"entrypoint": ["kubectl"], "env": {"HOME": "/tmp"}},
}


def require_cluster() -> None:
    why = unavailable()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"the local cluster cannot run here (CI=true makes this a failure): {why}")
    pytest.skip(f"no local cluster: {why}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_cluster()
    # A short crash back-off cap keeps the restart tests quick (the kubelet's is 10 s doubling to 5 min).
    with LocalCluster(
        tmp_path_factory.mktemp("cluster"), images=IMAGES, backoff_initial=1.0, backoff_cap=2.0
    ) as c:
        yield c


def wait_for(check: Callable[[], Any], timeout: float = 30.0, message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (LookupError, KeyError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{message}: still not true after {timeout}s (last: {last!r})")


def namespace(cluster: LocalCluster, name: str) -> str:
    cluster.api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # the ServiceAccount admission needs the namespace's "default" ServiceAccount
    wait_for(
        lambda: cluster.api.get("ServiceAccount", name, "default"),
        message=f"{name}/default ServiceAccount",
    )
    return name


def pod(name: str, ns: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"test": name}},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": containers, **spec},
    }


def condition(p: dict[str, Any], kind: str) -> str | None:
    return next(
        (c["status"] for c in (p.get("status") or {}).get("conditions") or [] if c["type"] == kind),
        None,
    )


def container_status(p: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    found = next((s for s in (p.get("status") or {}).get(key) or [] if s["name"] == name), None)
    if found is None:
        raise KeyError(f"no status of container {name} yet")
    return found


def wait_pod(
    cluster: LocalCluster,
    ns: str,
    name: str,
    predicate: Callable[[dict[str, Any]], Any],
    timeout: float = 30.0,
    message: str = "",
) -> dict[str, Any]:
    """The pod once ``predicate(pod)`` holds."""

    def check() -> dict[str, Any] | None:
        p = cluster.pod(ns, name)
        return p if predicate(p) else None

    return wait_for(check, timeout=timeout, message=message or f"pod {ns}/{name}")
