"""`round-robin`: the pods in name order, starting one further at each request (per router).
Reason ``round_robin``."""

from __future__ import annotations

from itertools import count

from kvmesh.router.policies.base import PolicySettings, RouteRequest, RoutingPolicy
from kvmesh.router.scoring import Candidate


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(self, settings: PolicySettings | None = None):
        super().__init__(settings)
        self._next = count()

    async def order(self, req: RouteRequest) -> tuple[list[Candidate], str]:
        cands = sorted(req.candidates, key=lambda c: c.name)
        i = next(self._next) % len(cands)
        return cands[i:] + cands[:i], "round_robin"
