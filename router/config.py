"""The router's settings: one dataclass, filled from `kvmesh router`'s flags (router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common import redis_layout as rl
from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.router import policies
from kvmesh.router.auth import KeyInfo
from kvmesh.router.flow.settings import FlowSettings
from kvmesh.router.scoring import Weights


@dataclass
class RouterConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    static_backends: list[str] = field(default_factory=list)
    policy: str = policies.DEFAULT
    weights: Weights = field(default_factory=Weights)
    block_size: int = DEFAULT_BLOCK_SIZE
    api_keys: dict[str, KeyInfo] | None = None
    rate_limit_rpm: float | None = None
    rate_limit_tpm: float | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_retries: int = 2
    connect_timeout: float = 2.0
    read_timeout: float = 300.0
    request_timeout: float | None = None
    eject_after: int = 3
    eject_seconds: float = 10.0
    hot_ratio: float = 2.0
    hot_min: int = 2
    session_header: str = "x-session-id"
    redis_timeout: float = 0.25
    redis_retry_after: float = 1.0
    refresh_interval: float = 0.5
    upstream_api_key: str | None = None
    k8s_service: str | None = None
    k8s_namespace: str | None = None
    k8s_api_url: str | None = None
    backends_file: str | None = None  # NAME=URL lines, re-read on change (kvmesh up's supervisor)
    redis_stale_after: float = float(rl.HEARTBEAT_TTL_S)  # then route to known pods by load only
    # scale from zero: requests held while no pod is routable
    max_pending_requests: int = 256
    scale_from_zero_timeout: float = 300.0
    vocab_size: int | None = None  # token ids must be below it (default: the model's config.json)
    max_resumes: int = (
        2  # times a request whose engine failed goes on with another replica (0: never)
    )
    tool_call_parser: str = (
        "hermes"  # the engines' tool format, for templates that do not read tools
    )
    engine: str = "kvmesh"  # the engines' kind: "vllm" changes readiness and how streams resume
    resume_timeout: float = (
        60.0  # how long it waits for one when none is routable (an engine restarting)
    )
    flow: FlowSettings = field(default_factory=FlowSettings)  # flow control (router/flow)

    @property
    def holds(self) -> bool:
        """Whether requests are held while no pod is routable (scale from zero)."""
        return self.max_pending_requests > 0 and self.scale_from_zero_timeout > 0
