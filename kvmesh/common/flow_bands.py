"""Flow control's default priority bands, which the router's settings and the operator's CRD defaults share.

Kept apart from the router (router/flow) so that the operator reads them without importing
the router: each is (name, priority, weight, max_queued); a higher priority is dispatched
first and shed last. GIE's names: critical above standard above sheddable.
"""

from __future__ import annotations

DEFAULT_BANDS: tuple[tuple[str, int, float, int], ...] = (
    ("critical", 2, 1.0, 1024),
    ("standard", 1, 1.0, 512),
    ("sheddable", 0, 1.0, 256),
)
DEFAULT_BAND = "standard"
MAX_QUEUED = 1024  # all bands together
