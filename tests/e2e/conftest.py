"""The end-to-end scenario's cluster (one per module: kvmesh_testing.cluster.LocalCluster, the
real control plane and a node agent running pods as local processes), what a failed step
shows (every pod's state and its containers' last log lines), and the report at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import report
from tests.operator.conftest import fail_missing_control_plane_under_ci

FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    # The real-API-server tests' rule holds here too: under CI=true a missing control plane fails.
    fail_missing_control_plane_under_ci(rep)
    if rep.failed:
        item.stash[FAILED] = True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from kvmesh_testing.cluster import LocalCluster, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no real control plane: {why}")
    # Not under /tmp: every engine pod mounts its own emptyDir there.
    images = engine_image_with_prebuilt_kernels(
        Path.home() / ".cache" / "kvmesh" / "e2e-torch-extensions"
    )
    with LocalCluster(tmp_path_factory.mktemp("cluster"), images=images) as local:
        yield local


@pytest.fixture(autouse=True)
def show_the_cluster_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if request.node.stash.get(FAILED, False) and "cluster" in request.fixturenames:
        sys.stderr.write(cluster_state(request.getfixturevalue("cluster")))


def cluster_state(cluster) -> str:
    """Every pod (phase, readiness, restarts) with the last lines of its containers' logs."""
    out = ["", "---- cluster state ----"]
    for pod in cluster.api.list("Pod"):
        meta, status = pod["metadata"], pod.get("status") or {}
        containers = {
            s["name"]: (s.get("ready"), s.get("restartCount"), list(s.get("state") or {}))
            for s in status.get("containerStatuses") or []
        }
        out.append(
            f"{meta['namespace']}/{meta['name']} {status.get('phase')} "
            f"deleting={bool(meta.get('deletionTimestamp'))} {json.dumps(containers)}"
        )
        for c in pod["spec"]["containers"]:
            log = cluster.pod_log(meta["namespace"], meta["name"], c["name"]).splitlines()[-8:]
            out += [f"    {c['name']}| {line[:300]}" for line in log]
    return "\n".join(out) + "\n"


# Copies the CPU kernels `make setup` built into the scenario's own cache (once), makes sure they are
# built there (a no-op when they are), and prints the directory.
_PREPARE_KERNELS = """
import os, shutil, sys
from pathlib import Path
from kvmesh.engine.kernels import cpu
name, root = cpu.build_name(), Path(sys.argv[1])
shared = cpu.build_directory(name)
if shared.is_dir() and not (root / name).exists():
    shutil.copytree(shared, root / name, ignore=shutil.ignore_patterns("lock", "kvmesh-build.lock", ".ninja_lock"))
os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
cpu.build()
print(root)
"""


def engine_image_with_prebuilt_kernels(root: Path) -> dict[str, dict]:
    """The engine image as the local cluster maps it, with prebuilt CPU kernels (an image would
    carry them): otherwise every engine start compiles them anew into its own emptyDir /tmp,
    minutes on a small machine. The pods load a copy of the ones `make setup` built, kept for the
    scenario alone, so no other build on the machine can make them stale."""
    from kvmesh_testing.node.images import VENV_BIN, base_path, default_table

    pattern = "ghcr.io/kvmesh/engine:*"
    image = default_table()[pattern]
    env = dict(image.env)
    # The pods' PATH: torch runs the first `ninja` on it, and a build log written by another ninja
    # version (the system's, say) makes the next build start from scratch.
    built = subprocess.run(
        [f"{VENV_BIN}/python", "-P", "-c", _PREPARE_KERNELS, str(root)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PATH": base_path(image)},
    )
    if built.returncode == 0:  # else (no compiler) the engines run on plain torch ops
        env["TORCH_EXTENSIONS_DIR"] = built.stdout.strip().splitlines()[-1]
    return {
        pattern: {
            "entrypoint": list(image.entrypoint),
            "cmd": list(image.cmd),
            "workingDir": image.working_dir,
            "path": list(image.path),
            "env": env,
        }
    }


def pytest_terminal_summary(terminalreporter) -> None:
    if report.LINES:
        terminalreporter.write_sep("=", "kvmesh end-to-end scenario")
        for line in report.LINES:
            terminalreporter.write_line(line)
