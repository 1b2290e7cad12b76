"""One container of a pod: its process (started through launcher.py in the pod's network
namespace), its probes, its restarts with the kubelet's crash back-off, and its status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh_testing.node import hostpaths
from kvmesh_testing.node.images import HOST_PATHS
from kvmesh_testing.node.probes import Prober, Target
from kvmesh_testing.node.restarts import backoff
from kvmesh_testing.node.status import now

LAUNCHER = str(Path(__file__).with_name("launcher.py"))


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (from /proc/<pid>/stat: the field after the parent,
    process group)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
            members.append(int(entry))
    return members


@dataclass
class Launch:
    """Everything a start needs, resolved by the pod (image, env, mounts)."""

    argv: list[str]
    env: dict[str, str]
    mounts: list[dict[str, Any]]
    cwd: str


@dataclass
class Container:
    spec: dict[str, Any]
    log_dir: Path
    init: bool = False
    restart_count: int = 0
    popen: subprocess.Popen | None = None
    started_mono: float = 0.0
    started_at: str = ""
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    probers: dict[str, Prober] = field(default_factory=dict)
    crashes: int = 0  # consecutive failed runs, for the back-off
    next_start: float = 0.0  # monotonic time of the next (re)start
    kill_deadline: float | None = None
    kill_reason: str = ""
    env: dict[str, str] = field(default_factory=dict)
    on_probe_failure: Callable[[str, str], None] | None = (
        None  # (probe kind, why): the pod's events
    )

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None and "running" in self.state

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.running else None

    @property
    def started(self) -> bool:
        if not self.running:
            return False
        startup = self.probers.get("startup")
        return startup is None or bool(startup.healthy)

    @property
    def ready(self) -> bool:
        if not self.started:
            return False
        readiness = self.probers.get("readiness")
        return readiness is None or bool(readiness.healthy)

    def wait(self, reason: str, message: str = "") -> None:
        self.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}

    def start(
        self, launch: Launch, *, netns: str, hostname: str, pod_ip: str, state_dir: Path
    ) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():  # the previous run's log stays readable, as `kubectl logs -p`
            os.replace(self.log_path, self.log_dir / f"{self.name}.previous.log")
        spec_file = state_dir / f"{self.name}.launch.json"
        spec_file.write_text(
            json.dumps(
                {
                    "netns": netns,
                    "hostname": hostname,
                    "mounts": launch.mounts,
                    "argv": launch.argv,
                    "env": launch.env,
                    "cwd": launch.cwd,
                    "deathSignal": int(signal.SIGKILL),
                    "mountPointLock": str(hostpaths.LOCK),
                    "mountPointLog": str(hostpaths.LOG),
                    "hostPaths": HOST_PATHS,
                }
            )
        )
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-S", "-P", LAUNCHER, str(spec_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.env = launch.env
        self.started_mono, self.started_at = time.monotonic(), now()
        self.state = {"running": {"startedAt": self.started_at}}
        self.kill_deadline, self.kill_reason = None, ""
        self._start_probes(pod_ip)

    def _start_probes(self, pod_ip: str) -> None:
        assert self.popen is not None
        ports = {
            p["name"]: int(p["containerPort"])
            for p in self.spec.get("ports") or []
            if p.get("name")
        }
        target = Target(pod_ip, ports, self.popen.pid, self.env)
        self.probers = {}
        startup = None
        if self.spec.get("startupProbe") and not self.init:
            startup = self.probers["startup"] = Prober(
                "startup",
                self.spec["startupProbe"],
                target,
                self.started_mono,
                on_failure=self.on_probe_failure,
            )
        for kind in ("liveness", "readiness"):
            probe = self.spec.get(f"{kind}Probe")
            if probe and not self.init:
                self.probers[kind] = Prober(
                    kind,
                    probe,
                    target,
                    self.started_mono,
                    after=startup,
                    on_failure=self.on_probe_failure,
                )
        for prober in self.probers.values():
            prober.start()

    def stop_probes(self) -> None:
        for prober in self.probers.values():
            prober.stop()

    def probe_failure(self) -> str | None:
        """Why a startup or liveness probe gave up on this run, if one did."""
        for kind in ("startup", "liveness"):
            prober = self.probers.get(kind)
            if prober is not None and prober.gave_up.is_set():
                return f"Container {self.name} failed {kind} probe: {prober.message}"
        return None

    def terminate(self, grace: float, reason: str) -> None:
        """SIGTERM now, SIGKILL (the whole process group) when ``grace`` runs out (see reap)."""
        if self.popen is None or self.popen.poll() is not None or self.kill_deadline is not None:
            return
        self.kill_reason = reason
        self.kill_deadline = time.monotonic() + max(grace, 0.0)
        try:
            os.kill(self.popen.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> int | None:
        """The exit code if the process has ended (recording the terminated state); SIGKILL
        past a kill deadline."""
        if self.popen is None or "running" not in self.state:
            return None
        code = self.popen.poll()
        if code is None:
            if self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
                self._kill_group()
            return None
        self._kill_group()  # what the container's process left behind goes with it, as with a cgroup
        self.stop_probes()
        exit_code = 128 - code if code < 0 else code
        reason = "Completed" if exit_code == 0 else "Error"
        terminated = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": self.started_at,
            "finishedAt": now(),
            "containerID": self.container_id,
        }
        if code < 0:
            terminated["signal"] = -code
        if self.kill_reason:
            terminated["message"] = self.kill_reason
        self.state = {"terminated": terminated}
        return exit_code

    def _kill_group(self) -> None:
        """SIGKILL everything the container started: its session (the process began one),
        which also holds the process groups a build tool or shell makes for its jobs."""
        assert self.popen is not None
        for pid in session_members(self.popen.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def force_kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self._kill_group()
            self.popen.wait()

    @property
    def container_id(self) -> str:
        return f"kvmesh://{self.popen.pid if self.popen else 0}"

    def schedule_restart(self, initial: float, cap: float) -> float:
        """After a run ended: the back-off delay before the next start (kubelet: none after a
        first failure, then 10 s doubling up to 5 min; reset after a long enough run)."""
        ran = time.monotonic() - self.started_mono
        delay, self.crashes = backoff(self.crashes, ran, initial, cap)
        self.last_state = self.state
        self.next_start = time.monotonic() + delay
        return delay

    def status(self, image: str) -> dict[str, Any]:
        return {
            "name": self.name,
            "image": image,
            "imageID": "",
            "containerID": self.container_id,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
