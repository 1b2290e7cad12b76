"""Stop a harness process when the process that started it is gone (killed without a chance
to stop its children): the parent's pid is polled, as PR_SET_PDEATHSIG would follow only the
thread that forked us, and a cluster may be started from a thread that ends.

``python -m kvmesh_testing.node.lifeline --slot N --pids-file F`` is a cluster's watchdog: it
holds the cluster's slot lock (inherited), and if the cluster's process dies it stops the
processes recorded in F (SIGTERM, one after the other; SIGKILL after a while), removes the slot's network, and
exits, releasing the slot. A normal stop ends it with SIGTERM before cleaning up itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path


def watch_parent(on_orphaned: Callable[[], None], interval: float = 1.0) -> threading.Thread:
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval)
        on_orphaned()

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread


def _recorded(pids_file: Path) -> list[int]:
    """The recorded pids whose command lines still match (not reused by another process)."""
    try:
        entries = json.loads(pids_file.read_text())
    except (OSError, ValueError):
        return []
    alive = []
    for pid, cmdline in entries:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") == cmdline:
                alive.append(pid)
        except OSError:
            pass
    return alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_recorded(pids_file: Path, grace: float = 15.0) -> None:
    """SIGTERM the recorded processes that still run one at a time, each once the one before it
    has exited, in reverse order of start (the node agent first: it stops the pods; etcd last:
    the API server waits for it while it shuts down), as the cluster's own stop does; SIGKILL
    whatever is left after ``grace`` in all. Which processes they are is decided once, by
    command line, before any signal: an exiting process's command line may read empty."""
    pids = _recorded(pids_file)
    deadline = time.monotonic() + grace
    for pid in reversed(pids) if grace > 0 else ():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    from kvmesh_testing.node import hostpaths, network

    p = argparse.ArgumentParser(prog="python -m kvmesh_testing.node.lifeline")
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--pids-file", type=Path, required=True)
    args = p.parse_args(argv)
    orphaned = threading.Event()
    signal.signal(
        signal.SIGTERM, lambda *_: os._exit(0)
    )  # the cluster stops normally: nothing to do
    watch_parent(orphaned.set)
    orphaned.wait()
    stop_recorded(args.pids_file)
    network.remove_leftovers(network.NetworkConfig(args.slot))
    hostpaths.remove_created_mount_points(args.slot)
    args.pids_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
