"""Routing policies as plug-ins: one module per policy, and this registry (name -> class).

The names live in kvmesh/common/policy_names.py, which the router (``--policy``), ``kvmesh up
--policy`` and the ModelDeployment CRD's ``spec.router.policy`` enum read without importing the
router; this registry maps each of those names to its class (tests/router/test_policies.py
checks that the two agree).

To add a policy: a module here with a :class:`RoutingPolicy` subclass (its ``name``, an
``order`` coroutine), one line below, its name in kvmesh/common/policy_names.py, then regenerate
the CRD (``make generate``); docs/router.md lists the policies.
"""

from __future__ import annotations

from kvmesh.common import policy_names
from kvmesh.router.policies.base import PolicySettings, RouteRequest, RoutingPolicy
from kvmesh.router.policies.least_load import LeastLoadPolicy
from kvmesh.router.policies.prefix import PrefixPolicy
from kvmesh.router.policies.round_robin import RoundRobinPolicy
from kvmesh.router.policies.session import SessionPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (PrefixPolicy, LeastLoadPolicy, RoundRobinPolicy, SessionPolicy)
}
NAMES: tuple[str, ...] = policy_names.NAMES
DEFAULT = policy_names.DEFAULT


def create(name: str, settings: PolicySettings | None = None) -> RoutingPolicy:
    """A new instance of the policy registered as `name` (ValueError naming the known ones)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (expected one of {', '.join(NAMES)})")
    return cls(settings)


__all__ = [
    "DEFAULT",
    "NAMES",
    "POLICIES",
    "PolicySettings",
    "RouteRequest",
    "RoutingPolicy",
    "create",
]
