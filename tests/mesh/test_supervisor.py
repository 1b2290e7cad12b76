"""The supervisor of `kvmesh up` (kvmesh/mesh/supervisor.py): restart with a capped exponential
back-off, reset after a stable run, give up after too many restarts in a row, never restart a
child that was stopped on purpose. Real (short) processes; the clock is passed in."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from kvmesh.mesh.supervisor import GAVE_UP, RESTARTED, Child, RestartPolicy, exit_status


def _exits(code: int, after: float = 0.0) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({after}); sys.exit({code})"]


def _exited(child: Child) -> None:
    child.proc.wait(30)


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff=0.5, backoff_max=4.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_exit_status_names_the_signal():
    assert exit_status(0) == "exit code 0"
    assert exit_status(3) == "exit code 3"
    assert exit_status(-9) == "killed by SIGKILL"
    assert exit_status(-15) == "killed by SIGTERM"


def test_a_crashing_child_is_restarted_after_a_growing_backoff_then_given_up(capsys):
    child = Child(
        "worker",
        _exits(3),
        policy=RestartPolicy(backoff=1.0, backoff_max=2.0, stable_after=60, max_restarts=3),
    ).start()
    try:
        delays = []
        for _ in range(3):
            _exited(child)
            t = child.started_at + 0.1  # it ran 0.1 s: not a stable run
            assert child.check(t) is None  # the exit is noticed, the restart scheduled
            delay = child.restart_at - t
            delays.append(round(delay, 3))
            assert child.check(t + delay - 0.01) is None  # still in its back-off
            first_pid = child.pid
            assert child.check(t + delay) == RESTARTED
            assert child.pid != first_pid
        assert delays == [1.0, 2.0, 2.0]
        assert child.restarts == 3
        _exited(child)
        assert child.check(child.started_at + 0.1) == GAVE_UP
        assert child.check(child.started_at + 100) is None  # and stays given up
    finally:
        child.terminate()
        child.wait(5)
    out = capsys.readouterr().out
    assert (
        "[up] worker exited (exit code 3) after 0.1s; restarting it in 1s (restart 1 in a row)"
        in out
    )
    assert "restarting it in 2s (restart 2 in a row)" in out
    assert "restarting it in 2s (restart 3 in a row)" in out
    assert "restarted 3 times in a row: giving up on it" in out


def test_a_stable_run_starts_the_backoff_over(capsys):
    child = Child(
        "worker",
        _exits(1),
        policy=RestartPolicy(backoff=1.0, backoff_max=30, stable_after=5, max_restarts=2),
    ).start()
    try:
        for _ in range(4):  # more exits than max_restarts, each after a stable run: never given up
            _exited(child)
            t = child.started_at + 6
            assert child.check(t) is None
            assert child.restart_at - t == 1.0  # the first delay every time
            assert child.check(t + 1.0) == RESTARTED
        assert child.in_a_row == 1 and child.restarts == 4 and not child.gave_up
    finally:
        child.terminate()
        child.wait(5)


def test_a_child_stopped_during_its_backoff_is_not_restarted():
    child = Child("worker", _exits(0), policy=RestartPolicy(backoff=30)).start()
    _exited(child)
    t = child.started_at + 0.1
    assert child.check(t) is None and child.restart_at is not None
    child.terminate()  # e.g. Ctrl-C while it waits
    assert child.check(t + 31) is None
    assert child.restarts == 0 and child.restart_at is None
    child.wait(1)  # returns at once: nothing runs


def test_a_live_child_is_left_alone():
    child = Child("worker", _exits(0, after=30)).start()
    try:
        assert child.check() is None
        assert child.alive() and child.restart_at is None
    finally:
        child.terminate()
        child.wait(10)
    assert not child.alive()


# -- the decision alone: RestartPolicy.after_exit, every case -------------------------------------
@pytest.mark.parametrize("max_restarts", [0, 1, 3])
@pytest.mark.parametrize("in_a_row", range(6))
@pytest.mark.parametrize("ran", [0.0, 4.99, 5.0, 50.0])
def test_after_an_exit_the_restart_number_or_giving_up(max_restarts, in_a_row, ran):
    policy = RestartPolicy(
        backoff=1.0, backoff_max=8.0, stable_after=5.0, max_restarts=max_restarts
    )
    stable = ran >= 5.0  # a run of stable_after or more starts the count over
    before = 0 if stable else in_a_row
    if max_restarts and before >= max_restarts:
        assert policy.after_exit(in_a_row, ran) is None
    else:
        assert policy.after_exit(in_a_row, ran) == before + 1


def test_a_crash_loop_is_restarted_exactly_max_restarts_times_with_these_delays():
    policy = RestartPolicy(backoff=0.5, backoff_max=3.0, stable_after=60, max_restarts=5)
    in_a_row, delays = 0, []
    while (attempt := policy.after_exit(in_a_row, ran=0.1)) is not None:
        in_a_row = attempt
        delays.append(policy.delay(attempt))
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0] and in_a_row == 5
    # never given up without a limit; a stable run in between starts over at the first delay
    unlimited = RestartPolicy(max_restarts=0)
    assert unlimited.after_exit(10_000, ran=0.0) == 10_001
    assert policy.after_exit(5, ran=60.0) == 1 and policy.delay(1) == 0.5


class _Exited:
    """A finished process as Popen reports it (no process is started)."""

    pid = 4242

    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


@pytest.mark.parametrize("code", [0, 1, -9, -15])
def test_every_exit_is_restarted_whatever_its_status(code, monkeypatch):
    """`kvmesh up` keeps its children running: a clean exit, an error and a signal alike."""
    child = Child("worker", ["true"], policy=RestartPolicy(backoff=2.0, max_restarts=1))

    def start():  # Child.start's bookkeeping, a process that has exited already
        child.proc, child.restart_at = _Exited(code), None
        return child

    monkeypatch.setattr(child, "start", start)
    child.start()
    child.started_at = 100.0
    assert child.check(100.5) is None and child.restart_at == 102.5 and child.in_a_row == 1
    assert child.check(102.49) is None and child.restarts == 0
    assert child.check(102.5) == RESTARTED and child.restarts == 1 and child.restart_at is None
    child.started_at = 103.0
    assert child.check(103.5) == GAVE_UP and child.gave_up and child.restarts == 1
    assert child.check(1000.0) is None and child.restarts == 1


def test_an_unknown_signal_is_named_by_its_number():
    assert exit_status(-200) == "killed by signal 200"


def test_a_new_child_before_its_start():
    child = Child("worker", ["true"], env={"A": "1"})
    assert (child.essential, child.stopping, child.gave_up) == (False, False, False)
    assert (child.proc, child.restart_at, child.started_at, child.env) == (
        None,
        None,
        0.0,
        {"A": "1"},
    )
    assert child.check(0.0) is None and child.pid is None  # never started: nothing to do
    child.wait(1)  # returns at once


def test_the_restart_lines_and_the_clock_read_when_none_is_given(capsys, monkeypatch):
    child = Child("worker", ["true"], policy=RestartPolicy(backoff=0.0, max_restarts=1))

    def start():
        child.proc, child.restart_at = _Exited(2), None
        return child

    monkeypatch.setattr(child, "start", start)
    child.start()
    child.started_at = 0.0  # long ago on the monotonic clock: a stable run
    assert child.check() is None and child.restart_at is not None  # now: time.monotonic()
    assert child.check() == RESTARTED
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[up] worker exited (exit code 2) after ")
    assert out[1] == "[up] worker restarted (pid 4242)"
    child.started_at = 1e12  # ran no time at all: the second restart in a row is past the limit
    assert child.check(1e12 + 0.1) == GAVE_UP
    assert capsys.readouterr().out == (
        "[up] worker exited (exit code 2) after 0.1s; it was restarted 1 times in a row: "
        "giving up on it\n"
    )


CHILD = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('env', os.environ.get('KVMESH_TEST_VAR'))\n"
    "print('stdin', repr(sys.stdin.read()))\n"
    "print('own session', os.getsid(0) == os.getpid())\n"
    "print('trailing spaces  ')\n"
    "print('ends with X')\n"
    "sys.stdout.flush()\n"
    "print('to stderr', file=sys.stderr, flush=True)\n"
    "os.write(1, b'bytes \\xff\\n')\n"
    "time.sleep(30)\n"
)


def test_a_child_runs_in_its_own_session_its_output_prefixed_and_is_killed_if_it_will_not_stop(
    capsys,
):
    env = {"KVMESH_TEST_VAR": "seven", "PATH": "/usr/bin:/bin"}
    # our stdin an open pipe: a child that inherited it would wait on it for ever
    r, w = os.pipe()
    saved = os.dup(0)
    os.dup2(r, 0)
    try:
        child = Child("worker", [sys.executable, "-c", CHILD], env=env)
        child.stopping = True  # as after a terminate(): a new start clears it
        child.start()
    finally:
        os.dup2(saved, 0)
        for fd in (r, saved):
            os.close(fd)
    deadline = time.monotonic() + 20
    wanted = [
        "[worker] env seven",
        "[worker] stdin ''",
        "[worker] own session True",
        "[worker] trailing spaces  ",
        "[worker] ends with X",
        "[worker] to stderr",
        "[worker] bytes \ufffd",
    ]
    lines: list[str] = []
    while time.monotonic() < deadline and lines[-1:] != wanted[-1:]:
        lines += capsys.readouterr().out.splitlines()
        time.sleep(0.05)
    os.close(w)
    assert lines == wanted
    assert not child.stopping
    pumps = [t for t in threading.enumerate() if t.name.endswith("(_pump)")]
    assert pumps and all(t.daemon for t in pumps)  # never holds `kvmesh up` from exiting
    child.terminate()  # it ignores SIGTERM
    t0 = time.monotonic()
    child.wait(1.0)
    assert time.monotonic() - t0 < 6 and not child.alive() and child.proc.returncode == -9
    assert capsys.readouterr().out == "[up] worker did not stop in 1s; killing it\n"
