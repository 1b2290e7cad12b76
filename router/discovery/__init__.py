"""Which pods the router may use (DESIGN.md contract 3, "Trust").

Where a pod is reachable comes from the platform, never from Redis. The router knows its
pods from one or more *endpoint sources*:

* ``--k8s-service``: the ready endpoints of the engine Service's EndpointSlices (list, then
  watch, with the pod's service account). A pod is named by its ``targetRef`` (the Pod name,
  which is the sidecar's ``--pod-name``); its URL is the endpoint address and the slice's
  ``http`` port.
* ``--static-backends``: a fixed list of ``URL`` or ``NAME=URL``.
* ``--backends-file``: ``NAME=URL`` lines that the router re-reads when the file changes
  (``kvmesh up``'s supervisor writes it as it adds and removes replicas).

Redis heartbeats only add load, readiness (``ready``/``draining``) and a block set to a pod
the router already knows. A heartbeat is matched to a known pod by its name (and must then
name the same URL), or, for an unnamed static backend, by its URL. The router always sends
traffic to the URL from the platform. Any other heartbeat (an unknown pod, a URL that does
not match) is ignored and counted (``kvmesh_router_ignored_heartbeats_total{reason}``), so
whoever can write Redis can at worst skew the scores of known pods, never redirect a request.

Bounded work: whatever a Redis writer adds, a refresh runs one page of the pods set
(``SWEEP_PAGE`` names, SSCAN, resuming where the last refresh stopped), one command for that
page's heartbeat URLs (``POD_PAGE_LUA``) and one pipelined read of the known pods' heartbeats by
name. A name on the page is judged by its heartbeat's URL alone, before anything else of it is
read: an orphan (no heartbeat) has its block set and membership deleted by that same command;
the URL of an unnamed static backend makes the name that backend's heartbeat (read by name
from then on; the smallest such name wins); anything else is ignored and counted. A pile of
junk names is worked down a page per refresh and never delays the known pods' heartbeats, so
Redis is called unreachable only when these few commands fail. An unnamed static backend
may wait up to a pass over the set for its heartbeat to be found (routed by load meanwhile).

Routability:
* Redis answering: a *named* pod (Kubernetes, ``NAME=URL``) needs a live heartbeat in state
  ``ready`` (it has a sidecar, which only heart-beats once its engine is ready); an unnamed
  static backend without a heartbeat is routed to by load.
* Redis unreachable: the last heartbeats are used for ``--redis-stale-after`` seconds (10 s,
  the heartbeat TTL); after that the view expires and every known pod is routed to by load
  only (in-flight counts), until Redis answers again. ``/ready`` and
  ``kvmesh_router_discovery_fallback`` say so.

The package: the endpoint sources (``sources.py``: static, file; ``slice_watch.py``:
EndpointSlices), the pure join of endpoints and heartbeats into pods (``join.py``), the
metrics and the ignored heartbeats of the sweep (``metrics.py``), and the loop that reads
Redis and publishes the result (``refresh.py``: ``Discovery``).
"""

from kvmesh.router.discovery.join import FALLBACK_REDIS, Pod
from kvmesh.router.discovery.refresh import SWEEP_PAGE, Discovery
from kvmesh.router.discovery.slice_watch import EndpointSlices
from kvmesh.router.discovery.sources import (
    Endpoint,
    FileEndpoints,
    StaticEndpoints,
    normalize_url,
    parse_backend,
)

__all__ = [
    "FALLBACK_REDIS",
    "SWEEP_PAGE",
    "Discovery",
    "Endpoint",
    "EndpointSlices",
    "FileEndpoints",
    "Pod",
    "StaticEndpoints",
    "normalize_url",
    "parse_backend",
]
