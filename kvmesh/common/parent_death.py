"""A child process that ends when the process that started it dies.

A supervisor killed with SIGKILL (`kvmesh up` under the OOM killer, a test run killed) cannot stop
its children: they would run on as orphans, holding their memory and ports (two engines of the
built-in model hold ~10 GB). A parent that wants a child to follow it starts it through
``python -m kvmesh.common.parent_death -- COMMAND ARGS...`` (``wrap``) with its own pid in the
environment as ``KVMESH_PARENT_PID`` (``env_for_children``). The wrapper asks the kernel (Linux
``PR_SET_PDEATHSIG``) for SIGTERM, the signal of an orderly shutdown, when that parent exits (at
once if it is gone already), then replaces itself with the command, any program (a kvmesh
process, Redis, vLLM): the request survives ``execve``. The variable is removed first, so the
command's own children (the engine's core process) are not held to a pid that is not their parent.

The kernel sends the signal when the *thread* that started the child exits, so a parent sets the
variable only for children it starts from a thread that lives as long as it does (its main one).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "KVMESH_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def env_for_children(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) plus this process as the parent to follow."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(os.getpid())
    return out


def wrap(argv: list[str]) -> list[str]:
    """``argv`` started so that it follows its parent (with env_for_children's environment)."""
    return [sys.executable, "-m", "kvmesh.common.parent_death", "--", *argv]


def follow_parent() -> bool:
    """If the environment names a parent: SIGTERM to this process when it dies (and now, if it
    has died already). Returns whether the kernel was asked to."""
    raw = os.environ.pop(ENV, None)
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        parent = int(raw)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (ValueError, OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return True


if __name__ == "__main__":
    command = sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:]
    if not command:
        sys.exit("usage: python -m kvmesh.common.parent_death -- COMMAND [ARGS...]")
    follow_parent()
    os.execvp(command[0], command)
