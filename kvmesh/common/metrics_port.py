"""/metrics alone on a port of its own, for the engine and the router.

Operator-rendered pods admit Prometheus scrapers to this port only (NetworkPolicy), so a
scraper never reaches an API route.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvmesh.metrics")


def serve_metrics_only(registry, host: str, port: int) -> None:
    """Serve ``registry`` on ``host:port`` from a daemon thread (prometheus_client's server)."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=host, registry=registry)
    log.info("metrics only on %s:%d", host, port)
