"""The metrics-only port: scrapers admitted there (NetworkPolicy) see /metrics and no API."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter

from kvmesh.common.metrics_port import serve_metrics_only
from kvmesh.common.ports import free_port


def test_metrics_port_serves_the_registry_and_nothing_else():
    registry = CollectorRegistry()
    Counter("kvmesh_test_requests", "test counter", registry=registry).inc(3)
    port = free_port()
    serve_metrics_only(registry, "127.0.0.1", port)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "kvmesh_test_requests_total 3.0" in metrics.text
        # No API behind it: a completion request is not served as one.
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert reply.status_code >= 400 or "choices" not in reply.text


def test_engine_and_router_take_the_flag():
    import argparse

    from kvmesh.engine.server.cli import add_arguments as engine_args
    from kvmesh.router.cli import add_arguments as router_args

    for add in (engine_args, router_args):
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args(["--metrics-port", "8001"]).metrics_port == 8001
        assert parser.parse_args([]).metrics_port is None
