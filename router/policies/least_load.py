"""`least-load`: contract 4's score without the prefix term (KV usage and queue share only),
hot pods last. Reason ``least_load``."""

from __future__ import annotations

from kvmesh.router.policies.base import RouteRequest, RoutingPolicy
from kvmesh.router.scoring import Candidate, Weights, rank


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"

    async def order(self, req: RouteRequest) -> tuple[list[Candidate], str]:
        s = self.settings
        weights = Weights(0, s.weights.kv, s.weights.queue, lora=0)
        return rank(req.candidates, 0, weights, req.tie, s.hot_ratio, s.hot_min), "least_load"
