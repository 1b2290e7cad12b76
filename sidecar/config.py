"""The sidecar's settings: one dataclass, filled from `kvmesh sidecar`'s flags (or by a test)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.model_lookup import DEFAULT_MODEL


@dataclass
class SidecarConfig:
    pod_name: str
    pod_url: str
    model: str = DEFAULT_MODEL
    engine_url: str = "http://127.0.0.1:8000"
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    redis_url: str = "redis://127.0.0.1:6379/0"
    block_size: int = DEFAULT_BLOCK_SIZE
    heartbeat_interval: float = 1.0
    engine_format: str = "kvmesh"  # or "vllm"
    engine_down_after: int = 2  # failed polls before the heartbeat is withdrawn
    max_backoff: float = 5.0
    health_host: str = "0.0.0.0"
    health_port: int | None = (
        None  # /health, /ready, /metrics; None: no health server (0: any free port)
    )
    events_stale_after: float = (
        20.0  # an events loop without a completed iteration this long is stale
    )
    engine_api_key: str | None = None  # sent to the engine (vLLM's /v1/models wants it)


def default_pod_url() -> str:
    """Where the router reaches this pod's engine: the Pod's IP (downward API), port 8000."""
    ip = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"http://{ip}:8000"
