"""`kvmesh up` for a benchmark: started on a free port with a state file, waited for until every
replica is routable (one still loading would skew the run), stopped with SIGTERM (its drain) after."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.ports import free_port


@dataclass
class LocalMesh:
    url: str  # the router
    state_file: str  # `kvmesh up --state-file`: the Redis URL, the model, the processes

    def state(self) -> dict:
        return json.loads(Path(self.state_file).read_text())


def wait_routable(url: str, replicas: int, up: subprocess.Popen, timeout: float = 900) -> None:
    """Until the router's /ready counts `replicas` pods; exits if `kvmesh up` does first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"kvmesh up exited ({up.returncode})")
        try:
            r = httpx.get(url + "/ready", timeout=1)
            if r.status_code == 200 and r.json().get("pods", 0) >= replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url}: {replicas} replicas not routable after {timeout:.0f} s")


@contextlib.contextmanager
def local_mesh(
    replicas: int, flags: list[str], verbose: bool = False, label: str = "mesh"
) -> Iterator[LocalMesh]:
    """`kvmesh up --replicas N [flags]`, routable, for the block's length."""
    port = free_port()
    state_file = os.path.join(tempfile.mkdtemp(prefix="kvmesh-bench-"), "up.json")
    cmd = [sys.executable, "-P", "-m", "kvmesh.cli", "up", "--replicas", str(replicas)]
    cmd += ["--port", str(port), "--state-file", state_file, *flags]
    print(f"  {label}: starting {' '.join(cmd[3:])}", flush=True)
    up = subprocess.Popen(
        cmd, stdout=None if verbose else subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"  {label}: waiting for {replicas} replicas to be routable ...", flush=True)
        wait_routable(url, replicas, up)
        yield LocalMesh(url, state_file)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
