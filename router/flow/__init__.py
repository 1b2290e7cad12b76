"""Flow control: priority bands, per-tenant fair share and queueing at the router while every replica is saturated.

The parts, one idea each: the settings and bands (``settings.py``), who is asking
(``identity.py``), the virtual token counters of fair share (``fairness.py``), the bounded
per-band queues (``queue.py``), when the replicas are saturated (``saturation.py``), the
fleet-wide sync of service through Redis (``shared_counters.py``) and the asyncio glue that
holds and releases requests (``controller.py``). See docs/router.md, "Flow control".
"""

from kvmesh.router.flow.controller import FlowControl
from kvmesh.router.flow.settings import DEFAULT_BANDS, Band, FlowSettings, parse_band

__all__ = ["DEFAULT_BANDS", "Band", "FlowControl", "FlowSettings", "parse_band"]
