"""Routing policies as plug-ins: one module per policy, and this registry (name -> class).

The registry is the one list of policy names: the router (``--policy``), ``kvmesh up
--policy``, and the ModelDeployment CRD's ``spec.router.policy`` enum
(kvmesh/operator/crd.py) all read :data:`NAMES`. Importing it is cheap (no aiohttp, Redis,
Prometheus or torch), so the operator and the CLIs read the names without the router's runtime.

To add a policy: a module here with a :class:`RoutingPolicy` subclass (its ``name``, an
``order`` coroutine), one line below, then regenerate the CRD (``python -m
kvmesh.operator.generate``); docs/router.md lists the policies.
"""

from __future__ import annotations

from kvmesh.router.policies.base import PolicySettings, RouteRequest, RoutingPolicy
from kvmesh.router.policies.least_load import LeastLoadPolicy
from kvmesh.router.policies.prefix import PrefixPolicy
from kvmesh.router.policies.round_robin import RoundRobinPolicy
from kvmesh.router.policies.session import SessionPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (PrefixPolicy, LeastLoadPolicy, RoundRobinPolicy, SessionPolicy)}
NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT = PrefixPolicy.name


def create(name: str, settings: PolicySettings | None = None) -> RoutingPolicy:
    """A new instance of the policy registered as `name` (ValueError naming the known ones)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (expected one of {', '.join(NAMES)})")
    return cls(settings)


__all__ = ["DEFAULT", "NAMES", "POLICIES", "PolicySettings", "RouteRequest", "RoutingPolicy", "create"]
