"""The order in which waiting requests are offered what a step's token budget leaves: fcfs, priority or sjf.

The scheduler gives running requests their tokens first (decodes, then the next chunk of each
started prefill, in admission order), so a started prefill always finishes before a new one
starts; this module only orders the requests not yet admitted.

- ``fcfs``: arrival order (a preempted request at the front), as vLLM's default.
- ``priority``: vLLM's ``--scheduling-policy priority``: the request's ``priority`` (lower
  first), then arrival.
- ``sjf``: shortest remaining prompt first, counted after prefix-cache hits. With long prompts
  at high concurrency every first token waits behind the prefills ahead of it; serving the
  shortest first minimises the mean (and median) of those waits, as shortest-job-first does for
  any queue. A preempted request keeps its place at the front (it had started).

Aging (sjf): a request is *passed over* each time a request that arrived after it is admitted
while it waits; once passed over ``max_skips`` times it goes first, in arrival order, ahead of
every shorter prompt. A count rather than a clock bound: it is deterministic (the same order on a
loaded or a quiet machine, so tests and outputs do not depend on timing), it needs no tuning to
the step time of a model or device, and it bounds a long prompt's extra wait in work rather than
in seconds: at most ``max_skips`` prompts go before it that FCFS would have put after it.

Ranking looks at the first ``SJF_WINDOW`` waiting requests in arrival order (the rest follow in
arrival order), as SGLang falls back to FCFS for long queues: the per-step cost stays bounded
when thousands of requests wait (an offline batch), where admission order barely matters.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.engine.request import Request, RequestStatus

POLICIES = ("fcfs", "priority", "sjf")
DEFAULT_MAX_SKIPS = 8
SJF_WINDOW = 256


class PrefillOrder:
    """One scheduler's waiting-queue policy: the admission order, and sjf's aging counts."""

    def __init__(self, policy: str = "fcfs", max_skips: int = DEFAULT_MAX_SKIPS):
        if policy not in POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}"
            )
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips}")
        self.policy = policy
        self.max_skips = max_skips

    def order(self, waiting: Sequence[Request], kv) -> list[Request]:
        """The waiting requests (in arrival order, preempted ones first) in admission order."""
        if self.policy == "fcfs":
            return list(waiting)
        if self.policy == "priority":
            return sorted(waiting, key=lambda r: r.priority)  # stable: arrival breaks ties
        queue = list(waiting)
        window = enumerate(queue[:SJF_WINDOW])
        ranked = sorted(window, key=lambda item: self._sjf_key(item[1], item[0], kv))
        return [r for _, r in ranked] + queue[SJF_WINDOW:]

    def _sjf_key(self, request: Request, position: int, kv) -> tuple[int, int, int]:
        if request.status is RequestStatus.PREEMPTED:
            return (0, 0, position)  # started before: back first, in place
        if request.prefill_skips >= self.max_skips:
            return (1, 0, position)  # aged: first among new ones, in arrival order
        return (2, request.num_tokens - kv.peek_cached_tokens(request), position)

    def passed_over(self, earlier: Sequence[Request]) -> bool:
        """A request was admitted past these (the ones still waiting that arrived before it):
        count it. Returns whether one of them reached the aging bound just now (the order changes)."""
        if self.policy != "sjf":
            return False
        aged = False
        for request in earlier[:SJF_WINDOW]:
            request.prefill_skips += 1
            aged |= request.prefill_skips == self.max_skips
        return aged


def check_priority(priority: int, policy: str) -> None:
    """A request's ``priority`` means something under the priority policy only: elsewhere a
    non-zero one is refused (as vLLM's), rather than silently ignored."""
    from kvmesh.engine.sampling_params import InvalidParameter

    if priority and policy != "priority":
        raise InvalidParameter(
            "priority",
            f"got priority {priority} but priority scheduling is not enabled "
            "(--scheduling-policy priority)",
        )
