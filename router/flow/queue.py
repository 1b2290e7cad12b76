"""The bounded per-band queues of requests waiting at the router: dispatch order, deadlines, shedding (pure; the caller passes the time).

Dispatch takes the highest band first; inside a band, the tenant with the least service
(fairness.py; on a tie, the one with fewer requests waiting), first come first served inside a
tenant. A band holds at most its
`max_queued`, all bands `max_queued` together. An arrival that finds no room sheds the newest
request of the lowest band below its own; in its own band it displaces only a tenant that
holds more of the queue than it would (a flood makes room for the others, never the reverse);
otherwise it is refused itself.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from kvmesh.router.flow.settings import Band, FlowSettings

QUEUE_FULL = "queue_full"  # no room, and nothing below it to shed
SHED = "shed"  # made room for a request of a higher band
TENANT_SHARE = "tenant_share"  # made room for a tenant holding less of its band's queue
DEADLINE = "deadline"  # waited longer than its deadline


class Ticket:
    """One waiting request. `outcome` is set when it leaves the queue other than by dispatch;
    `go` is the caller's (the controller's future)."""

    __slots__ = ("tenant", "band", "deadline", "enqueued_at", "seq", "outcome", "go")
    _seq = itertools.count()

    def __init__(self, tenant: str, band: Band, enqueued_at: float, deadline: float):
        self.tenant = tenant
        self.band = band
        self.enqueued_at = enqueued_at
        self.deadline = deadline  # absolute, on the caller's clock
        self.seq = next(self._seq)
        self.outcome: str | None = None
        self.go: Any = None


class _BandQueue:
    def __init__(self, band: Band):
        self.band = band
        self.tenants: OrderedDict[str, deque[Ticket]] = OrderedDict()
        self.count = 0

    def add(self, t: Ticket) -> None:
        self.tenants.setdefault(t.tenant, deque()).append(t)
        self.count += 1

    def remove(self, t: Ticket) -> bool:
        q = self.tenants.get(t.tenant)
        if q is None:
            return False
        try:
            q.remove(t)
        except ValueError:
            return False
        self.count -= 1
        if not q:
            del self.tenants[t.tenant]
        return True

    def largest(self) -> str | None:
        """The tenant holding the most of this band's queue (the earliest to arrive on a tie)."""
        return max(self.tenants, key=lambda n: len(self.tenants[n]), default=None)


class FlowQueue:
    def __init__(self, s: FlowSettings):
        self.max_queued = s.max_queued
        self.bands = [_BandQueue(b) for b in s.ordered]  # highest priority first
        self._by_name = {q.band.name: q for q in self.bands}
        self._len = 0
        self._earliest = float("inf")  # no deadline comes before it (a lower bound)

    def __len__(self) -> int:
        return self._len

    def depth(self, band: str) -> int:
        return self._by_name[band].count

    def queued(self, tenant: str) -> int:
        return sum(len(q.tenants.get(tenant, ())) for q in self.bands)

    def waiting_tenants(self, band: str) -> list[str]:
        return list(self._by_name[band].tenants)

    def push(self, t: Ticket) -> list[Ticket]:
        """Queue `t`; returns the tickets shed to make room (their `outcome` set). When there is
        no room for `t` itself, `t.outcome` is QUEUE_FULL and nothing is shed."""
        bq = self._by_name[t.band.name]
        victims: list[Ticket] = []
        if bq.band.max_queued <= 0:
            t.outcome = QUEUE_FULL
            return victims
        if bq.count >= bq.band.max_queued:
            victim = self._displace(bq, t)
            if victim is None:
                t.outcome = QUEUE_FULL
                return victims
            victims.append(victim)
        elif self._len >= self.max_queued:
            victim = self._shed_below(t.band) or self._displace(bq, t)
            if victim is None:
                t.outcome = QUEUE_FULL
                return victims
            victims.append(victim)
        bq.add(t)
        self._len += 1
        self._earliest = min(self._earliest, t.deadline)
        return victims

    def _displace(self, bq: _BandQueue, t: Ticket) -> Ticket | None:
        """The newest request of the band's largest tenant, if it holds more than `t`'s would."""
        big = bq.largest()
        if big is None or big == t.tenant:
            return None
        if len(bq.tenants[big]) <= len(bq.tenants.get(t.tenant, ())) + 1:
            return None
        return self._take(bq, bq.tenants[big][-1], TENANT_SHARE)

    def _shed_below(self, band: Band) -> Ticket | None:
        for bq in reversed(self.bands):  # the lowest band first
            if bq.band.priority >= band.priority:
                return None
            if bq.count:
                return self._take(bq, bq.tenants[bq.largest()][-1], SHED)
        return None

    def _take(self, bq: _BandQueue, t: Ticket, outcome: str) -> Ticket:
        bq.remove(t)
        self._len -= 1
        t.outcome = outcome
        return t

    def pop(self, service: Callable[[str], float]) -> Ticket | None:
        """The next request to dispatch: highest band, least-served tenant (on a tie, the one with
        fewer requests waiting: a tenant lifted as it starts waiting goes before a flood), its
        oldest request."""
        for bq in self.bands:
            if not bq.count:
                continue
            tenant = min(
                bq.tenants,
                key=lambda n: (service(n), len(bq.tenants[n]), bq.tenants[n][0].seq),
            )
            t = bq.tenants[tenant][0]
            bq.remove(t)
            self._len -= 1
            return t
        return None

    def remove(self, t: Ticket) -> bool:
        """Take `t` out (its client left); False if it was no longer queued."""
        if self._by_name[t.band.name].remove(t):
            self._len -= 1
            return True
        return False

    def expire(self, now: float) -> list[Ticket]:
        """The tickets past their deadline, taken out (outcome DEADLINE); the lowest band first.
        The queue is walked only once the earliest deadline has come."""
        if now < self._earliest:
            return []
        out = []
        for bq in reversed(self.bands):
            for q in list(bq.tenants.values()):
                out += [self._take(bq, t, DEADLINE) for t in [t for t in q if t.deadline <= now]]
        self._earliest = min(
            (t.deadline for bq in self.bands for q in bq.tenants.values() for t in q),
            default=float("inf"),
        )
        return out

    def lowest_service(self, band: str, service: Callable[[str], float]) -> float | None:
        """The least service among the tenants waiting in `band` (VTC's lift for a newcomer)."""
        tenants = self._by_name[band].tenants
        return min((service(n) for n in tenants), default=None)
