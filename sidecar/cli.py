"""`kvmesh sidecar`: publish one engine's KV-cache events and load to Redis."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.logging_setup import setup_logging
from kvmesh.common.model_lookup import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-url",
        default="http://127.0.0.1:8000",
        help="the engine in this pod (for `/ready`, `/metrics`)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default="tcp://127.0.0.1:5557",
        help="the engine's KV-event PUB socket",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default="tcp://127.0.0.1:5558",
        help="the engine's replay socket; 'none' to disable",
    )
    p.add_argument(
        "--redis-url", default=os.environ.get("KVMESH_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument(
        "--pod-name",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="identity of this replica in Redis",
    )
    p.add_argument(
        "--pod-url",
        default=os.environ.get("KVMESH_POD_URL"),
        help="where the router reaches this engine (default: `http://$POD_IP:8000`)",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="served model name (block-key model identity)"
    )
    p.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="must match the engine"
    )
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument(
        "--engine-format",
        choices=["kvmesh", "vllm"],
        default="kvmesh",
        help="`vllm`: readiness from /health and /v1/models (with the key in "
        "KVMESH_ENGINE_API_KEY, if any), contract keys recomputed from token ids (docs/vllm.md)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /health (liveness), /ready (readiness) and /metrics on this port; "
        "both probes fail when the KV-event loop is dead or stale (default: off)",
    )
    p.add_argument("--health-host", default="0.0.0.0")
    p.add_argument(
        "--events-stale-after",
        type=float,
        default=20.0,
        help="seconds without a completed KV-event loop iteration before the index is stale",
    )
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=os.environ.get("KVMESH_LOG_FORMAT", "json"),
    )
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    from kvmesh.sidecar.config import SidecarConfig, default_pod_url
    from kvmesh.sidecar.service import Sidecar

    setup_logging(args.log_format, args.log_level)
    replay = (
        None
        if (args.kv_events_replay_endpoint or "").lower() in ("", "none")
        else args.kv_events_replay_endpoint
    )
    cfg = SidecarConfig(
        pod_name=args.pod_name,
        pod_url=args.pod_url or default_pod_url(),
        model=args.model,
        engine_url=args.engine_url.rstrip("/"),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=replay,
        redis_url=args.redis_url,
        block_size=args.block_size,
        heartbeat_interval=args.heartbeat_interval,
        engine_format=args.engine_format,
        health_host=args.health_host,
        health_port=args.health_port,
        events_stale_after=args.events_stale_after,
        engine_api_key=os.environ.get("KVMESH_ENGINE_API_KEY") or None,
    )
    if cfg.health_port is not None and not 0 <= cfg.health_port <= 65535:
        raise SystemExit(f"kvmesh sidecar: --health-port must be 0..65535, got {cfg.health_port}")
    if cfg.events_stale_after <= 0:
        raise SystemExit("kvmesh sidecar: --events-stale-after must be positive")
    sidecar = Sidecar(cfg).start()
    done = threading.Event()

    def on_signal(signum, _frame):
        logging.getLogger("kvmesh.sidecar").info(
            "signal %d: marking draining and removing keys", signum
        )
        sidecar.mark_draining()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("kvmesh.sidecar").info(
        "sidecar for %s (%s) -> %s", cfg.pod_name, cfg.pod_url, _redact(cfg.redis_url)
    )
    rc = 0
    while not done.wait(1.0):
        # The events thread never ends on its own; if it did, the index is frozen: exit so the
        # supervisor (Kubernetes, `kvmesh up`) restarts the sidecar, which rebuilds it by replay.
        events = sidecar.events.thread
        if events is not None and not events.is_alive():
            logging.getLogger("kvmesh.sidecar").critical(
                "the KV-event loop is dead (%s); exiting", sidecar.events.error
            )
            rc = 1
            break
    sidecar.stop(clean=True)
    return rc


def _redact(url: str) -> str:
    from kvmesh.common.logging_setup import redact_url

    return redact_url(url)
