"""The routing policies' names, which the router's registry, `kvmesh up` and the operator's CRD enum share.

Kept apart from the policies themselves (router/policies) so that the operator and the mesh
CLI read the names without importing the router; router/policies registers one class per name
here and tests/router/test_policies.py checks the two lists agree.
"""

from __future__ import annotations

NAMES: tuple[str, ...] = ("prefix", "least-load", "round-robin", "session")
DEFAULT = "prefix"
