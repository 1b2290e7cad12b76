"""Children that end with the process that started them (kvmesh.common.parent_death), so a
SIGKILLed `kvmesh up` or test run leaves no engine behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvmesh.common.parent_death import ENV, env_for_children
from tests.conftest import ROOT, child_env, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

# A child that follows its parent, reports its pid and whether the variable is still set, sleeps.
CHILD = (
    "import os, sys, time\n"
    "from kvmesh.common.parent_death import follow_parent\n"
    "asked = follow_parent()\n"
    "print(os.getpid(), asked, os.environ.get('KVMESH_PARENT_PID'), flush=True)\n"
    "time.sleep(60)\n"
)
# A parent that starts CHILD with itself as the parent to follow, relays its line, waits.
PARENT = (
    "import subprocess, sys, time\n"
    "from kvmesh.common.parent_death import env_for_children\n"
    "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env_for_children(),"
    " stdout=subprocess.PIPE, text=True)\n"
    "print(p.stdout.readline().strip(), flush=True)\n"
    "time.sleep(60)\n"
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (our grandchild, reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].split()[0] == "Z"


def test_a_child_ends_when_its_parent_is_sigkilled():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, asked, leftover = parent.stdout.readline().split()
        assert asked == "True" and leftover == "None"  # its own children are not held to it
        time.sleep(0.5)
        assert not _gone(int(pid))  # alive while the parent is
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: _gone(int(pid)), 10, msg="the orphaned child to end")
    finally:
        parent.kill()


def test_a_child_whose_parent_died_before_it_asked_ends_at_once():
    env = child_env()
    env[ENV] = "1"  # not its parent: as if the parent had gone and init had adopted it
    child = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, timeout=30
    )
    assert child.returncode == -signal.SIGTERM


def test_without_the_variable_nothing_is_asked():
    env = {k: v for k, v in child_env().items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", CHILD.replace("time.sleep(60)", "")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.split()[1:] == ["False", "None"]
    assert env_for_children({"A": "1"}) == {"A": "1", ENV: str(os.getpid())}
