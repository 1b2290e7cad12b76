"""`session`: affinity on the session header (``--session-header``, X-Session-Id): a session
goes to the pod that rendezvous hashing picks for its id (every router picks the same), unless
that pod is hot; hot pods go last. Reason ``session``. A request without the header is routed
by the `prefix` policy."""

from __future__ import annotations

from kvmesh.router.policies.base import PolicySettings, RouteRequest, RoutingPolicy
from kvmesh.router.policies.prefix import PrefixPolicy
from kvmesh.router.scoring import Candidate, Weights, rank, rendezvous


class SessionPolicy(RoutingPolicy):
    name = "session"

    def __init__(self, settings: PolicySettings | None = None):
        super().__init__(settings)
        self.fallback = PrefixPolicy(self.settings)

    async def order(self, req: RouteRequest) -> tuple[list[Candidate], str]:
        s = self.settings
        sid = req.headers.get(s.session_header.lower())
        if not sid:
            return await self.fallback.order(req)
        cands = req.candidates
        rank(cands, 0, Weights(0, 0, 0, 0), req.tie, s.hot_ratio, s.hot_min)  # marks the hot pods
        sid_b = sid.encode()
        cands.sort(key=lambda c: (c.hot, -rendezvous(sid_b, c.name)))
        return cands, "session"
