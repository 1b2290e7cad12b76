"""The node agent's restart decisions (kvmesh_testing.node.restarts), every case: restartPolicy
Always / OnFailure / Never x an exit code of 0, an error, a signal's x an init or an app
container; and the back-off (none after the first failure, then doubling to the cap, starting
over after a long run)."""

from __future__ import annotations

import pytest

from kvmesh_testing.node.restarts import FAIL_POD, NEXT, RESTART, STAY, after_exit, backoff

# exit codes: success, an error, SIGKILL's (128 + 9: OOM kill, liveness kill past its grace),
# SIGTERM's (128 + 15)
CODES = [0, 1, 137, 143]

# (policy, exit code) -> what happens to an app container / an init container
APP = {
    "Always": {0: RESTART, 1: RESTART, 137: RESTART, 143: RESTART},
    "OnFailure": {0: STAY, 1: RESTART, 137: RESTART, 143: RESTART},
    "Never": {0: STAY, 1: STAY, 137: STAY, 143: STAY},
}
INIT = {
    "Always": {0: NEXT, 1: RESTART, 137: RESTART, 143: RESTART},
    "OnFailure": {0: NEXT, 1: RESTART, 137: RESTART, 143: RESTART},
    "Never": {0: NEXT, 1: FAIL_POD, 137: FAIL_POD, 143: FAIL_POD},
}


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("policy", ["Always", "OnFailure", "Never"])
def test_what_follows_an_exit(policy, code):
    assert after_exit(policy, code, init=False) == APP[policy][code]
    assert after_exit(policy, code, init=True) == INIT[policy][code]


def test_the_backoff_of_a_crash_loop():
    crashes, delays = 0, []
    for _ in range(8):
        delay, crashes = backoff(crashes, ran=1.0, initial=10, cap=300)
        delays.append(delay)
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300] and crashes == 8


@pytest.mark.parametrize(
    "crashes,ran,delay,after",
    [
        (0, 0.0, 0, 1),  # the first failure: restarted at once
        (1, 0.0, 10, 2),
        (3, 600.0, 40, 4),  # ran exactly twice the cap: not long enough to start over
        (3, 600.1, 0, 1),  # longer: the count starts over
        (7, 10_000.0, 0, 1),
        (12, 1.0, 300, 13),  # capped however many in a row
    ],
)
def test_the_backoff_at_its_edges(crashes, ran, delay, after):
    assert backoff(crashes, ran, initial=10, cap=300) == (delay, after)
