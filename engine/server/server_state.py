"""The server's config and state (admission capacity, drain, responses in flight), and the auth and
readiness checks every /v1 route passes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.server.errors import APIError
from kvmesh.engine.server.metrics import ServerMetrics

log = logging.getLogger("kvmesh.server")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 128
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS
    allow_runtime_lora_updating: bool = False  # the adapter load/unload routes (vLLM's env switch)

    @property
    def capacity(self) -> int:
        """Requests admitted at once: the running batch plus the bounded waiting queue."""
        return self.max_num_seqs + self.max_waiting


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    draining: bool = False
    active: int = 0  # admitted requests whose HTTP response has not finished yet
    started: float = field(default_factory=time.time)
    metrics: ServerMetrics | None = None

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(
            self.engine, self.config.served_model_name, lambda: self.draining
        )

    @property
    def ready(self) -> bool:
        return self.engine.loaded.is_set() and self.engine.alive and not self.draining

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: refusing new requests; %d in flight", self.engine.num_in_flight)
        self.draining = True

    async def wait_drained(self, timeout: float) -> bool:
        """Wait until every admitted request has finished and its response has been written.

        `active` counts responses still being written; a response whose generator never
        started (client gone before the first byte) would never decrement it, so once the
        engine has nothing in flight, responses get at most one more second.
        """
        deadline = time.monotonic() + timeout
        engine_idle_since: float | None = None
        while True:
            now = time.monotonic()
            if self.engine.num_in_flight == 0:
                engine_idle_since = engine_idle_since or now
                if self.active <= 0 or now - engine_idle_since > 1.0:
                    return True
            else:
                engine_idle_since = None
            if now >= deadline:
                return False
            await asyncio.sleep(0.05)


def check_ready(state: ServerState) -> None:
    if state.draining:
        state.metrics.reject("draining")
        raise APIError(
            503, "the server is draining and admits no new requests", headers={"Retry-After": "1"}
        )
    if not state.engine.loaded.is_set():
        raise APIError(503, "the model is still loading", headers={"Retry-After": "1"})
    if not state.engine.alive:
        raise APIError(503, "the engine is not running")


def check_auth(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "invalid or missing API key (send `Authorization: Bearer <key>`)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
