"""Startup, readiness and liveness probes (httpGet, tcpSocket, exec; gRPC probes are checked
as TCP connects) with the kubelet's timing: initialDelaySeconds, periodSeconds,
timeoutSeconds, successThreshold and failureThreshold. Also runs lifecycle handlers
(preStop / postStart: exec, httpGet, sleep)."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Target:
    """Where a container's probes and handlers go: the pod's IP, its named ports, and how
    to run a command inside it (pid of the container's process and its environment)."""

    pod_ip: str
    ports: dict[str, int]
    pid: int
    env: dict[str, str]

    def port(self, value: Any) -> int:
        if isinstance(value, int) or str(value).isdigit():
            return int(value)
        if value not in self.ports:
            raise ValueError(f"no container port named {value!r}")
        return self.ports[value]


def run_handler(handler: dict[str, Any], target: Target, timeout: float) -> tuple[bool, str]:
    """One probe or lifecycle action: (succeeded, why not)."""
    try:
        if "httpGet" in handler:
            h = handler["httpGet"]
            host, port = h.get("host") or target.pod_ip, target.port(h["port"])
            if h.get("scheme", "HTTP").upper() == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl._create_unverified_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                conn.request(
                    "GET",
                    h.get("path") or "/",
                    headers={"User-Agent": "kube-probe/1.36", **headers},
                )
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        if "tcpSocket" in handler or "grpc" in handler:
            h = handler.get("tcpSocket") or handler["grpc"]
            with socket.create_connection(
                (h.get("host") or target.pod_ip, target.port(h["port"])), timeout=timeout
            ):
                return True, ""
        if "exec" in handler:
            argv = [
                "nsenter",
                "-t",
                str(target.pid),
                "-n",
                "-m",
                "-u",
                "--",
                *handler["exec"]["command"],
            ]
            proc = subprocess.run(argv, env=target.env, capture_output=True, timeout=timeout)
            out = (proc.stdout + proc.stderr).decode(errors="replace").strip()[-300:]
            return proc.returncode == 0, f"command exited with {proc.returncode}: {out}"
        if "sleep" in handler:
            time.sleep(min(float(handler["sleep"]["seconds"]), timeout))
            return True, ""
        return False, f"unsupported handler {sorted(handler)}"
    except subprocess.TimeoutExpired:
        return False, f"command timed out after {timeout}s"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, f"{type(exc).__name__}: {exc}"


class Prober(threading.Thread):
    """One probe of one container instance. ``healthy`` is None until the thresholds decide;
    ``gave_up`` is set when a startup/liveness probe reaches its failureThreshold."""

    def __init__(
        self,
        kind: str,
        probe: dict[str, Any],
        target: Target,
        started_at: float,
        after: Prober | None = None,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__(name=f"probe-{kind}", daemon=True)
        self.kind, self.probe, self.target, self.started_at, self.after = (
            kind,
            probe,
            target,
            started_at,
            after,
        )
        self.on_failure = on_failure
        self.healthy: bool | None = False if kind == "readiness" else None
        self.gave_up = threading.Event()
        self.message = ""
        self.stop_event = threading.Event()
        self.successes = self.failures = 0

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        p = self.probe
        period, timeout = float(p.get("periodSeconds", 10)), float(p.get("timeoutSeconds", 1))
        success_threshold, failure_threshold = (
            int(p.get("successThreshold", 1)),
            int(p.get("failureThreshold", 3)),
        )
        if self.after is not None:  # liveness and readiness wait for the startup probe
            while not self.stop_event.is_set() and not self.after.healthy:
                self.stop_event.wait(0.1)
        delay = self.started_at + float(p.get("initialDelaySeconds", 0)) - time.monotonic()
        if delay > 0 and self.stop_event.wait(delay):
            return
        while not self.stop_event.is_set():
            ok, message = run_handler(p, self.target, timeout)
            if self.stop_event.is_set():
                return
            if ok:
                self.successes, self.failures = self.successes + 1, 0
                if self.successes >= success_threshold:
                    self.healthy = True
                    if self.kind == "startup":
                        return
            else:
                self.successes, self.failures = 0, self.failures + 1
                self.message = message
                if self.on_failure is not None:
                    self.on_failure(self.kind, message)
                if self.failures >= failure_threshold:
                    self.healthy = False
                    if self.kind in ("startup", "liveness"):
                        self.gave_up.set()
                        return
            self.stop_event.wait(period)
