"""Starting never waits on the CPU kernels' build without bound, nor builds them again.

torch's extension build waits forever on a ``lock`` file that a killed builder left behind.
kvmesh's builders hold an OS lock while they build, so a leftover file is known stale and is
removed, and a live builder is waited for at most a bound, with logs saying whom for. A
finished build, in a directory named after everything the library depends on, is loaded
without ninja, whoever built it.
These tests stand torch's build in with torch's own lock-file protocol (FileBaton), so they
run in a second; the last ones run on a copy of the real build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from kvmesh.engine.kernels import build_lock, build_record, cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def torch_builds() -> list[str]:
    """The names torch's build (the stand-in) was asked to build."""
    return []


@pytest.fixture()
def build_dir(tmp_path, monkeypatch, torch_builds) -> Path:
    """An empty extension cache, and torch's build replaced by its lock-file protocol alone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failed", False)

    def fake_load(name, sources, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if not baton.try_acquire():  # torch would call baton.wait(): forever, on a stale file
            raise AssertionError(
                "torch's lock file is still there: the real build would wait forever"
            )
        baton.release()
        torch_builds.append(name)
        build_record.library(Path(build_directory), name).touch()  # what a build leaves
        return f"module {name}"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    return cpu.build_directory(cpu.build_name())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_left_by_a_dead_builder_is_removed_and_the_build_goes_on(build_dir, caplog):
    build_dir.mkdir(parents=True, exist_ok=True)  # torch makes it when asked where it is
    (build_dir / "lock").touch()  # what a builder killed mid-build leaves
    (build_dir / build_lock.LOCK_NAME).write_text(
        f'{{"pid": {dead_pid()}, "host": "h", "started": 0}}'
    )
    with caplog.at_level(logging.INFO):
        assert cpu.load() == f"module {cpu.build_name()}"
    assert not (build_dir / "lock").exists()
    assert any(
        "removing" in r.getMessage() and "builder is gone" in r.getMessage() for r in caplog.records
    )


@pytest.fixture()
def live_builder(build_dir):
    """Another process that holds the build lock until the test lets it go."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from kvmesh.engine.kernels.build_lock import exclusive_build\n"
            f"with exclusive_build({str(build_dir)!r}, 5):\n"
            "    print('holding', flush=True)\n"
            "    sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout.readline().strip() == "holding"
    yield proc
    if proc.poll() is None:
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(10)


def test_a_live_builder_is_waited_for_with_a_bound_and_named(
    build_dir, live_builder, caplog, monkeypatch
):
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(build_lock.BuildLockTimeout, match=f"pid {live_builder.pid} on host"),
    ):
        with build_lock.exclusive_build(build_dir, timeout=0.5, poll_s=0.05, log_every_s=0.1):
            pytest.fail("acquired a lock that a live process holds")
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert waiting and f"pid {live_builder.pid}" in waiting[0] and "kvmesh-build.lock" in waiting[0]
    # the engine does not hang either: past the bound it runs on the plain torch ops
    monkeypatch.setenv("KVMESH_CPU_KERNELS_WAIT_S", "0.3")
    with caplog.at_level(logging.WARNING):
        assert cpu.load() is None
    assert any(
        "CPU kernels unavailable" in r.getMessage() and f"pid {live_builder.pid}" in r.getMessage()
        for r in caplog.records
    )


def test_the_next_builder_goes_on_once_the_live_one_is_done(build_dir, live_builder):
    live_builder.stdin.write("\n")
    live_builder.stdin.flush()
    assert live_builder.wait(10) == 0
    with build_lock.exclusive_build(build_dir, timeout=10):
        assert f'"pid": {os.getpid()}' in (build_dir / build_lock.LOCK_NAME).read_text()


def test_build_kernels_resumes_a_real_build_left_with_a_stale_lock(tmp_path):
    """`kvmesh build-kernels` on a copy of this machine's build, with the lock of a killed builder."""
    name = cpu.build_name()
    built = cpu.build_directory(name)
    if not (built / f"{name}.so").exists():
        pytest.skip("the CPU kernels are not built on this machine (the engine tests build them)")
    copy = tmp_path / name
    shutil.copytree(
        built, copy, symlinks=True, ignore=shutil.ignore_patterns("lock", build_lock.LOCK_NAME)
    )
    (copy / "lock").touch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "build-kernels", "--wait-timeout", "60"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "ready in" in done.stdout and "removing" in done.stderr
    assert not (copy / "lock").exists()


@pytest.fixture()
def imported(monkeypatch) -> list[str]:
    """Libraries imported from a build directory as they are (torch's loader, stood in)."""
    paths: list[str] = []

    def fake_import(name, path, is_python_module):
        paths.append(path)
        return f"loaded {name}"

    monkeypatch.setattr(cpp_extension, "_import_module_from_library", fake_import)
    return paths


def test_a_finished_build_is_loaded_as_it_is_never_built_again(build_dir, torch_builds, imported):
    name = cpu.build_name()
    assert cpu.build() == f"module {name}"
    assert cpu.build() == f"loaded {name}" and cpu.build() == f"loaded {name}"
    assert torch_builds == [name] and imported == [str(build_dir)] * 2


def test_a_build_without_its_record_is_built_again(build_dir, torch_builds, imported):
    """A library with no record of a finished build (its builder killed before the record, or
    an unreadable record) goes through torch's build again, and is recorded then."""
    name = cpu.build_name()
    build_dir.mkdir(parents=True, exist_ok=True)
    build_record.library(build_dir, name).touch()
    (build_dir / build_record.RECORD_NAME).write_text('{"name": ')
    assert cpu.build() == f"module {name}" and torch_builds == [name] and not imported
    assert build_record.finished(build_dir, name)


def test_a_recorded_library_that_does_not_load_is_built_again(build_dir, torch_builds, monkeypatch):
    name = cpu.build_name()
    cpu.build()
    monkeypatch.setattr(
        cpp_extension,
        "_import_module_from_library",
        lambda *a: (_ for _ in ()).throw(ImportError("undefined symbol")),
    )
    assert cpu.build() == f"module {name}" and torch_builds == [name, name]


def test_the_build_directory_is_named_after_what_the_library_depends_on(monkeypatch):
    """Sources and headers, flags, torch's version, the Python ABI: another of any of them is
    another directory, never a rebuild over this one."""
    name = cpu.build_name()
    assert cpu.build_name() == name and name.endswith("_portable" if cpu.portable() else "_native")
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    other_torch = cpu.build_name()
    monkeypatch.undo()
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    monkeypatch.setattr(
        sysconfig,
        "get_config_var",
        lambda key: ".cpython-312-x86_64-linux-gnu.so" if key == "EXT_SUFFIX" else None,
    )
    other_python = cpu.build_name()
    monkeypatch.undo()
    assert sysconfig.get_config_var("EXT_SUFFIX") == ext_suffix
    other_flags = cpu._build_name(cpu._cpu_flags() + ["-DOTHER"])
    assert len({name, other_torch, other_python, other_flags}) == 4
    # nothing of the checkout or the venv: two of them with the same sources share one build
    assert str(ROOT) not in repr(cpu._build_inputs(cpu._cpu_flags()))


def test_a_start_with_another_ninja_loads_the_real_build_without_running_it(tmp_path):
    """Another venv's start: a process whose PATH has another ninja (one that fails, and leaves
    a file when it runs) loads the finished build (a copy of this machine's) without running it."""
    name = cpu.build_name()
    built = cpu.build_directory(name)
    if not build_record.finished(built, name):
        pytest.skip("the CPU kernels are not built on this machine (the engine tests build them)")
    shutil.copytree(
        built,
        tmp_path / name,
        symlinks=True,
        ignore=shutil.ignore_patterns("lock", build_lock.LOCK_NAME),
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ninja = bin_dir / "ninja"
    ninja.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && echo 1.11.1 && exit 0\ntouch {tmp_path}/ninja-ran\nexit 1\n'
    )
    ninja.chmod(0o755)
    env = dict(
        os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PATH=f"{bin_dir}:{os.environ['PATH']}"
    )
    code = "from kvmesh.engine.kernels import cpu\nprint(cpu.build().__name__)"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == name and not (tmp_path / "ninja-ran").exists()
