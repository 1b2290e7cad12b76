"""`kvmesh up` supervises every child alike (stub engines): the router and Redis are restarted
like engines and sidecars; Ctrl-C stops the mesh promptly while a child waits out its back-off;
a part the mesh cannot run without that keeps crashing stops the mesh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, child_env, wait_until
from tests.mesh.test_up import UpProcess


def _processes(up) -> dict[str, int]:
    return json.loads(up.state.read_text())["processes"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ctrl_c_stops_the_mesh_at_once_while_the_router_waits_out_its_backoff(tmp_path):
    up = UpProcess(
        tmp_path,
        "--replicas",
        "1",
        "--engine-command",
        "stub",
        "--restart-backoff",
        "60",
        "--restart-backoff-max",
        "60",
    )
    try:
        up.wait_up(60)
        pids = _processes(up)
        assert set(pids) == {"redis", "router", "engine-0", "sidecar-0"}
        os.kill(pids["router"], signal.SIGKILL)
        wait_until(
            lambda: any(
                "[up] router exited (killed by SIGKILL)" in line and "restarting it in 60s" in line
                for line in up.lines
            ),
            10,
            msg="the router's exit and back-off logged",
        )
        assert up.proc.poll() is None  # the mesh does not stop because its router died
        t0 = time.monotonic()
        up.proc.send_signal(signal.SIGINT)
        rc = up.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        if up.proc.poll() is None:
            up.stop()
    assert rc == 0, "\n".join(up.lines[-30:])
    assert elapsed < 20, f"stopping took {elapsed:.1f}s"  # not the 60 s back-off
    assert not any("router restarted" in line for line in up.lines)
    assert any("[up] stopped" in line for line in up.lines)
    assert all(_gone(pid) for pid in pids.values())


def test_a_router_that_keeps_crashing_stops_the_mesh(tmp_path):
    up = UpProcess(
        tmp_path,
        "--replicas",
        "1",
        "--engine-command",
        "stub",
        "--router-args=--no-such-flag",
        "--restart-backoff",
        "0.1",
        "--max-restarts",
        "2",
    )
    try:
        rc = up.proc.wait(120)
    finally:
        if up.proc.poll() is None:
            up.stop()
    assert rc == 1
    exits = [line for line in up.lines if line.startswith("[up] router exited (exit code 2)")]
    assert len(exits) == 3, "\n".join(up.lines[-30:])  # the first run and two restarts
    assert "restarting it in 0.1s (restart 1 in a row)" in exits[0]
    assert "restarting it in 0.2s (restart 2 in a row)" in exits[1]
    assert "giving up on it" in exits[2]
    assert any("[up] cannot run without router; shutting down" in line for line in up.lines)
    assert any("[up] stopped" in line for line in up.lines)
    assert not up.state.exists()


def test_up_rejects_bad_restart_settings(tmp_path):
    for flags, message in (
        (
            ["--restart-backoff", "2", "--restart-backoff-max", "1"],
            "--restart-backoff-max must be >= --restart-backoff",
        ),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "up",
                "--engine-command",
                "stub",
                *flags,
                "--state-file",
                str(tmp_path / "up.json"),
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0 and message in out.stdout + out.stderr
        assert not (tmp_path / "up.json").exists()


def _gone_or_zombie(pid: int) -> bool:
    if _gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_sigkilled_mesh_takes_every_child_with_it(tmp_path):
    """`kvmesh up` killed outright (the OOM killer, a killed test run) cannot stop its children:
    each follows it (parent_death.py) instead of running on as an orphan holding its memory."""
    up = UpProcess(tmp_path, "--replicas", "2", "--engine-command", "stub")
    try:
        up.wait_up(60)
        children = _processes(up)
        names = sorted(children)
        assert any(n.startswith("engine") for n in names) and "router" in names and "redis" in names
        assert not any(_gone(pid) for pid in children.values())
        up.proc.send_signal(signal.SIGKILL)
        up.proc.wait(10)
        wait_until(
            lambda: all(_gone_or_zombie(pid) for pid in children.values()),
            20,
            msg=f"every child of the killed mesh to end: {children}",
        )
    finally:
        up.proc.kill()
