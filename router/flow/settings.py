"""Flow control's settings: the priority bands (name, priority, weight, queue limit) and the knobs of queueing and fairness."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvmesh.common import flow_bands

_NAME_OK = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


@dataclass(frozen=True)
class Band:
    """A priority band: a higher `priority` is dispatched first and shed last; `weight` is the
    fair-share weight of a tenant in it (a key's own weight overrides); at most `max_queued`
    requests wait in it."""

    name: str
    priority: int
    weight: float = 1.0
    max_queued: int = 256


DEFAULT_BANDS = tuple(Band(*b) for b in flow_bands.DEFAULT_BANDS)


def parse_band(text: str) -> Band:
    """`NAME:PRIORITY[:WEIGHT[:MAX_QUEUED]]` (ValueError with the reason otherwise)."""
    parts = text.strip().split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"band {text!r}: expected NAME:PRIORITY[:WEIGHT[:MAX_QUEUED]]")
    name = parts[0].strip().lower()
    if not _NAME_OK.match(name):
        raise ValueError(f"band name {name!r}: lower-case letters, digits and '-', at most 32")
    try:
        priority = int(parts[1])
        weight = float(parts[2]) if len(parts) > 2 and parts[2] else 1.0
        max_queued = int(parts[3]) if len(parts) > 3 and parts[3] else 256
    except ValueError:
        raise ValueError(
            f"band {text!r}: priority and queue limit are integers, weight a number"
        ) from None
    if not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"band {name!r}: weight must be a positive number")
    if max_queued < 0:
        raise ValueError(f"band {name!r}: the queue limit must be >= 0")
    return Band(name, priority, weight, max_queued)


@dataclass
class FlowSettings:
    """`kvmesh router --flow-*` (router/cli.py); docs/router.md says what each one does."""

    enabled: bool = False
    bands: tuple[Band, ...] = DEFAULT_BANDS
    default_band: str = flow_bands.DEFAULT_BAND
    max_queued: int = flow_bands.MAX_QUEUED  # all bands together
    default_deadline: float = 60.0  # seconds a request may wait at the router
    kv_threshold: float = 0.8  # a replica at or above this KV usage is saturated
    queue_threshold: int = 5  # ... or with this many requests waiting in its engine
    pod_max_inflight: int = 0  # ... or with this many of this router's requests on it (0: off)
    max_tenants: int = 1024  # tenants tracked; more fold into one "other" flow
    prompt_weight: float = 1.0  # virtual tokens per prompt token
    output_weight: float = 2.0  # virtual tokens per output token
    half_life: float = 60.0  # seconds for a tenant's received service to count half
    # virtual tokens below the least-served waiting tenant a tenant that starts asking is lifted
    # to (VTC's lift less this): its first requests go before a flood's, by at most this much
    newcomer_credit: float = 512.0
    sync_interval: float = 1.0  # seconds between syncs of service with the other routers
    objectives: dict[str, str] = field(default_factory=dict)  # objective header value -> band

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        names = [b.name for b in self.bands]
        if not names:
            raise ValueError("at least one band is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"band names repeat: {names}")
        if len({b.priority for b in self.bands}) != len(names):
            raise ValueError("two bands have the same priority")
        if self.default_band not in names:
            raise ValueError(f"the default band {self.default_band!r} is not one of {names}")
        unknown = sorted(set(self.objectives.values()) - set(names))
        if unknown:
            raise ValueError(f"objectives map to unknown bands: {unknown}")
        for what, value in (
            ("default deadline", self.default_deadline),
            ("half-life", self.half_life),
            ("sync interval", self.sync_interval),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"the {what} must be a positive number of seconds")
        if not (self.newcomer_credit >= 0 and math.isfinite(self.newcomer_credit)):
            raise ValueError("the newcomer credit must be a number of virtual tokens >= 0")
        if self.max_queued < 0 or self.max_tenants < 1:
            raise ValueError("the queue limit must be >= 0 and the tenant table >= 1")

    def band(self, name: str | None) -> Band | None:
        for b in self.bands:
            if b.name == name:
                return b
        return None

    @property
    def ordered(self) -> tuple[Band, ...]:
        """Highest priority first."""
        return tuple(sorted(self.bands, key=lambda b: -b.priority))
