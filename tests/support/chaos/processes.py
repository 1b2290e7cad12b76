"""Child processes of a loopback mesh (each restartable, its output in a log file) and the polling wait."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


class ChaosError(AssertionError):
    """A scenario could not reach a state it waits for (the message carries the processes' logs)."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KVMESH_API_KEYS", None)
    return env


class Proc:
    """One child process, its output appended to DIR/NAME.log; restartable with the same argv."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.env = env  # the environment on top of child_env()
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Proc:
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**child_env(), **(self.env or {})},
                cwd=self.cwd,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind (the process's sockets are closed by the kernel)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    async def terminate(self, timeout: float) -> int | None:
        """SIGTERM, then wait (the event loop keeps running) up to `timeout`; SIGKILL if still alive."""
        if not self.alive:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.kill()
            return None
        return self.proc.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


async def wait_for(
    cond: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll `cond` (async) until it returns something truthy; ChaosError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await cond()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - a probe that fails is "not yet"
            last = exc
        if time.monotonic() >= deadline:
            raise ChaosError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)
