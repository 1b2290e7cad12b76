"""One builder at a time in a torch extension's build directory, and never a wait without bound.

torch's JIT build (``torch.utils.cpp_extension.load``) serialises builders with a ``lock`` file
that it creates and deletes itself. A builder that dies mid-build (Ctrl-C, a pod killed by its
startup probe) leaves that file behind, and every later ``load`` then waits on it forever.

kvmesh's builders first take an OS lock (``flock``) on ``kvmesh-build.lock`` in the same
directory. The kernel releases it when its holder dies, however it dies, so:

- whoever holds it is alive and building: the others wait for it, logging whom they wait for
  (pid, host, since when: the holder writes them into the file), up to a bound;
- torch's ``lock`` found by the holder is stale (its builder is gone: it would still hold the
  flock) and is removed before the build starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no OS lock; torch's own lock file alone
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_NAME = "kvmesh-build.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.file_baton's file in the build directory


class BuildLockTimeout(TimeoutError):
    """Another live process has held the build lock for longer than we may wait."""


def describe_holder(lock_path: Path) -> str:
    """Who holds the lock, as its holder recorded it ("pid 123 on host h, building for 40s")."""
    try:
        info = json.loads(lock_path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process"
    since = f", building for {time.time() - info['started']:.0f}s" if info.get("started") else ""
    return f"pid {info['pid']} on host {info.get('host', '?')}{since}"


@contextlib.contextmanager
def exclusive_build(
    build_dir: str | Path, timeout: float, poll_s: float = 0.2, log_every_s: float = 10.0
) -> Iterator[None]:
    """Hold the build directory for a build: wait (at most ``timeout`` seconds, logging whom for)
    while a live process builds there, then clear a lock file that a dead builder left."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    lock_path = build_dir / LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_log = start
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                holder = describe_holder(lock_path)
                if waited >= timeout:
                    raise BuildLockTimeout(
                        f"waited {waited:.0f}s for {holder} to build in {build_dir} (lock {lock_path}); "
                        f"giving up after {timeout:.0f}s"
                    ) from None
                if time.monotonic() >= next_log:
                    log.info(
                        "waiting for %s, which builds the CPU kernels in %s (lock %s); waited %.0fs of at "
                        "most %.0fs",
                        holder,
                        build_dir,
                        lock_path,
                        waited,
                        timeout,
                    )
                    next_log = time.monotonic() + log_every_s
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            ).encode(),
        )
        torch_lock = build_dir / TORCH_LOCK_NAME
        if torch_lock.exists():
            # We hold the flock, so no live kvmesh builder owns this file: its builder died.
            log.warning(
                "removing %s: a build that did not finish left it (its builder is gone), and torch "
                "would wait on it forever",
                torch_lock,
            )
            torch_lock.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock
