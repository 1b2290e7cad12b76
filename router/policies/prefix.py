"""`prefix` (the default): contract 4's score, the prompt's cached prefix against the pods' load.

score = w_prefix * matched/total - w_kv * kv_usage - w_queue * queue_share (router/scoring.py),
hot pods last. Reasons: ``prefix_match`` (the best pod holds a prefix), ``no_match``,
``short_prompt`` (no full block), ``hotspot_guard`` (the best score is a hot pod, skipped),
``redis_unavailable`` (no block sets: by load only).
"""

from __future__ import annotations

from kvmesh.router.policies.base import RouteRequest, RoutingPolicy
from kvmesh.router.scoring import Candidate, rank


class PrefixPolicy(RoutingPolicy):
    name = "prefix"

    async def order(self, req: RouteRequest) -> tuple[list[Candidate], str]:
        s = self.settings
        cands, keys = req.candidates, req.keys
        reason = None
        if keys:
            matched = await req.match()
            if matched is None:
                reason = "redis_unavailable"
            else:
                for c in cands:
                    c.matched_blocks = matched.get(c.name, 0)
        ordered = rank(cands, len(keys), s.weights, req.tie, s.hot_ratio, s.hot_min)
        if reason is None:
            best = max(ordered, key=lambda c: c.score)
            if best.hot and best is not ordered[0]:
                reason = "hotspot_guard"
            elif not keys:
                reason = "short_prompt"
            elif ordered[0].matched_blocks:
                reason = "prefix_match"
            else:
                reason = "no_match"
        return ordered, reason
