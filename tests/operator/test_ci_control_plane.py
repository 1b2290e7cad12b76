"""Under CI a missing control plane fails the tests that need it; elsewhere they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_CONTROL_PLANE = (
    "tests/operator/test_client.py::test_apiserver_credentials_conflicts_and_subresources"
)


def run_without_binaries(ci: str | None, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["KUBEBUILDER_ASSETS"] = str(tmp_path / "no-binaries")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            NEEDS_CONTROL_PLANE,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("ci", ["true"])
def test_ci_fails_a_test_whose_control_plane_is_missing(ci: str, tmp_path: Path) -> None:
    result = run_without_binaries(ci, tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    assert (
        "1 failed" in result.stdout
        and "CI=true and the real control plane is missing" in result.stdout
    )


@pytest.mark.parametrize("ci", [None])
def test_outside_ci_a_missing_control_plane_skips(ci: str | None, tmp_path: Path) -> None:
    result = run_without_binaries(ci, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "1 skipped" in result.stdout and "no real control plane" in result.stdout
