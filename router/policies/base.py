"""What a routing policy is: given the routable pods of one request, an order to try them in.

A policy sees a :class:`RouteRequest` (the candidates with their load, the prompt's block keys,
the request headers, a tie-break key and a way to ask Redis for prefix matches) and returns
the candidates best first with a *reason* (the ``reason`` label of
``kvmesh_router_decisions_total`` and the access log). The router tries them in that order
(the next one only on a "not me" answer, see docs/router.md). Policies import nothing
heavier than :mod:`kvmesh.router.scoring`: the registry's names are read by the operator
(the CRD's enum) and by the CLIs without the router's runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.router.scoring import Candidate, Weights

# per pod name its matched leading blocks: (g, c, s) by tier (router/prefix_match.py), or an int
# (g: the KV cache only); None when Redis cannot say (the policy goes by load)
Matcher = Callable[[], Awaitable["dict[str, tuple[int, int, int] | int] | None"]]


@dataclass
class PolicySettings:
    """The router settings a policy may read (RouterConfig's, by the same names)."""

    weights: Weights = field(default_factory=Weights)
    hot_ratio: float = 2.0
    hot_min: int = 2
    session_header: str = "x-session-id"


@dataclass
class RouteRequest:
    """One request as a policy sees it."""

    candidates: list[
        Candidate
    ]  # routable pods; load = max(heartbeat load, requests in flight here)
    keys: list[
        int
    ]  # the prompt's block keys (contract 1); empty: too short, or it scores its prompt
    headers: dict[str, str]  # request headers, names lower-cased
    tie: bytes  # tie-break key: the last block key (or the body's start), the same on every router
    match: Matcher  # one Redis round trip: how many leading blocks each pod holds, per tier


class RoutingPolicy:
    """A routing policy: `name` is its registry name (``--policy``, the CRD's ``router.policy``)."""

    name: ClassVar[str]

    def __init__(self, settings: PolicySettings | None = None):
        self.settings = settings or PolicySettings()

    async def order(self, req: RouteRequest) -> tuple[list[Candidate], str]:
        """The candidates best first, and the reason for the choice."""
        raise NotImplementedError
