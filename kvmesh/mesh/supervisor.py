"""A child process of `kvmesh up`, kept running: whenever it exits it is started again (same
command line, so the same ports), after a back-off that doubles with each restart in a row up
to a cap and starts over once the child has run for a stable period. Redis, the router, the
engines and the sidecars are all supervised by this one class; `Mesh.supervise_once` calls
`check()` on each of them a few times a second.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from kvmesh.common.parent_death import env_for_children, wrap

_print_lock = threading.Lock()


def say(name: str, line: str) -> None:
    """One line of the mesh's output, prefixed with who said it."""
    with _print_lock:
        sys.stdout.write(f"[{name}] {line}\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float = 0.5  # the delay before the first restart in a row
    backoff_max: float = 30.0  # the cap of the doubling delay
    stable_after: float = 60.0  # a run at least this long starts the back-off (and the count) over
    max_restarts: int = 5  # restarts in a row before giving up on the child; 0: never give up

    def delay(self, attempt: int) -> float:
        """The back-off before restart number `attempt` (1, 2, ...) of a run of crashes."""
        return min(self.backoff_max, self.backoff * 2 ** (attempt - 1))

    def after_exit(self, in_a_row: int, ran: float) -> int | None:
        """A child exited after running `ran` seconds, restarted `in_a_row` times in a row
        before: the number in a row of the restart it gets now, or None (give up on it)."""
        if ran >= self.stable_after:
            in_a_row = 0
        if self.max_restarts and in_a_row >= self.max_restarts:
            return None
        return in_a_row + 1


# What Child.check() saw happen.
RESTARTED = "restarted"
GAVE_UP = "gave up"


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Child:
    """One supervised process; its output is printed line by line, prefixed with its name."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        policy: RestartPolicy = RestartPolicy(),
        essential: bool = False,
        cwd: str | None = None,
    ):
        self.name = name
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.policy = policy
        self.essential = (
            essential  # the mesh cannot serve without it (giving up on it stops the mesh)
        )
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0  # monotonic
        self.restarts = 0  # in all
        self.in_a_row = 0  # restarts since the last stable run
        self.restart_at: float | None = None  # monotonic; set while it waits out its back-off
        self.stopping = False  # terminated on purpose: not restarted
        self.gave_up = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> Child:
        self.stopping = False
        self.restart_at = None
        self.proc = subprocess.Popen(
            wrap(self.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Every child ends with the mesh even if it is SIGKILLed (parent_death.py's exec
            # wrapper); the mesh starts every child from its main thread.
            env=env_for_children(self.env),
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self.started_at = time.monotonic()
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        return self

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            say(self.name, line.rstrip("\n"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self, now: float | None = None) -> str | None:
        """One supervision step: notice an exit and schedule the restart (logged with the exit
        status and the back-off), or start it once the back-off is over. Returns RESTARTED,
        GAVE_UP (it kept crashing: no more restarts) or None."""
        if self.stopping or self.gave_up or self.proc is None:
            return None
        now = time.monotonic() if now is None else now
        if self.restart_at is None:
            if self.proc.poll() is None:
                return None
            ran = now - self.started_at
            status = exit_status(self.proc.returncode)
            attempt = self.policy.after_exit(self.in_a_row, ran)
            if attempt is None:
                self.gave_up = True
                say(
                    "up",
                    f"{self.name} exited ({status}) after {ran:.1f}s; it was restarted {self.in_a_row} "
                    f"times in a row: giving up on it",
                )
                return GAVE_UP
            self.in_a_row = attempt
            delay = self.policy.delay(attempt)
            self.restart_at = now + delay
            say(
                "up",
                f"{self.name} exited ({status}) after {ran:.1f}s; restarting it in {delay:g}s "
                f"(restart {self.in_a_row} in a row)",
            )
            return None
        if now < self.restart_at:
            return None
        self.restarts += 1
        self.start()
        say("up", f"{self.name} restarted (pid {self.proc.pid})")
        return RESTARTED

    def terminate(self) -> None:
        """SIGTERM (it drains or cleans up as it does under Kubernetes); never restarted after this."""
        self.stopping = True
        self.restart_at = None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            say("up", f"{self.name} did not stop in {timeout:.0f}s; killing it")
            self.proc.kill()
            self.proc.wait()
