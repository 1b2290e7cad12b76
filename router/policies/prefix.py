"""`prefix` (the default): contract 4's score, the prompt's cached prefix against the pods' load.

score = w_prefix * saved/total - w_kv * kv_usage - w_queue * queue_share (router/scoring.py),
hot pods last. Reasons: ``prefix_match`` (the best pod holds a prefix in its KV cache),
``tier_match`` (the best pod's saving comes from its host tier or the shared tier only), ``no_match``,
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
                    c.matched_blocks, c.cpu_blocks, c.shared_blocks = _tiers(matched.get(c.name))
        ordered = rank(cands, len(keys), s.weights, req.tie, s.hot_ratio, s.hot_min)
        if reason is None:
            best = max(ordered, key=lambda c: c.score)
            if best.hot and best is not ordered[0]:
                reason = "hotspot_guard"
            elif not keys:
                reason = "short_prompt"
            elif ordered[0].matched_blocks:
                reason = "prefix_match"
            elif ordered[0].cached_blocks:
                reason = "tier_match"
            else:
                reason = "no_match"
        return ordered, reason


def _tiers(found: tuple[int, int, int] | int | None) -> tuple[int, int, int]:
    """A pod's match as (g, c, s): a bare count is a match in the KV cache only."""
    if found is None:
        return 0, 0, 0
    if isinstance(found, int):
        return found, 0, 0
    g, c, s = found
    return int(g), int(c), int(s)
