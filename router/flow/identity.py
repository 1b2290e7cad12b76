"""Who is asking: a request's tenant (flow), priority band and deadline, from its API key or its headers, with safe defaults.

A malformed or unknown value is never an error: it gives the default (the default band, the
shared "anonymous" flow, the default deadline). With API keys the tenant is the key (its name
in the key file) and a header may move a request to a lower band than the key's, never a higher one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvmesh.router.auth import KeyInfo
from kvmesh.router.flow.settings import Band, FlowSettings

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"  # GIE's name: the tenant where keys are off
OBJECTIVE_HEADER = (
    "x-gateway-inference-objective"  # GIE's name: a band, or an objective mapped to one
)
DEADLINE_HEADER = (
    "x-kvmesh-deadline-seconds"  # the longest wait at the router (at most the default)
)
ANONYMOUS = "anonymous"  # the flow of requests that name none
_ID_OK = re.compile(r"^[A-Za-z0-9._:@/+=\-]{1,64}$")


@dataclass(frozen=True)
class Identity:
    tenant: str
    band: Band
    weight: float  # the tenant's fair-share weight
    deadline_s: float


def identify(s: FlowSettings, headers: dict[str, str], key: KeyInfo | None) -> Identity:
    """`headers`: lower-cased names (the router's Call.headers)."""
    ceiling = s.band(key.band) if key is not None else None
    if key is not None and ceiling is None:
        ceiling = s.band(s.default_band)
    band = _band(s, headers.get(OBJECTIVE_HEADER), ceiling)
    if key is not None:
        tenant = "key:" + key.name
        weight = key.weight or band.weight
    else:
        raw = (headers.get(FAIRNESS_HEADER) or "").strip()
        tenant = "id:" + raw if _ID_OK.match(raw) else ANONYMOUS
        weight = band.weight
    return Identity(tenant, band, weight, _deadline(s, headers.get(DEADLINE_HEADER)))


def _band(s: FlowSettings, objective: str | None, ceiling: Band | None) -> Band:
    """The header's band (a band name or a mapped objective), else the key's, else the default;
    never above the key's."""
    default = ceiling or s.band(s.default_band)
    name = (objective or "").strip().lower()[:64]
    asked = s.band(s.objectives.get(name, name)) if name else None
    if asked is None:
        return default
    if ceiling is not None and asked.priority > ceiling.priority:
        return ceiling
    return asked


def _deadline(s: FlowSettings, raw: str | None) -> float:
    try:
        value = float(raw) if raw else s.default_deadline
    except ValueError:
        return s.default_deadline
    if not math.isfinite(value) or value <= 0:
        return s.default_deadline
    return min(value, s.default_deadline)
