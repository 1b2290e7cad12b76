"""A regular (non-editable) install carries every package and the kernels' sources, and the
Dockerfiles copy everything that install needs (the images build from exactly those folders)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# the folders a build reads: kvmesh/ and each component's folder (package-dir)
SOURCE_DIRS = ["kvmesh", *SETUPTOOLS["package-dir"].values()]


def _copied(dockerfile: Path) -> set[str]:
    """What a Dockerfile COPYs from the build context (sources, not the destinations)."""
    copied = set()
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"\s*COPY\s+(?!--from)(.+)", line)
        if m:
            copied.update(p.rstrip("*") for p in m.group(1).split()[:-1])
    return copied


@pytest.mark.parametrize("name", ["engine", "router", "operator"])
def test_dockerfiles_copy_every_package_folder(name):
    copied = _copied(ROOT / "docker" / f"{name}.Dockerfile")
    assert {"pyproject.toml", *SOURCE_DIRS} <= copied, sorted(
        {"pyproject.toml", *SOURCE_DIRS} - copied
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built as an image builds it: from a context holding only what the Dockerfiles
    COPY (the working tree's files, build caches left out)."""
    ctx, out = tmp_path_factory.mktemp("context"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, ctx / name)
    for folder in SOURCE_DIRS:
        shutil.copytree(
            ROOT / folder, ctx / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ctx),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("kvmesh-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_every_package(wheel):
    names = set(wheel.namelist())
    for package in SETUPTOOLS["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    # every module of the tree, at its installed name (engine/scheduler.py -> kvmesh/engine/scheduler.py)
    mapping = {folder: name.replace(".", "/") for name, folder in SETUPTOOLS["package-dir"].items()}
    for folder in SOURCE_DIRS:
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder).as_posix()
            assert f"{mapping.get(folder, folder)}/{rel}" in names, py
    assert not any(
        n.startswith(("engine/", "router/", "sidecar/", "operator/", "tests/")) for n in names
    )


def test_wheel_holds_no_test_support(wheel):
    # test support is a dev-only distribution of its own (tests/support/, package kvmesh_testing)
    assert not [p for p in SETUPTOOLS["packages"] if "testing" in p], SETUPTOOLS["packages"]
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"kvmesh"}
    assert not [n for n in names if "testing" in n.split("/")[:-1]]


def test_wheel_holds_the_kernel_sources(wheel):
    # the engine compiles its CPU kernels from these at first start: package data, not modules
    names = set(wheel.namelist())
    sources = sorted(
        p.name for p in (ROOT / "engine" / "kernels").iterdir() if p.suffix in (".cpp", ".h")
    )
    assert sources and any(s.endswith(".h") for s in sources)
    for source in sources:
        assert f"kvmesh/engine/kernels/{source}" in names, source
    from kvmesh.engine.kernels import cpu

    assert {p.name for p in cpu._SOURCES} | set(cpu._HEADERS) <= set(sources)


def test_wheel_entry_point(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "kvmesh = kvmesh.cli:main" in wheel.read(ep).decode()
