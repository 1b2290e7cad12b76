"""What the node agent does with a container that exited: restart it (and after which back-off), start the next init container, fail the pod, or leave it terminated."""

from __future__ import annotations

RESTART = "restart"  # started again once its back-off is over
NEXT = "next"  # an init container that succeeded: the next one starts (or the app containers)
FAIL_POD = "fail pod"  # an init container that failed under restartPolicy Never: the pod fails
STAY = "stay"  # left terminated (the pod's phase says what that means)


def after_exit(policy: str, exit_code: int, init: bool) -> str:
    """The kubelet's rule for `restartPolicy` (Always, OnFailure, Never) and the exit code (a
    signal's is 128 + its number, a failure like any other non-zero code). An init container
    that failed is restarted under Always as under OnFailure: the pod cannot go on without it."""
    if init:
        if exit_code == 0:
            return NEXT
        return FAIL_POD if policy == "Never" else RESTART
    if policy == "Always" or (policy == "OnFailure" and exit_code != 0):
        return RESTART
    return STAY


def backoff(crashes: int, ran: float, initial: float, cap: float) -> tuple[float, int]:
    """(the delay before the next start, the failed runs in a row counting this one), given the
    runs in a row before it and how long this one ran. As the kubelet: no delay after the first,
    then `initial` doubling up to `cap`; a run longer than twice the cap starts the count over."""
    if ran > 2 * cap:
        crashes = 0
    delay = 0.0 if crashes == 0 else min(initial * 2 ** (crashes - 1), cap)
    return delay, crashes + 1
