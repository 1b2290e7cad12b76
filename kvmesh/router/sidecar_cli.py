"""`kvmesh sidecar`: publish one engine's KV-cache events and load to Redis."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from kvmesh.router.logging_setup import setup_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-url", default="http://127.0.0.1:8000")
    p.add_argument("--kv-events-endpoint", default="tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay-endpoint", default="tcp://127.0.0.1:5558",
                   help="the engine's replay socket; 'none' to disable")
    p.add_argument("--redis-url", default=os.environ.get("KVMESH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--pod-name", default=os.environ.get("POD_NAME") or socket.gethostname())
    p.add_argument("--pod-url", default=os.environ.get("KVMESH_POD_URL"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--engine-format", choices=["kvmesh", "vllm"], default="kvmesh")
    p.add_argument("--log-format", choices=["json", "text"], default=os.environ.get("KVMESH_LOG_FORMAT", "json"))
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.sidecar import Sidecar, SidecarConfig, default_pod_url

    setup_logging(args.log_format, args.log_level)
    replay = None if (args.kv_events_replay_endpoint or "").lower() in ("", "none") else args.kv_events_replay_endpoint
    cfg = SidecarConfig(
        pod_name=args.pod_name, pod_url=args.pod_url or default_pod_url(), model=args.model,
        engine_url=args.engine_url.rstrip("/"), kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=replay, redis_url=args.redis_url, block_size=args.block_size,
        heartbeat_interval=args.heartbeat_interval, engine_format=args.engine_format,
    )
    sidecar = Sidecar(cfg).start()
    done = threading.Event()

    def on_signal(signum, _frame):
        logging.getLogger("kvmesh.sidecar").info("signal %d: marking draining and removing keys", signum)
        sidecar.mark_draining()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("kvmesh.sidecar").info("sidecar for %s (%s) -> %s", cfg.pod_name, cfg.pod_url,
                                             _redact(cfg.redis_url))
    done.wait()
    sidecar.stop(clean=True)
    return 0


def _redact(url: str) -> str:
    from kvmesh.router.logging_setup import redact_url

    return redact_url(url)
